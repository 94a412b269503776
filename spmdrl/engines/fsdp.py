"""FSDP2 training engine: HF causal LM, `fully_shard` per decoder block, optional DTensor TP, AdamW.

The engine knows nothing about RL. It turns packed token batches into per-token log-probs (and entropy)
and applies an optimizer step from a loss callback; the trainer decides what the loss is.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from spmdrl.algos.token_stats import logprobs_from_hidden, logprobs_from_model_logits
from spmdrl.config.derived import resolve_dtype
from spmdrl.engines.base import accumulate, clipped_step, forward_each, lr_lambda, resident, state_storages, step_metrics
from spmdrl.engines.attention import HF_IMPLEMENTATION
from spmdrl.models.model import backbone_of, decoder_blocks
from spmdrl.models.vision import copy_image_processor, is_vision_language
from spmdrl.engines.loading import build_meta_model, materialise
from spmdrl.engines.response_index import ResponseIndex
from spmdrl.engines.router_replay import RouterReplay, moe_routers
from spmdrl.engines.sequence_parallel import SequenceShard
from spmdrl.engines.token_batch import TokenBatch, dense_rows, relayout
from spmdrl.dist.blocks import Block, fsdp_blocks, numel
from spmdrl.dist.meshes import RoleMesh
from spmdrl.errors import ConfigError, SpmdrlError

log = logging.getLogger("spmdrl")


def _model_inputs(hf: nn.Module, b: TokenBatch, shard: SequenceShard | None = None) -> tuple[dict, TokenBatch]:
    """The keyword arguments of the backbone's (or the whole model's) forward for batch b, and the batch they
    belong to.

    Under spmdrl's attention (engines/attention.py, model.attn_implementation = "auto") a packed batch goes in
    as it is, its boundaries as the cu_seq_lens / max_length keyword arguments every attention layer receives,
    and a padded batch without its mask (right padding: causal attention is exact for every real token); no
    mask tensor is built. Under transformers' own attention ("sdpa", "eager") a padded batch's [B, L] mask goes
    in as it is; a packed batch is first laid out in rows with the dense block-diagonal mask (dense_rows) for
    SDPA, and as padded rows for eager.

    shard (sequence parallelism, engines/sequence_parallel.py): only this rank's tokens go in, the hidden states
    come out as [N, hi - lo, H], and every attention layer gets the shard (it exchanges heads over the sp group)."""
    kw = {}
    ids, pos = b.input_ids, b.position_ids
    if is_vision_language(hf.config):
        if b.cu_seqlens is not None:  # a packed batch of text alone
            b = relayout(b, packed=False)
        return _vision_language_inputs(hf, b), b
    if shard is not None:
        mask, kw = None, dict(sp=shard)
        ids, pos = shard.local(ids), shard.local(pos)
    elif hf.config._attn_implementation == HF_IMPLEMENTATION:
        mask = b.mask if b.mask is not None and b.mask.dim() == 4 else None
        if b.cu_seqlens is not None:
            kw = dict(cu_seq_lens_q=b.cu_seqlens, cu_seq_lens_k=b.cu_seqlens, max_length_q=b.max_seqlen,
                      max_length_k=b.max_seqlen)
    else:  # eager: padded rows, whose [B, L] mask transformers turns into its own causal (and window) masks
        if b.cu_seqlens is not None:
            b = relayout(b, packed=False) if hf.config._attn_implementation == "eager" else dense_rows(b)
        ids, pos, mask = b.input_ids, b.position_ids, b.mask
    return dict(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **kw), b


def _vision_language_inputs(hf: nn.Module, b: TokenBatch) -> dict:
    """A vision-language model's forward arguments: padded rows with their [B, L] mask (pack_sequences lays a batch
    with images out so; a packed text-only batch is laid out again), no position ids (the model computes each row's
    3-D rotary positions from the mask, its image tokens and the grids, as transformers does for one sample), the
    images' pixel values and grids."""
    from spmdrl.models.vision import token_types

    if b.cu_seqlens is not None or b.mask is None or b.mask.dim() != 2:
        raise ConfigError("a vision-language model's micro-batch must be padded rows (pack_sequences with vision)")
    types = token_types(b.input_ids, hf.config.image_token_id, b.resp_pos[:, 0] + 1)  # rows start at column 0
    kw = dict(input_ids=b.input_ids, attention_mask=b.mask, use_cache=False, mm_token_type_ids=types)
    merge = hf.config.vision_config.spatial_merge_size
    images = 0 if b.image_grid_thw is None else int(b.image_grid_thw.prod(-1).sum()) // (merge * merge)
    if int(types.sum()) != images:  # the model would embed the image tokens as text: say so
        raise SpmdrlError(f"a micro-batch of {type(hf).__name__} has {int(types.sum())} image tokens but images for "
                          f"{images}: its samples' images (Batch.meta['vision']) were lost on the way to the forward")
    if b.pixel_values is not None:
        kw.update(pixel_values=b.pixel_values, image_grid_thw=b.image_grid_thw)
    return kw


