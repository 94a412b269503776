"""Sharded loading: build the HF model on the meta device, shard it, then fill each rank's shard from the
safetensors slices it owns, in the storage dtype. No rank ever holds a whole parameter it does not own, and
none holds a full float32 copy of the model.

    hf = build_meta_model(path, ...)           # parameters on meta; buffers (rotary tables) real, on the host
    ... TP parallelize_module / fully_shard on the meta model ...
    materialise(root, hf, path, device, dtype) # to_empty, then per parameter: read my block, cast, copy
"""
from __future__ import annotations

import logging
import math
from contextlib import ExitStack

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from spmdrl.errors import ConfigError
from spmdrl.models.checkpoint import CheckpointReader, checkpoint_index
from spmdrl.models.model import class_supports, class_takes_attention_functions, dropout_off, eager_only_attention, meta_model
from spmdrl.models.vision import is_vision_language

log = logging.getLogger("spmdrl")

HEAD_PREFIXES = ("score.", "classifier.")  # a critic's fresh value head: not in a causal-LM checkpoint


def build_meta_model(model_path: str, *, value_head: bool, trust_remote_code: bool, dtype: torch.dtype = torch.float32,
                     attn_implementation: str = "sdpa", switch_attention: bool = True):
    """The HF model with every parameter on the meta device (no memory), in the storage dtype, and real buffers
    on the host; dropout off; attention by the transformers implementation `attn_implementation` (a registered
    name), or with switch_attention by the one this model needs (SDPA for a model with its own attention classes,
    eager for attention soft-capping or sinks; one log line each)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path = {model_path!r}: cannot load the model ({e}); give an HF model directory or hub id") from None
    if is_vision_language(config) and value_head:
        raise ConfigError(f"model.path = {model_path!r}: a vision-language model ({config.model_type}) as a critic or "
                          "reward model is not supported; give a text model")
    if not value_head and not is_vision_language(config) and \
            getattr(config, "get_text_config", lambda: config)() is not config:
        raise ConfigError(f"model.path = {model_path!r}: model type {config.model_type!r} is a multimodal model "
                          f"({', '.join(getattr(config, 'architectures', None) or [type(config).__name__])}); spmdrl "
                          "trains text models: give a checkpoint of its language model alone (its text model type, "
                          f"{config.get_text_config().model_type!r})")
    switched_off = dropout_off(config)
    if switched_off:
        log.info("model.path = %r: dropout set to 0 for training (%s; vLLM never applies it): the update's forward "
                 "must compute the policy that sampled", model_path, ", ".join(switched_off))
    if is_vision_language(config) and attn_implementation not in ("sdpa", "eager"):
        # its vision tower runs bidirectional attention over each image through the same attention functions, which
        # spmdrl's causal kernels are not
        log.info("model.path = %r (%s, vision-language): it trains with transformers' SDPA attention and padded rows",
                 model_path, config.model_type)
        attn_implementation = "sdpa"
    if attn_implementation not in ("sdpa", "eager") and not class_takes_attention_functions(config, value_head):
        attn_implementation = "sdpa" if class_supports(config, value_head, "_supports_sdpa") else "eager"
        log.info("model.path = %r (%s) runs its own attention classes, not transformers' attention functions: it "
                 "trains with transformers' %s attention and explicit masks (packed batches laid out as padded rows)",
                 model_path, config.model_type, attn_implementation)
    needs = eager_only_attention(config)
    if needs and attn_implementation != "eager":
        if not switch_attention:
            raise ConfigError(f"model.path = {model_path!r}: {needs}, which only transformers' eager attention computes; "
                              "set model.attn_implementation = 'eager' (or 'auto', which picks it)")
        log.info("model.path = %r: %s, which only transformers' eager attention computes: the training engines use it "
                 "(packed batches laid out as padded rows)", model_path, needs)
        attn_implementation = "eager"
    hf = meta_model(config, value_head=value_head, trust_remote_code=trust_remote_code,
                    attn_implementation=attn_implementation, dtype=dtype)
    _real_buffers(hf)
    return hf


def _real_buffers(hf: nn.Module) -> None:
    """Buffers computed at construction (rotary inverse frequencies) came out on meta: rebuild the modules
    that own them on the host. HF rotary embeddings are built from the model config alone."""
    for name, mod in hf.named_modules():
        if not any(b.is_meta for b in mod.buffers(recurse=False)):
            continue
        try:
            fresh = type(mod)(getattr(mod, "config", None) or hf.config)  # a sub-model's rotary: its own config
        except TypeError as e:  # built from more than the config (Gemma 3's scaled embedding): the model's own
            # weight initialisation fills its non-persistent buffers, as transformers' loading does
            for bname, b in list(mod.named_buffers(recurse=False)):
                mod._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
            if not hasattr(hf, "_init_weights"):
                raise ConfigError(f"cannot build {type(mod).__name__} ({name}) off the meta device: {e}") from None
            with torch.no_grad():
                hf._init_weights(mod)
            continue
        for bname, b in fresh.named_buffers(recurse=False):
            mod._buffers[bname] = b
        for k, v in vars(fresh).items():  # attention_scaling and the like
            if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module)):
                setattr(mod, k, v)


def local_block(p) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of this rank's shard of parameter p in the full tensor."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(offset), tuple(shape)
    return tuple(0 for _ in p.shape), tuple(p.shape)


def materialise(root: nn.Module, hf: nn.Module, model_path: str, device: torch.device,
                initializer_range: float = 0.02, init_fresh=None) -> dict[str, int]:
    """Allocate `root`'s (sharded) parameters on `device` (in the dtype they were built in) and fill this rank's blocks from the
    checkpoint; returns {"bytes_read": ...}. Parameters missing from the checkpoint are allowed only for a
    value head, initialised like HF's _init_weights (normal(0, initializer_range), zero bias) from the global
    RNG, which every rank seeds alike. init_fresh(name, shape) -> full tensor or None: parameters that do not come
    from the checkpoint (LoRA adapters, spmdrl/engines/lora.py); with it, a LoRA-wrapped layer's `.base_layer.`
    weight is read under the checkpoint's own name."""
    buffers = {n: b.clone() for n, b in root.named_buffers()}
    root.to_empty(device=device)
    with torch.no_grad():
        for n, b in root.named_buffers():
            b.copy_(buffers[n])
    index = checkpoint_index(model_path)
    prefix = next((n + "." for n, m in root.named_modules() if m is hf), "")
    bytes_read = 0
    with ExitStack() as stack, torch.no_grad():
        reader = CheckpointReader(index, hf.config, stack)
        for name, p in hf.named_parameters():
            offs, shape = local_block(p)
            local = p.to_local() if isinstance(p, DTensor) else p
            fresh = init_fresh(name, p.shape) if init_fresh is not None else None
            source = name.replace(".base_layer.", ".") if init_fresh is not None else name
            if fresh is not None:
                block = fresh[tuple(slice(o, o + s) for o, s in zip(offs, shape))]
            elif not reader.has(source):
                if not name.startswith(HEAD_PREFIXES):
                    raise ConfigError(f"model.path = {model_path!r}: the checkpoint has no parameter {name!r} ({prefix}{name})")
                full = torch.zeros(p.shape) if name.endswith("bias") else torch.empty(p.shape).normal_(0.0, initializer_range)
                block = full[tuple(slice(o, o + s) for o, s in zip(offs, shape))]
            else:
                block = reader.read(source, tuple(p.shape), offs, shape) if math.prod(shape) else torch.empty(shape)
                bytes_read += block.numel() * block.element_size()
            local.copy_(block.reshape(local.shape).to(local.dtype))
            del block
    return {"bytes_read": bytes_read}
