"""Activation recompute policies of the FSDP2 engine (model.gradient_checkpointing with model.checkpoint_policy,
model.checkpoint_every_n_layers and model.checkpoint_offload).

full       every checkpointed decoder layer keeps only its input and reruns its whole forward in backward: the
           least memory, one extra forward of the layers (about a third more FLOPs for the update);
selective  the layer keeps the outputs of its matmuls and of attention and reruns only the cheap ops between
           them (norms, rotary embedding, SiLU and products, residual adds): no matmul or attention is recomputed,
           and the memory saved is what those elementwise ops would have kept.
every_n_layers > 1 checkpoints every n-th layer only (the others keep all their activations); offload puts what
the checkpoints keep in pinned host memory (a device-to-host copy per layer in forward, host-to-device in backward).
"""
from __future__ import annotations

import functools
import importlib

import torch

POLICIES = ("full", "selective")


def _kept_ops() -> set:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_flash_attention_forward", "_efficient_attention_forward"):
        op = getattr(aten, name, None)
        if op is not None:
            ops.add(op.default)
    # the packed path on CUDA (engines/attention.py _varlen_cuda): torch's varlen_attn runs as one custom op,
    # which a dispatch-level policy sees whole (the flash or cuDNN call inside it is never shown to the policy),
    # and flash-attn's varlen function, also a custom op; each is registered when its module is imported
    try:
        importlib.import_module("torch.nn.attention.varlen")  # registers torch.ops.torch_attn
    except ImportError:
        pass
    for namespace, name in (("torch_attn", "_varlen_attn"), ("flash_attn", "_flash_attn_varlen_forward")):
        try:
            ops.add(getattr(getattr(torch.ops, namespace), name).default)
        except (AttributeError, RuntimeError):
            pass
    return ops


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = _kept_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_kwargs(policy: str) -> dict:
    """Keyword arguments of torch.utils.checkpoint.checkpoint for `policy` (full or selective)."""
    if policy == "full":
        return {"use_reentrant": False}
    if policy == "selective":
        return {"use_reentrant": False, "context_fn": functools.partial(_selective_context)}
    raise ValueError(f"checkpoint policy {policy!r} is not one of {', '.join(POLICIES)}")


def enable(hf_model, policy: str = "full", every_n_layers: int = 1, offload: bool = False) -> None:
    """Turn on activation recompute in an HF model's decoder layers with `policy`."""
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(policy),
                                           every_n_layers=every_n_layers, offload=offload)