def vision_tower(hf: nn.Module) -> nn.Module | None:
    """A vision-language model's vision tower (Qwen-VL's `visual`, with its merger), None for a text model."""
    return getattr(backbone_of(hf), "visual", None) if is_vision_language(hf.config) else None


def _images_at_prompts(hf: nn.Module, kw: dict):
    """A vision-language forward's images go to its prompts' image tokens only (data/images.prompt_images_only)."""
    if "mm_token_type_ids" not in kw:
        return contextlib.nullcontext()
    from spmdrl.models.vision import prompt_images_only

    return prompt_images_only(backbone_of(hf), kw["mm_token_type_ids"])


def _backbone_hidden(hf: nn.Module, b: TokenBatch, shard: SequenceShard | None = None) -> tuple[torch.Tensor, TokenBatch]:
    """Last hidden states [N, L, H] and the batch they belong to (_model_inputs)."""
    kw, b = _model_inputs(hf, b, shard)
    with _images_at_prompts(hf, kw):
        return backbone_of(hf)(**kw).last_hidden_state, b


HEADS = ("fused", "model")  # the log-prob head: spmdrl's chunked kernel, or the model's own forward to logits


class _LogprobHead(nn.Module):
    """Root module: backbone forward + chunked log-probs from the LM head inside one FSDP root forward, so
    the root's parameters (embeddings, final norm, lm_head) are unsharded while they are used.

    head "fused" (default): spmdrl's chunked log-prob kernel on the last hidden states (the LM head's matmul, the
    final-logit soft-capping, temperature, truncation, log-softmax; no [tokens, vocab] tensor kept). head
    "model": the model's own forward to its logits (whatever its CausalLM head computes: a logit scale, a
    divisor, ...), then temperature, truncation and log-softmax over all of them: slower and [tokens, vocab] in
    memory, for models whose head the kernel does not express (the parity check picks it, loop/parity.py)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.head = "fused"

    def forward(self, b: TokenBatch, temperature: float, with_entropy: bool, chunk_size: int, top_k: int = -1,
                top_p: float = 1.0, index: ResponseIndex | None = None, shard: SequenceShard | None = None):
        """index: b's response positions computed on the host (FSDPEngine.logprobs; with a shard, those on this
        rank's tokens); None (or a batch the backbone laid out anew, transformers' attention with packing)
        computes them here. shard: sequence parallelism (this rank's tokens; results summed over sp)."""
        if self.head == "model":
            kw, laid_out = _model_inputs(self.hf, b, shard)
            with _images_at_prompts(self.hf, kw):
                logits = self.hf(**kw).logits
        else:
            hidden, laid_out = _backbone_hidden(self.hf, b, shard)
        if index is None or laid_out is not b:
            index = ResponseIndex.of(laid_out, batch_first=True).to(b.input_ids.device)
        if self.head == "model":
            z = logits.reshape(-1, logits.shape[-1]).index_select(0, index.hidden).float()  # [n, V]
            logp_flat, ent_flat = logprobs_from_model_logits(z, index.labels, temperature, top_k, top_p, with_entropy)
        else:
            h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index.hidden)  # [n, H]: no host read of a count
            weight = self.hf.get_output_embeddings().weight
            if isinstance(weight, DTensor):
                weight = weight.full_tensor()
            # with_entropy: True (differentiable), "detached" (computed without autograd, for the metric) or False
            logp_flat, ent_flat = logprobs_from_hidden(
                h, weight, index.labels, temperature=temperature, chunk_size=chunk_size,
                with_entropy=bool(with_entropy), entropy_grad=with_entropy != "detached", top_k=top_k, top_p=top_p,
                softcap=getattr(self.hf.config, "final_logit_softcapping", None),
            )
        logp, ent = index.scatter(logp_flat), (index.scatter(ent_flat) if with_entropy else None)
        if shard is not None:
            logp, ent = shard.gather(logp), (shard.gather(ent) if with_entropy else None)
        return logp, ent


class _ValueHead(nn.Module):
    """Root module of a critic: backbone + the token-classification head (one output) at response positions.
    V[b, j] is the value of the state that generates response token j."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, b: TokenBatch, index: ResponseIndex | None = None, shard: SequenceShard | None = None):
        """index and shard: as _LogprobHead's (sequence parallelism: the values of this rank's response tokens,
        summed over the sp group)."""
        hidden, b = _backbone_hidden(self.hf, b, shard)
        head = self.hf.score if hasattr(self.hf, "score") else self.hf.classifier
        if shard is None:
            h = hidden[b.rows(), b.resp_pos]
            return head(h).squeeze(-1).float() * b.resp_mask, None
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index.hidden)
        return shard.gather(index.scatter(head(h).squeeze(-1).float())), None


TP_PARTIAL_NORMS = ("q_norm", "k_norm")  # applied per head, inside the TP-sharded attention


def tp_plan():
    """DTensor TP plan of a backbone with separate q/k/v/o and gate/up/down projections (Llama, Qwen2/3, Mistral,
    Gemma 3; the reshard planner's fsdp_tp_style mirrors it). Config validation refuses actor_tp > 1 for a model
    without them."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel, RowwiseParallel
    return {
        "layers.*.self_attn.q_proj": col(), "layers.*.self_attn.k_proj": col(), "layers.*.self_attn.v_proj": col(),
        "layers.*.self_attn.o_proj": row(), "layers.*.mlp.gate_proj": col(), "layers.*.mlp.up_proj": col(),
        "layers.*.mlp.down_proj": row(),
    }


ATTN_IMPLEMENTATIONS = ("auto", "spmdrl", "sdpa", "eager")
LOGPROB_HEADS = ("auto",) + HEADS


def model_attention(attn_implementation: str) -> str:
    """The transformers attention implementation an engine builds its model with, from
    model.attn_implementation: "auto" and "spmdrl" -> spmdrl's kernels (engines/attention.py: varlen for packed
    batches, causal SDPA without a mask for padded ones), "sdpa" / "eager" -> transformers' own, explicit masks."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"model.attn_implementation = {attn_implementation!r}: use one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    if attn_implementation in ("sdpa", "eager"):
        return attn_implementation
    from spmdrl.engines.attention import register_hf

    return register_hf()


class FSDPEngine:
    """One HF causal LM sharded over a role mesh: FSDP2 over "dp", DTensor TP over "tp" when tp > 1."""

    def __init__(
        self,
        model_path: str,
        mesh: RoleMesh,
        device: torch.device,
        *,
        trainable: bool,
        dtype: str = "auto",
        gradient_checkpointing: bool = False,
        offload: bool = False,
        trust_remote_code: bool = False,
        value_head: bool = False,
        optim: dict | None = None,
        total_steps: int = 1,
        defer_grad_sync: bool = False,
        lora=None,
        compile: bool = False,
        checkpoint_policy: str = "full",
        checkpoint_every_n_layers: int = 1,
        checkpoint_offload: bool = False,
        attn_implementation: str = "auto",
        logprob_head: str = "auto",
        router_replay: bool = False,
        router_losses: bool = False,
        freeze_vision_tower: bool = False,
    ):
        """attn_implementation, logprob_head: model.attn_implementation and model.logprob_head ("auto": spmdrl's
        kernels, switched to transformers' own by the model's needs and by the parity check). router_replay: a mixture-of-experts model's forwards route each token to the experts its TokenBatch.routes
        name (engines/router_replay.py); without it they only measure the agreement. router_losses: its forwards
        under autograd keep the load-balancing and z-loss terms (moe_losses). freeze_vision_tower: a vision-language
        model's vision tower (and its merger into the language model) is not trained."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        self.device = device
        self.mesh = mesh
        if mesh.pp_size > 1:
            raise ConfigError(f"the FSDP2 backend has no pipeline parallelism: {mesh.layout.role}_pp = {mesh.pp_size}; set it to 1")
        cuda = device.type == "cuda"
        param_dtype = getattr(torch, resolve_dtype(dtype, cuda))
        # trainable: float32 master shards (bf16 compute under mixed precision); frozen (ref, or the base under
        # LoRA adapters): the compute dtype
        store_dtype = torch.float32 if trainable and lora is None else param_dtype
        if logprob_head not in LOGPROB_HEADS:
            raise ConfigError(f"model.logprob_head = {logprob_head!r}: use one of {', '.join(LOGPROB_HEADS)}")
        hf = build_meta_model(model_path, value_head=value_head, trust_remote_code=trust_remote_code, dtype=store_dtype,
                              attn_implementation=model_attention(attn_implementation),
                              switch_attention=attn_implementation == "auto")
        self.switchable = (attn_implementation == "auto", logprob_head == "auto")  # what the parity check may change
        hf.config.use_cache = False
        if mesh.sp_size > 1:
            _check_sequence_parallel(hf.config, mesh, model_path)
        if gradient_checkpointing and trainable:
            from .recompute import enable as enable_recompute

            enable_recompute(hf, checkpoint_policy, checkpoint_every_n_layers, checkpoint_offload and cuda)
        self.lora = None  # the resolved LoRA settings (spmdrl.models.lora.LoraSettings) when adapters are trained
        self.model_path = model_path
        init_fresh = None
        if lora is not None:
            from . import lora as lora_mod

            if not trainable:
                raise ConfigError("LoRA adapters need a trainable engine (the frozen base is the reference policy)")
            self.lora = lora_mod.inject(hf, lora, trainable_head=value_head)
            init_fresh = lora_mod.adapter_init(self.lora)
        elif not trainable:
            hf.requires_grad_(False)
        self.vision_tower = vision_tower(hf)
        if freeze_vision_tower:
            if self.vision_tower is None:
                raise ConfigError(f"actor.freeze_vision_tower = true: model.path = {model_path!r} has no vision tower")
            self.vision_tower.requires_grad_(False)
        if mesh.tp_size > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            backbone = backbone_of(hf)
            plan = tp_plan()
            if self.lora is not None:
                from .lora import tp_plan as lora_tp_plan

                plan = lora_tp_plan(plan, self.lora.target_modules)
            parallelize_module(backbone, mesh.submesh("tp"), plan)
        self.module = _ValueHead(hf) if value_head else _LogprobHead(hf)
        if logprob_head == "model" and not value_head:
            self.module.head = "model"
        self.router = RouterReplay(hf, replay=router_replay, aux=router_losses) if moe_routers(hf) else None  # MoE only
        self.host_offload_policy = offload and cuda
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype != torch.float32 else MixedPrecisionPolicy()
        kw = dict(mesh=mesh.shard_mesh(), mp_policy=mp)  # "dp", or dp x sp with sequence parallelism
        if self.host_offload_policy:
            kw["offload_policy"] = CPUOffloadPolicy()
        blocks = decoder_blocks(backbone_of(hf))
        if self.vision_tower is not None:  # its own FSDP unit: gathered once per forward, frozen or not as a whole
            fully_shard(self.vision_tower, **kw)
        for i, block in enumerate(blocks):
            if compile:  # the block's own computation; FSDP2's hooks around it stay eager
                block.forward = torch.compile(block.forward, dynamic=True)
            # a trainable engine's last block is needed again at once by the backward: keeping it gathered after the
            # forward saves one all-gather per micro-batch (forward-only engines reshard every block)
            fully_shard(block, **kw, reshard_after_forward=not (trainable and i == len(blocks) - 1))
        fully_shard(self.module, **kw)  # the root: FSDP2 keeps it gathered between forward and backward
        # each rank reads only its blocks of the checkpoint (spmdrl/engines/loading.py)
        self.load_stats = materialise(self.module, hf, model_path, torch.device("cpu") if self.host_offload_policy else device,
                                      initializer_range=getattr(hf.config, "initializer_range", 0.02),
                                      init_fresh=init_fresh)
        self.hf = hf
        self.trainable = trainable
        self.defer_grad_sync = defer_grad_sync
        self._shards_checked = False
        self._my_blocks: dict | None = None
        # per-head norms (Qwen3's and Gemma 3's q_norm / k_norm) act on this TP rank's heads only: their gradient
        # here is a partial sum, completed over the TP group before the step (the replicas would drift apart)
        self._tp_partial = [p for n, p in hf.named_parameters() if p.requires_grad and mesh.tp_size > 1
                            and n.rsplit(".", 2)[-2] in TP_PARTIAL_NORMS]
        self._tp_group = mesh.submesh("tp").get_group() if self._tp_partial else None
        self.optimizer = self.scheduler = None
        if trainable:
            o = optim or {}
            self.optimizer = torch.optim.AdamW(
                [p for p in self.module.parameters() if p.requires_grad], lr=o.get("lr", 1e-6), betas=tuple(o.get("betas", (0.9, 0.999))),
                eps=o.get("eps", 1e-8), weight_decay=o.get("weight_decay", 0.0),
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer,
                lr_lambda(o.get("warmup_steps", 0), total_steps, o.get("lr_scheduler", "constant"), o.get("min_lr_ratio", 0.0)),
            )
            self.grad_clip = o.get("grad_clip", 0.0)

    # ---- forward ------------------------------------------------------------------------------------
    def logprobs(self, b: TokenBatch, *, temperature: float = 1.0, with_entropy: bool = False, chunk_size: int = 1024,
                 top_k: int = -1, top_p: float = 1.0):
        index, shard = self._index(b)
        self._route(b)
        return self.module(b.to(self.device), temperature, with_entropy, chunk_size, top_k, top_p, index, shard)

    # ---- compute paths (the parity check, loop/parity.py) -------------------------------------------------
    @property
    def compute(self) -> tuple[str, str]:
        """(attention, head) the forwards run with: attention "spmdrl" (engines/attention.py), "sdpa" or "eager"
        (transformers' own); head "fused" (spmdrl's chunked kernel) or "model" (the model's own logits)."""
        impl = self.hf.config._attn_implementation
        return ("spmdrl" if impl == HF_IMPLEMENTATION else impl), self.module.head

    def compute_options(self) -> list[tuple[str, str]]:
        """The (attention, head) pairs the parity check may choose, fastest first: the engine's own, and where
        model.attn_implementation / model.logprob_head are "auto" the slower ones of transformers."""
        attn, head = self.compute
        return [c for c in self._runnable() if (self.switchable[0] or c[0] == attn) and (self.switchable[1] or c[1] == head)]

    def _runnable(self) -> list[tuple[str, str]]:
        """Every (attention, head) this model can run with, fastest first (the model's own head and transformers'
        eager attention keep [tokens, vocab] logits and [heads, L, L] scores: last)."""
        from spmdrl.models.model import eager_only_attention, takes_attention_functions

        if self.mesh.sp_size > 1:  # Ulysses lives inside spmdrl's attention
            attns = ["spmdrl"]
        elif eager_only_attention(self.hf.config):  # soft-capping, sinks: nothing else computes them
            attns = ["eager"]
        elif takes_attention_functions(self.hf):
            attns = ["spmdrl", "sdpa", "eager"]
        else:  # its own attention classes, chosen when it was built
            attns = [self.compute[0]]
        heads = list(HEADS) if isinstance(self.module, _LogprobHead) else ["fused"]
        return sorted(((a, h) for a in attns for h in heads),
                      key=lambda ah: (ah[0] == "eager", ah[1] == "model", attns.index(ah[0])))

    def set_compute(self, attention: str, head: str) -> None:
        """Run the forwards with (attention, head), one of _runnable()."""
        if (attention, head) not in self._runnable():
            raise ConfigError(f"{self.model_path}: cannot run attention {attention!r} with head {head!r}; "
                              f"options: {self._runnable()}")
        if attention != self.compute[0]:
            self.hf.set_attn_implementation(HF_IMPLEMENTATION if attention == "spmdrl" else attention)
        self.module.head = head

    def reference_logprobs(self, b: TokenBatch, *, temperature: float = 1.0) -> torch.Tensor:
        """log p(response token) [B, R] from transformers' own forward of this model: its eager attention with its
        own masks, its own head to the logits, then temperature and a float32 log-softmax; the engine's compute
        path is back as it was afterwards. The parity check's reference for the engine's own kernels."""
        was = self.compute
        self.set_compute("eager" if "eager" in {a for a, _ in self._runnable()} else was[0], "model")
        try:
            with torch.no_grad():
                return self.logprobs(b, temperature=temperature)[0].float()
        finally:
            self.set_compute(*was)

    def module_summary(self) -> str:
        """E.g. "Qwen2ForCausalLM (Qwen2DecoderLayer: Qwen2Attention, Qwen2MLP, Qwen2RMSNorm)"."""
        layer = decoder_blocks(backbone_of(self.hf))[0]
        parts = dict.fromkeys(type(m).__name__.removeprefix("FSDP") for m in layer.children())
        return f"{type(self.hf).__name__.removeprefix('FSDP')} ({type(layer).__name__.removeprefix('FSDP')}: " \
               f"{', '.join(parts)})"

    def _index(self, b: TokenBatch) -> tuple[ResponseIndex, SequenceShard | None]:
        """b's response positions, from the host batch before it moves; with sequence parallelism the shard of b
        on this rank and the positions on its tokens."""
        index = ResponseIndex.of(b, batch_first=True)
        if self.mesh.sp_size == 1:
            return index.to(self.device), None
        shard = SequenceShard.of(b, self.mesh)
        return shard.local_index(index, b.input_ids.shape[1]).to(self.device), shard.to(self.device)

    def adapters_disabled(self):
        """A context in which the forward heads compute the base model alone: with LoRA, the reference policy
        (the same weights, no second copy). Without adapters there is nothing to disable (a ConfigError)."""
        if self.lora is None:
            raise ConfigError("adapters_disabled() needs an engine built with LoRA adapters (lora.enable = true)")
        from .lora import disabled

        return disabled(self.hf)

    def values(self, b: TokenBatch) -> torch.Tensor:
        """Critic values [B, R] at response positions (zero on padding)."""
        index, shard = self._index(b)
        self._route(b)
        return self.module(b.to(self.device), index, shard)[0]

    def _route(self, b: TokenBatch) -> None:
        if self.router is not None:
            self.router.set_batch(b.routes, b.mask)

    def moe_losses(self):
        """(load-balancing loss, z-loss) of the last forward, summed over the MoE layers (engines/router_replay.py);
        None for a dense model, without router_losses or outside autograd."""
        return self.router.moe_losses() if self.router is not None else None

    def moe_counts(self) -> dict[str, torch.Tensor]:
        """The routers' counts since the last call (engines/router_replay.py; {} for a dense model)."""
        return self.router.take_counts() if self.router is not None else {}

    def forward_micro_batches(self, tbs: list, head: str, **head_kw) -> list[torch.Tensor]:
        """See TrainEngine.forward_micro_batches: one forward per token batch."""
        return forward_each(self, tbs, head, **head_kw)

    # ---- update -------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list, loss_fn: Callable) -> dict[str, float]:
        """One optimizer step over `micro_batches`; loss_fn(micro, engine) -> (loss, metrics).

        Gradients are reduce-scattered after every micro-batch into the sharded float32 gradient (no unsharded
        accumulator); with defer_grad_sync only after the last one, which keeps an unsharded float32 gradient of
        the TP-local model per rank while accumulating. Returns averaged metrics plus
        grad_norm and lr; a non-finite grad norm skips the step (metrics report it).
        """
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict = {}
        for i, mb in enumerate(micro_batches):
            self.module.set_requires_gradient_sync(not self.defer_grad_sync or i == len(micro_batches) - 1)
            loss, metrics = loss_fn(mb, self)
            # sequence parallelism: FSDP2 averages over the dp x sp ranks, and each sp rank's backward holds the
            # gradient of its own tokens only (their sum is the replica's): scale by sp
            (loss * self.mesh.sp_size if self.mesh.sp_size > 1 else loss).backward()
            accumulate(sums, metrics)  # stays on the device: no host sync per micro-batch
        if self._tp_partial:
            self._sum_tp_partial_grads()
        grad_norm, finite = clipped_step(self.optimizer, self.clip_grad_norm)
        return step_metrics(sums, len(micro_batches), grad_norm, finite, self.scheduler)

    def _sum_tp_partial_grads(self) -> None:
        """The per-head norms' gradients summed over the TP group, in one all-reduce of their concatenation."""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self._tp_partial
                 if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self._tp_group)
        for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(summed.view_as(g))

    def clip_grad_norm(self) -> float:
        """Global grad norm over all parameters, then clip. With TP, parameters live on different meshes
        (dp x tp for sharded layers, dp for the replicated ones), so norms are taken per mesh and combined."""
        groups: dict = {}
        for p in self.module.parameters():
            if p.grad is not None:
                groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
        sq = 0.0
        for params in groups.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            sq += float(norm) ** 2
        total = math.sqrt(sq)
        if self.grad_clip > 0 and math.isfinite(total):
            for params in groups.values():
                torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, torch.tensor(total))
        return total

    # ---- weights out (the engine protocol, engines/base.py) ---------------------------------------------
    def hf_config(self):
        return self.hf.config

    def eval(self) -> None:
        self.module.eval()

    def hf_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The HF model's parameters under their HF names. With LoRA: the base model's (a wrapped layer's weight
        under its own name, not PEFT's `.base_layer.` one), without the adapters (adapter_tensors has those)."""
        if self.lora is None:
            return list(self.hf.named_parameters())
        from spmdrl.models.lora import checkpoint_name, is_adapter

        return [(checkpoint_name(n), p) for n, p in self.hf.named_parameters() if not is_adapter(n)]

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, tuple(p.shape)) for name, p in self.hf_parameters()]

    def source_blocks(self) -> dict[str, list[tuple[int, Block]]]:
        return fsdp_blocks(self.param_shapes(), self.mesh.grid())

    def weight_shards(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor, Block]]:
        """This rank's FSDP2 (x TP) shard of every parameter with its block (checked once against DTensor)."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():  # a forward-only pass leaves the root and the last block gathered
            if isinstance(m, FSDPModule):
                m.reshard()
        blocks = self._blocks()
        for name, p in self.hf_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if not self._shards_checked:
                _check_block(name, p, local, blocks[name])
            local = local.detach()
            yield name, (local if dtype is None else local.to(dtype)), blocks[name]
        self._shards_checked = True

    def _blocks(self) -> dict[str, Block]:
        if self._my_blocks is None:
            self._my_blocks = {n: dict(bs)[self.mesh.rank] for n, bs in self.source_blocks().items()}
        return self._my_blocks

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model on CPU on every rank, one all-gather per parameter (tests and small exports only)."""
        return {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in self.hf_parameters()
        }

    def export_hf(self, out_dir: str, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        """Write an HF model directory (sharded safetensors + index, config, tokenizer) from the mesh's first
        rank, streamed bucket by bucket: no rank gathers the whole model (engines/hf_writer.py). With LoRA: a PEFT
        adapter directory (adapter_config.json, adapter_model.safetensors; the adapters are gathered whole)."""
        import copy

        from spmdrl.dist.collectives import comm_device

        from .hf_writer import write_hf_weights

        writer = self.mesh.layout.ranks[0]
        if self.lora is not None:
            from spmdrl.models.lora import write_adapter

            tensors = self.adapter_tensors(dtype)
            if self.mesh.rank == writer:
                write_adapter(out_dir, tensors, self.adapter_config())
                if tokenizer is not None:
                    tokenizer.save_pretrained(out_dir)
            return
        dtype = dtype or next(self.hf.parameters()).dtype
        write_hf_weights(self, out_dir, writer, self.mesh.rank, dtype=dtype, comm_device=comm_device())
        if self.mesh.rank == writer:
            config = copy.deepcopy(self.hf.config)
            config.use_cache = True  # training turns the KV cache off; an exported model wants it
            config.save_pretrained(out_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)
            copy_image_processor(self.model_path, out_dir)

    # ---- LoRA adapters out (collective over the mesh: every rank calls these in the same order) -------------
    def adapter_tensors(self, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
        """Every adapter tensor, whole (gathered over the mesh), on CPU, named as PEFT's save_pretrained names them
        in adapter_model.safetensors, in parameter order; on every rank. Copies: later updates leave them as they are."""
        from spmdrl.models.lora import is_adapter, peft_name

        out = []
        for name, p in self.hf.named_parameters():
            if is_adapter(name):
                full = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                out.append((peft_name(name), full.to("cpu", dtype=dtype or full.dtype, copy=True)))  # never the param
        return out

    def adapter_config(self) -> dict:
        """The adapter_config.json PEFT writes for these adapters (base_model_name_or_path: model.path, a local
        directory as an absolute path, so the adapter loads from any working directory)."""
        from spmdrl.models.lora import adapter_config

        base = os.path.abspath(self.model_path) if os.path.isdir(self.model_path) else self.model_path
        return adapter_config(self.lora, base)

    # ---- checkpoints ----------------------------------------------------------------------------------
    def checkpoint_access(self):
        """Nothing to bring back: DCP reads and loads the shards wherever offload left them (host or device)."""
        return contextlib.nullcontext()

    def checkpoint_state(self) -> tuple[dict, dict]:
        from spmdrl.checkpoint.dcp import module_state

        return module_state(self.module, self.optimizer, self.scheduler, trainable_only=self.lora is not None)

    def load_checkpoint_state(self, tensors: dict, meta: dict) -> None:
        from spmdrl.checkpoint.dcp import load_module_state

        load_module_state(self.module, self.optimizer, self.scheduler, tensors, meta, trainable_only=self.lora is not None)

    def param_manifest(self) -> list:
        """The saved parameters: all of them, or with LoRA the trained ones (adapters, a critic's value head)."""
        return [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in self.module.named_parameters()
                if self.lora is None or p.requires_grad]

    def hf_prefix(self) -> str:
        """Prefix of the HF model's parameter names inside the checkpointed root module."""
        for name, mod in self.module.named_modules():
            if mod is self.hf:
                return name + "."
        return ""

    # ---- memory -----------------------------------------------------------------------------------------
    def offload(self, kinds: tuple[str, ...] = ("params", "grads", "optimizer")) -> None:
        """Move this rank's shards of the named kinds to host memory (CUDA only; a no-op on CPU and for an engine
        built with CPUOffloadPolicy, whose params already live on the host). Gradients are None between
        train_steps (zero_grad(set_to_none=True)), so "grads" moves nothing."""
        if self.device.type != "cuda" or self.host_offload_policy:
            return
        if "optimizer" in kinds and self.optimizer is not None:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
        if "params" in kinds:
            self.module.to("cpu")  # FSDP2 moves the sharded parameters; they are re-registered on the next forward
        torch.cuda.synchronize(self.device)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of this rank's parameter shards, gradient shards and AdamW moments on the device now."""
        params = list(self.module.parameters())
        moments = [v for st in (self.optimizer.state.values() if self.optimizer is not None else ())
                   for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        return resident(state_storages(params, (q.grad for q in params), moments), self.device)

    def onload(self, kinds: tuple[str, ...] = ("params", "grads", "optimizer")) -> None:
        """Bring offloaded kinds back to the device (see offload)."""
        if self.device.type != "cuda" or self.host_offload_policy:
            return
        if "params" in kinds:
            self.module.to(self.device)
        if "optimizer" in kinds and self.optimizer is not None:
            _move_optimizer_state(self.optimizer, self.device)
        torch.cuda.synchronize(self.device)


def _check_sequence_parallel(config, mesh: RoleMesh, model_path: str) -> None:
    """Sequence parallelism runs inside spmdrl's attention function and splits whole heads over the sp ranks."""
    from spmdrl.engines.attention import HF_IMPLEMENTATION
    from spmdrl.dist.layout import sp_head_problem as check_heads

    key = f"placement.{mesh.layout.role}_sp = {mesh.sp_size}"
    if config._attn_implementation != HF_IMPLEMENTATION:
        raise ConfigError(f"{key}: sequence parallelism runs in spmdrl's attention (model.attn_implementation = "
                          f"'auto'), which {model_path!r} does not take; set {mesh.layout.role}_sp = 1")
    heads = config.num_attention_heads
    why = check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, mesh.sp_size)
    if why:
        raise ConfigError(f"{key}: {model_path!r} has {why}; choose an sp that divides its heads")


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """AdamW's exp_avg / exp_avg_sq (DTensors under FSDP2) to `device`; the step counters stay on the host."""
    for state in optimizer.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.device != device:
                state[k] = v.to(device, non_blocking=True)


def _check_block(name: str, p, local: torch.Tensor, planned: Block) -> None:
    """The planner's FSDP2 arithmetic must match what DTensor actually holds on this rank."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    else:
        shape, offset = tuple(p.shape), tuple(0 for _ in p.shape)
    actual = (tuple(offset), tuple(shape))
    if tuple(local.shape) != tuple(shape) or (numel(planned) and actual != planned) or (not numel(planned) and local.numel()):
        raise RuntimeError(f"reshard plan mismatch for {name}: planned block {planned}, DTensor holds {actual}")
