"""megatron-core training engine: GPTModel (TP x PP x DP from the role mesh) behind spmdrl's TrainEngine protocol.

Forward and backward run through megatron-core's pipeline schedules (`get_forward_backward_func`): one call per
`train_step` (all micro-batches, 1F1B with PP) and one per forward-only pass (`forward_micro_batches`: all the
pass's micro-batches, so the PP stages pipeline them; `logprobs` / `values` are its one-micro-batch form). With
PP > 1 the last stage's results reach the other stages in one broadcast per call.

Host reads. Every micro-batch is staged before its schedule runs (`_stage`): its data-dependent sizes (where the
valid response tokens are, forward.ResponseIndex) are computed from the caller's host TokenBatch, so the heads
select rows with integer indices instead of a boolean mask of device data; loss metrics stay on the device
(engines/base.accumulate) and are read once per optimizer step. What still reads the device in a step: the
metrics and the grad norm (once each), megatron's optimizer step on CUDA, and with PP > 1 megatron's exchange of
each pipeline transfer's shape (variable_seq_lengths: micro-batches differ in shape) plus one read of the replayed
loss's tensor counts. Counted on CPU for 1 and 4 micro-batches (tests/test_megatron_host_syncs.py).

Loss scaling in train_step. spmdrl's contract (engines/base.py): the caller's micro-batch losses are already
dp * sum_i l_i / N_global; the engine must apply the gradient of their SUM, averaged over dp. Megatron's
schedule divides a (loss, metrics) 2-tuple returned by the loss function by num_microbatches and multiplies it
by the context-parallel size (forward_step_calc_loss; cp = 1 here, asserted), then megatron DDP all-reduces the
grads over dp with a 1/dp scaling (average). The loss function therefore returns loss * num_microbatches: the
schedule's division cancels it (up to one float rounding), and DDP's average is exactly the contract's. No
3-tuple (num_tokens) is returned and calculate_per_token_loss stays off, so finalize_model_grads scales nothing.

Optimizer: on CPU, torch.optim.AdamW over the megatron parameters, fed megatron DDP's float32 main_grad
buffers (megatron's distributed optimizer rejects CPU tensors); on GPU, megatron's distributed optimizer
(get_megatron_optimizer, fp32 master weights, its own clipping). The CPU grad norm counts a tensor-parallel
duplicate (norms, value head) once (tp rank 0) and the last stage's copy of a tied embedding not at all, then
sums squares over the tp and pp groups (grads are equal over dp after the all-reduce) - megatron's rule. With expert
parallelism the experts' squares (params megatron marks allreduce = False) are first summed over the ep group too:
each ep rank holds other experts, while a dense gradient is the same on every ep rank and counts once.

Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral; model.py, routing.py): megatron DDP keeps the experts' gradients
in its expert_parallel_buffers, all-reduced over the expert-data-parallel group with the same 1/dp scaling as the dense
ones (average_in_collective off): an expert's gradient on an ep rank already sums the tokens that the all-to-all
brought from the whole ep group, so the sum over edp covers all dp ranks' tokens once and 1/dp is the contract's
average. Routing replay and the router losses: router_replay / router_losses, moe_counts, moe_losses.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spmdrl.dist.meshes import RoleMesh
from spmdrl.engines.base import accumulate, clipped_step, resident, state_storages, step_metrics
from spmdrl.config.derived import (megatron_host_optimizer, megatron_router_refusal, moe_distributed_optimizer_refusal,
                                    resolve_dtype)
from spmdrl.engines.base import lr_lambda
from spmdrl.engines.token_batch import TokenBatch, relayout
from spmdrl.errors import ConfigError
from spmdrl.dist.blocks import MEGATRON_MODEL_TYPES

from . import forward as fw
from .convert import Piece, dims_from_hf, hf_param_shapes, hf_pieces, stage_layers, vocab_rows
from .model import (StageModel, varlen_params, build_gpt, have_te, init_parallel_state, megatron_mask, pad_sequence_dim,
                    rope_inv_freq)
from . import state as hfstate

log = logging.getLogger("spmdrl")
CHECKPOINTED = ("params", "optimizer")  # the offload kinds a checkpoint holds (gradients never)


class MegatronEngine:
    """One HF Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE / Mixtral model as a megatron-core GPTModel sharded over a
    role mesh (a mixture of experts' experts also over the layout's ep ranks)."""

    lora = None  # megatron-core 0.16.1 has no LoRA; config validation refuses lora.enable with this backend

    def __init__(self, model_path: str, mesh: RoleMesh, device: torch.device, *, trainable: bool, dtype: str = "auto",
                 value_head: bool = False, optim: dict | None = None, total_steps: int = 1,
                 trust_remote_code: bool = False, seed: int = 0, make_vocab_size_divisible_by: int = 128,
                 use_te: bool | None = None, gradient_checkpointing: bool = False, offload: bool = False,
                 defer_grad_sync: bool = False, attention: str = "sdpa", checkpoint_policy: str = "full",
                 router_replay: bool = False, router_losses: bool = False, host_optimizer: bool | None = None):
        """host_optimizer: float32 master weights and AdamW's moments in host memory, the step on the CPU
        (host_optim.py), instead of megatron's distributed optimizer on the device (memory.<role>_host_optimizer;
        None: config.derived.megatron_host_optimizer decides, on for a mixture of experts on a GPU). router_replay: a
        mixture-of-experts model's forwards route each token to the experts its TokenBatch.routes name (routing.py);
        without it they only measure the agreement. router_losses: its forwards under autograd
        keep the load-balancing and z-loss terms (moe_losses)."""
        from transformers import AutoConfig

        self.device, self.mesh, self.trainable, self.model_path, self.seed = device, mesh, trainable, model_path, seed
        self.attention = attention  # local spec core attention: "sdpa" (spmdrl's SdpaAttention) or "local"
        cuda = device.type == "cuda"
        self.dtype = getattr(torch, resolve_dtype(dtype, cuda))
        try:
            self.config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path = {model_path!r}: cannot load the model config ({e})") from None
        if self.config.model_type not in MEGATRON_MODEL_TYPES:  # config validation refuses it first
            raise ConfigError(f"megatron backend: model_type {self.config.model_type!r} is not supported (it converts "
                              f"{', '.join(MEGATRON_MODEL_TYPES)}); use trainer.backend = 'fsdp'")
        if value_head:
            self.config.num_labels = 1
        self.use_te = have_te() if use_te is None else use_te
        if self.use_te and not cuda:
            raise ConfigError("megatron backend: TransformerEngine layers need a GPU; the CPU path uses the local spec")
        init_parallel_state(mesh, device, seed)
        self.dims = dims_from_hf(self.config, tp=mesh.tp_size, divisible_by=make_vocab_size_divisible_by,
                                 value_head=value_head)
        optimizer_why = ""
        if trainable:  # before anything is loaded: a refusal costs nothing
            role = mesh.layout.role
            host_optimizer, optimizer_why = megatron_host_optimizer(host_optimizer, role, on_gpu=cuda,
                                                                    experts=self.dims.experts)
            if cuda and self.dims.experts and not host_optimizer:
                raise ConfigError(moe_distributed_optimizer_refusal(role, self.dims.experts))
        gpt, self.tcfg = build_gpt(self.dims, self.config, mesh, device, self.dtype, self.use_te,
                                   recompute=checkpoint_policy if gradient_checkpointing and trainable else None,
                                   attention=attention,
                                   trainable=trainable)
        self.stage = StageModel(gpt, rope_inv_freq(self.config), value_head, self.dtype).to(device)
        self.first_layer = stage_layers(self.dims.layers, mesh.pp_size, mesh.pp_rank).start
        self.ep = mesh.layout.ep
        self.ep_rank = mesh.layout.ep_coords(mesh.rank)[0]
        self.routing = self._routing(router_replay, router_losses,
                                     gradient_checkpointing and trainable and checkpoint_policy == "full")
        self.is_last = mesh.pp_rank == mesh.pp_size - 1
        self.load_stats = hfstate.load_hf(self, model_path)
        self.defer_grad_sync = defer_grad_sync
        self.optimizer = self.scheduler = None
        self.model = self.stage
        self._ctx = None  # (tb, hidden) while the schedule runs the loss on the last stage
        self._replay = None  # detached last-stage results replayed to loss_fn on the other stages
        if not trainable:
            self.stage.requires_grad_(False)
            return
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        o = optim or {}
        self.grad_clip = o.get("grad_clip", 0.0)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=cuda and not host_optimizer,
                                                average_in_collective=False)
        self.model = DistributedDataParallel(config=self.tcfg, ddp_config=ddp_cfg, module=self.stage)
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        self.tcfg.no_sync_func = self.model.no_sync
        sched = lr_lambda(o.get("warmup_steps", 0), total_steps, o.get("lr_scheduler", "constant"), o.get("min_lr_ratio", 0.0))
        adam = dict(lr=o.get("lr", 1e-6), betas=tuple(o.get("betas", (0.9, 0.999))), eps=o.get("eps", 1e-8),
                    weight_decay=o.get("weight_decay", 0.0))
        params = [p for p in self.stage.parameters() if p.requires_grad]
        if host_optimizer or (not cuda and self.dtype != torch.float32):
            from .host_optim import MasterAdamW

            self.optimizer = MasterAdamW(params, torch.device("cpu"), pin=cuda, **adam)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer.inner, sched)
        elif cuda:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            from .dist_optim import check_checkpointable, torch_inner_adam

            ocfg = OptimizerConfig(optimizer="adam", lr=o.get("lr", 1e-6), weight_decay=o.get("weight_decay", 0.0),
                                   adam_beta1=tuple(o.get("betas", (0.9, 0.999)))[0],
                                   adam_beta2=tuple(o.get("betas", (0.9, 0.999)))[1], adam_eps=o.get("eps", 1e-8),
                                   clip_grad=self.grad_clip, bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
                                   use_distributed_optimizer=True)
            with torch_inner_adam():
                self.optimizer = get_megatron_optimizer(ocfg, [self.model])
            self.scheduler = _MegatronLR(self.optimizer, sched, o.get("lr", 1e-6))
            self.dist_optim = True  # checkpointed through dist_optim.py
            check_checkpointable(self)  # a layout whose checkpoints cannot be saved fails here, not at the first save
        else:
            self.optimizer = torch.optim.AdamW(params, **adam)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, sched)
        self.optimizer_kind = ("host" if host_optimizer else "distributed" if getattr(self, "dist_optim", False) else
                               "host (float32 masters of a low-precision model on CPU)"
                               if hasattr(self.optimizer, "master") else "torch AdamW")
        log.info("megatron %s optimizer: %s (%s)", mesh.layout.role, self.optimizer_kind, optimizer_why)

    # ---- forward ------------------------------------------------------------------------------------
    def eval(self) -> None:
        self.stage.eval()

    compute = ("megatron", "megatron")  # megatron-core's own layers and spmdrl's vocab-parallel head, nothing else

    def compute_options(self) -> list[tuple[str, str]]:
        return [self.compute]

    def set_compute(self, attention: str, head: str) -> None:
        if (attention, head) != self.compute:
            raise ConfigError(f"megatron backend: no compute path {(attention, head)!r}; it runs {self.compute!r}")

    def reference_logprobs(self, tb, *, temperature: float = 1.0):
        """None: the Megatron model is megatron-core's, converted from the HF checkpoint; no transformers forward."""
        return None

    def module_summary(self) -> str:
        return f"megatron-core GPTModel converted from {self.config.model_type}"

    def _routing(self, replay: bool, losses: bool, full_recompute: bool):
        """A mixture of experts' Routing (routing.py), shared by the stage's routers; None for a dense model."""
        if not self.dims.experts:
            return None
        why = megatron_router_refusal(self.mesh.layout.role, self.mesh.pp_size, replay=replay, losses=losses,
                                      full_recompute=full_recompute)
        if why:
            raise ConfigError(f"megatron backend: {why}")
        from megatron.core import parallel_state as ps

        from .routing import Router, Routing

        routing = Routing(self.dims.layers, self.dims.experts, self.dims.top_k, self.dims.norm_topk_prob,
                          replay=replay, aux=losses, tp_group=ps.get_tensor_model_parallel_group())
        for m in self.stage.modules():
            if isinstance(m, Router):
                m.routing_state = routing
        return routing

    def moe_counts(self) -> dict:
        """The routers' counts since the last call (routing.py; {} for a dense model), summed over this replica's tp
        ranks (each routes its share of the sequence) and pp stages (each its layers): one all-reduce. Every rank of
        the mesh calls it after the same forwards."""
        if self.routing is None:
            return {}
        counts = self.routing.take_counts()
        if not counts or self.mesh.tp_size * self.mesh.pp_size == 1:
            return counts
        keys = sorted(counts)
        flat = torch.cat([counts[k].reshape(-1) for k in keys])
        for dim in ("tp", "pp"):
            if getattr(self.mesh, f"{dim}_size") > 1:
                dist.all_reduce(flat, group=self.mesh.group(dim))
        parts = flat.split([counts[k].numel() for k in keys])
        return {k: part.view_as(counts[k]) for k, part in zip(keys, parts)}

    def moe_losses(self):
        """(load-balancing loss, z-loss) of the last forward, summed over the MoE layers (routing.py); None for a
        dense model, without router_losses or outside autograd."""
        return self.routing.moe_losses() if self.routing is not None else None

    def _stage(self, tb: TokenBatch) -> "_Staged":
        """One micro-batch's device inputs, built from the host TokenBatch before the schedule runs: every
        data-dependent size (the response positions, ResponseIndex) is computed here on the host, so nothing in
        the schedule reads the device; the copies are non-blocking."""
        if self.use_te and tb.cu_seqlens is not None:  # TE's layers would need THD attention (not wired up)
            tb = relayout(tb, packed=False)  # the same sequences, padded
        if self.use_te and tb.mask is not None and tb.mask.dim() == 4:
            raise ConfigError("megatron backend with TransformerEngine layers: row-packed micro-batches need THD "
                              "attention, which is not wired up")
        varlen = tb.cu_seqlens is not None and self.attention == "sdpa"  # packed sequences in one row
        # the row-packed reference layout, or packed sequences under megatron's own attention: a dense mask
        rows = (tb.mask is not None and tb.mask.dim() == 4) or (tb.cu_seqlens is not None and not varlen)
        packed = varlen or rows
        ids, mask = tb.input_ids, (tb.attention_mask if rows else None)
        # packed: each sequence's own positions; padded rows are right-padded, so every row's positions are
        # 0 .. L-1: one [1, L] row (one rotary table broadcast over the batch, what TE's fused RoPE takes)
        pos = tb.position_ids if packed else torch.arange(ids.shape[1], device=ids.device)[None]
        cu, longest, width = (tb.cu_seqlens, tb.max_seqlen, ids.shape[1]) if varlen else (None, 0, 0)
        if self.tcfg.sequence_parallel:  # the sequence is split over tp: its length must divide
            ids, pos, mask = pad_sequence_dim(ids, pos, mask, self.mesh.tp_size)
            if varlen and ids.shape[1] > width:  # the tail padding: one more "sequence", never read
                cu = torch.cat([cu, cu.new_tensor([ids.shape[1]])])
                longest = max(longest, ids.shape[1] - width)
        # padded rows: causal attention is exact for every real token (right padding), and lets SDPA use its
        # causal kernels; packed sequences go through the variable-length attention over their boundaries
        dev = self.device
        routes, real = self._route_inputs(tb, ids.shape[1]) if self.routing is not None else (None, None)
        return _Staged(ids.to(dev, non_blocking=True), pos.to(dev, non_blocking=True),
                       megatron_mask(mask).to(dev, non_blocking=True) if rows else None,
                       fw.ResponseIndex.of(tb).to(dev),
                       varlen_params(cu.to(dev, non_blocking=True), longest, cu.diff().tolist()) if varlen else None,
                       None if routes is None else routes.to(dev, non_blocking=True), real.to(dev, non_blocking=True)
                       if real is not None else None)

    def _route_inputs(self, tb: TokenBatch, width: int):
        """This rank's routes [T, layers, top_k] (-1 = none; None without routes) and real-token mask [T] in the
        order megatron's router sees its tokens: the [N, width] token grid (width: the staged, tp-padded sequence
        length) sequence-major, and under sequence parallelism only this tp rank's share of the positions. Real
        tokens: the padded layout's mask; in packed layouts every token up to the sequence-parallel padding."""
        N, L = tb.input_ids.shape
        real = tb.mask.bool() if tb.mask is not None and tb.mask.dim() == 2 else torch.ones(N, L, dtype=torch.bool)
        real = F.pad(real, (0, width - L))
        routes = None
        if tb.routes is not None:
            routes = F.pad(tb.routes.long(), (0, 0, 0, 0, 0, width - L), value=-1)
        span = self.mesh.tp_range(width) if self.tcfg.sequence_parallel else range(width)
        real = real.t()[span.start: span.stop].reshape(-1)
        if routes is not None:
            routes = routes.transpose(0, 1)[span.start: span.stop].reshape(-1, *routes.shape[2:])
        return routes, real

    def _schedule(self, items: list, staged: list["_Staged"], step_fn: Callable, forward_only: bool) -> list:
        """One megatron pipeline schedule over len(items) micro-batches; step_fn pulls (item, staged) pairs."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
        return fb(forward_step_func=step_fn, data_iterator=iter(list(zip(items, staged))), model=[self.model],
                  num_microbatches=len(items), seq_length=max(st.ids.shape[1] for st in staged),
                  micro_batch_size=max(st.ids.shape[0] for st in staged), forward_only=forward_only)

    def _run_stage(self, st: "_Staged"):
        if self.routing is not None:
            self.routing.set_batch(st.routes, st.real)
        return self.model(st.ids, st.pos, st.mask, st.varlen)

    def _lm_head(self, hidden, st: "_Staged", temperature: float, with_entropy, chunk_size: int, top_k: int = -1,
                 top_p: float = 1.0):
        from megatron.core import parallel_state as ps

        gpt = self.stage.gpt
        w = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight
        h = fw.response_hidden(hidden, st.index, sequence_parallel=self.tcfg.sequence_parallel, replicated_use=False)
        labels = st.index.labels
        group = ps.get_tensor_model_parallel_group()
        if top_k > 0 or top_p < 1.0:  # the sampler's truncation needs whole rows: gathered over tp (forward only)
            logp, ent = fw.gathered_truncated_logprobs(h, w, labels, vocab=self.dims.vocab, temperature=temperature,
                                                       top_k=top_k, top_p=top_p, chunk_size=chunk_size,
                                                       with_entropy=with_entropy, group=group)
            return fw.scatter_rows(logp, st.index), (None if ent is None else fw.scatter_rows(ent, st.index))
        lo = vocab_rows(self.dims, self.mesh.tp_size, self.mesh.tp_rank)[0]  # columns >= V are padding, masked
        logp, ent = fw.vocab_parallel_logprobs(h, w, labels, vocab_start=lo, vocab=self.dims.vocab, temperature=temperature,
                                               chunk_size=chunk_size, with_entropy=with_entropy, group=group)
        return fw.scatter_rows(logp, st.index), (fw.scatter_rows(ent, st.index) if ent is not None else None)

    def _value_head(self, hidden, st: "_Staged"):
        h = fw.response_hidden(hidden, st.index, sequence_parallel=self.tcfg.sequence_parallel, replicated_use=True)
        return fw.scatter_rows(self.stage.value_head(h).squeeze(-1).float(), st.index)

    def _broadcast_last(self, ts: list[torch.Tensor] | None, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """The last PP stage's tensors (float32, `shapes`) on every stage of this rank's pp group: one broadcast
        of them all, flattened into one buffer."""
        if self.mesh.pp_size == 1:
            return ts
        group = self.mesh.group("pp")
        sizes = [math.prod(s) for s in shapes]
        if self.is_last:
            buf = torch.cat([t.detach().float().reshape(-1) for t in ts]) if ts else torch.zeros(0, device=self.device)
        else:
            buf = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
        dist.broadcast(buf, src=dist.get_global_rank(group, self.mesh.pp_size - 1), group=group)
        return [part.view(s) for part, s in zip(buf.split(sizes), shapes)]

    def _forward_only(self, tbs: list, head: Callable, k: int) -> list[torch.Tensor]:
        """head(hidden, staged) -> [k, B, R] float32 for every token batch, all in ONE forward-only pipeline
        schedule (num_microbatches = len(tbs), so the stages pipeline them), then one broadcast from the last
        stage. Results stay on the device."""
        staged = [self._stage(tb) for tb in tbs]

        def step(it, model):
            _, st = next(it)
            return self._run_stage(st), lambda out: (out.new_zeros(()), head(out, st))

        with torch.no_grad():
            res = self._schedule(list(tbs), staged, step, forward_only=True)
        return self._broadcast_last(res if self.is_last else None, [(k, *st.index.shape) for st in staged])

    def logprobs(self, tb: TokenBatch, *, temperature: float = 1.0, with_entropy=False, chunk_size: int = 1024,
                 top_k: int = -1, top_p: float = 1.0):
        """See TrainEngine.logprobs; top_k / top_p (forward only) gather the vocabulary over tp per chunk."""
        if self._ctx is not None:  # inside train_step's loss on the last stage: differentiable
            st, hidden = self._ctx
            return self._lm_head(hidden, st, temperature, with_entropy, chunk_size, top_k, top_p)
        if self._replay is not None:  # train_step replaying the loss on a non-last stage: detached values
            lp, ent = self._replay
            return lp, (ent if with_entropy else None)

        def head(out, st):
            lp, ent = self._lm_head(out, st, temperature, with_entropy, chunk_size, top_k, top_p)
            return torch.stack([lp, ent]) if with_entropy else lp[None]

        both = self._forward_only([tb], head, 2 if with_entropy else 1)[0]
        return both[0], (both[1] if with_entropy else None)

    def values(self, tb: TokenBatch) -> torch.Tensor:
        if self._ctx is not None:
            st, hidden = self._ctx
            return self._value_head(hidden, st)
        if self._replay is not None:
            return self._replay[0]
        return self._forward_only([tb], lambda out, st: self._value_head(out, st)[None], 1)[0][0]

    def forward_micro_batches(self, tbs: list, head: str, **head_kw) -> list[torch.Tensor]:
        """See TrainEngine.forward_micro_batches: every micro-batch in one forward-only pipeline schedule."""
        if head == "logprobs" and set(head_kw) <= {"temperature", "chunk_size", "top_k", "top_p"}:
            kw = {"temperature": 1.0, "chunk_size": 1024, "top_k": -1, "top_p": 1.0, **head_kw}

            def fn(out, st):
                return self._lm_head(out, st, kw["temperature"], False, kw["chunk_size"], kw["top_k"], kw["top_p"])[0][None]
        elif head == "values" and not head_kw:
            def fn(out, st):
                return self._value_head(out, st)[None]
        else:
            raise ValueError(f"forward_micro_batches: head {head!r} with {sorted(head_kw)} (logprobs or values)")
        return [r[0] for r in self._forward_only(tbs, fn, 1)] if tbs else []

    # ---- update -------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list, loss_fn: Callable) -> dict[str, float]:
        """One optimizer step over `micro_batches`; loss_fn(micro, engine) -> (loss, metrics). See the module
        docstring for the scaling. On stages other than the last, loss_fn runs after the schedule on the last
        stage's (broadcast, detached) log-probs / values so that its metrics (and any side effects) are the same
        on every rank; those losses are not differentiated. Metrics stay on the device (accumulate) until
        step_metrics reads them, once."""
        from megatron.core import parallel_state as ps

        assert ps.get_context_parallel_world_size() == 1
        M = len(micro_batches)
        self.stage.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        staged = [self._stage(it[1] if isinstance(it, tuple) else it) for it in micro_batches]
        sums: dict = {}
        outs: list = []  # per micro-batch, what loss_fn read from the heads (last stage)

        def step(it, model):
            item, st = next(it)
            hidden = self._run_stage(st)

            def loss_func(out):
                self._ctx = (st, out)
                rec = _Recorder(self)
                try:
                    loss, metrics = loss_fn(item, rec)
                finally:
                    self._ctx = None
                outs.append(rec.seen)
                accumulate(sums, metrics)
                return loss * M, {}

            return hidden, loss_func

        self._schedule(list(micro_batches), staged, step, forward_only=False)
        if self.mesh.pp_size > 1:
            self._replay_on_other_stages(micro_batches, staged, loss_fn, outs, sums)
        if getattr(self, "dist_optim", False):
            from .dist_optim import step_if_finite

            grad_norm, finite = step_if_finite(self.optimizer)
        else:
            if not hasattr(self.optimizer, "master"):  # torch AdamW steps the float32 weights themselves
                for p in self.stage.parameters():
                    p.grad = p.main_grad if p.requires_grad else None
            grad_norm, finite = clipped_step(self.optimizer, self.clip_grad_norm)
        return step_metrics(sums, M, grad_norm, finite, self.scheduler)

    def _replay_on_other_stages(self, micro_batches, staged, loss_fn, outs, sums) -> None:
        """Broadcast what every micro-batch's loss read on the last stage ([k_i, B_i, R_i] stacked) to the other
        stages (the counts k in one broadcast and one host read, the tensors in one broadcast) and run loss_fn
        there on it, for the metrics."""
        group = self.mesh.group("pp")
        k = torch.tensor([len(o) for o in outs] if self.is_last else [0] * len(micro_batches), device=self.device)
        dist.broadcast(k, src=dist.get_global_rank(group, self.mesh.pp_size - 1), group=group)
        shapes = [(n, *st.index.shape) for n, st in zip(k.tolist(), staged)]
        seen = self._broadcast_last([torch.stack(o) if o else torch.zeros(s, device=self.device)
                                     for o, s in zip(outs, shapes)] if self.is_last else None, shapes)
        if self.is_last:
            return
        for item, s in zip(micro_batches, seen):
            self._replay = (s[0] if len(s) else None, s[1] if len(s) > 1 else None)
            try:
                _, metrics = loss_fn(item, self)
            finally:
                self._replay = None
            accumulate(sums, metrics)

    def clip_grad_norm(self) -> float:
        """Global grad norm (megatron's rule, see the module docstring), then clip to grad_clip."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        # megatron DDP's float32 gradients (param.main_grad), which the optimizer steps with
        grads = [(p, p.main_grad) for p in self.stage.parameters() if p.requires_grad]
        sq = torch.zeros(2, dtype=torch.float64, device=self.device)  # [dense, expert] squares
        for p, g in grads:
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                sq[int(not getattr(p, "allreduce", True))] += g.detach().double().pow(2).sum()
        if self.ep > 1:  # an expert's gradient differs over the ep ranks; a dense one is the same (counted once)
            expert = sq[1:].clone()
            dist.all_reduce(expert, group=ps.get_expert_model_parallel_group())
            sq[1:] = expert
        for dim in ("tp", "pp"):
            if getattr(self.mesh, f"{dim}_size") > 1:
                dist.all_reduce(sq, group=self.mesh.group(dim))
        total = math.sqrt(float(sq.sum()))
        if self.grad_clip > 0 and math.isfinite(total) and total > self.grad_clip:
            scale = self.grad_clip / (total + 1e-6)
            for _, g in grads:
                g.mul_(scale)
        return total

    # ---- memory -------------------------------------------------------------------------------------
    def offload(self, kinds: tuple[str, ...] = ("params", "grads", "optimizer")) -> None:
        """Park the named kinds in host memory (CUDA only; a no-op on CPU, like FSDPEngine: the state is in host
        memory already). Storages are freed in place (spmdrl/engines/megatron/offload.py), so every view stays valid:
          params     the model parameters: megatron DDP's contiguous param buffers under the distributed optimizer
                     (bf16 param.data views), the parameters themselves otherwise (frozen engines, the CPU path);
          optimizer  what the optimizer owns: the distributed optimizer's fp32 main-param shards and Adam moments
                     (torch AdamW's moments on CPU); model parameters it updates in place belong to "params";
          grads      megatron DDP's float32 grad buffers (param.main_grad views): freed without a copy, back as
                     zeros (train_step zeroes them before its first backward anyway).
        The same park / unpark code is tested on CPU through _park / _unpark."""
        if self.device.type == "cuda":
            self._park(kinds)

    def onload(self, kinds: tuple[str, ...] = ("params", "grads", "optimizer")) -> None:
        """Bring parked kinds back to the device (see offload); kinds that are not parked are left alone."""
        if self.device.type == "cuda":
            self._unpark(kinds)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes on the device now of the storages offload would park, kind by kind (see offload): parked
        storages are resized to 0 and count nothing."""
        return resident(self._state_storages(), self.device)

    def _state_storages(self) -> dict:
        """What each offload kind parks: the model parameters, the optimizer's own tensors, megatron DDP's grad
        buffers (_ParamAndGradBuffers), each storage once (engines.base.state_storages). A host optimizer's
        tensors live in host memory already (host_optim.py): nothing of it is on the device to park."""
        from .offload import optimizer_tensors

        bufs = self.model.buffers + self.model.expert_parallel_buffers if self.trainable else []
        opt = optimizer_tensors(self.optimizer) if self.optimizer is not None else []
        opt = [t for t in opt if t.device.type == self.device.type]
        return state_storages(self.stage.parameters(), (b.grad_data for b in bufs), opt)

    def _park(self, kinds) -> None:
        from .offload import HostStash

        if getattr(self, "_stash", None) is None:
            self._stash = HostStash(pin=self.device.type == "cuda")
        held = {"params": True, "optimizer": self.optimizer is not None, "grads": self.trainable}
        storages = self._state_storages()
        for kind in ("params", "optimizer", "grads"):
            if kind in kinds and held[kind]:
                self._stash.park(kind, storages[kind], keep_values=kind != "grads")  # grads come back as zeros

    def _unpark(self, kinds) -> None:
        if getattr(self, "_stash", None) is not None:
            for kind in kinds:
                self._stash.unpark(kind)

    # ---- weights in HF coordinates: loading, the weight sync's shards, export, checkpoints (state.py) -------
    def _local_params(self) -> list[tuple[str, torch.nn.Parameter, list[Piece]]]:
        """(megatron name, parameter, HF pieces) of this rank, in parameter order."""
        if getattr(self, "_pieces_cache", None) is None:
            out = []
            gpt = self.stage.gpt
            copy = gpt.post_process and not gpt.pre_process and gpt.share_embeddings_and_output_weights
            for name, p in self.stage.named_parameters():
                mname = name.removeprefix("gpt.")
                pcs = hf_pieces(mname, self.dims, self.mesh.tp_size, self.mesh.tp_rank, self.first_layer, ep=self.ep,
                                ep_rank=self.ep_rank, last_stage_copy=copy and mname == "output_layer.weight")
                out.append((mname, p, pcs))
            self._pieces_cache = out
        return self._pieces_cache

    def hf_config(self):
        return self.config

    def hf_prefix(self) -> str:
        return ""

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return hf_param_shapes(self.dims)

    def source_blocks(self) -> dict:
        return hfstate.source_blocks(self)

    def weight_shards(self, dtype: torch.dtype | None = None):
        return hfstate.weight_shards(self, dtype)

    def export_hf(self, out_dir: str, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        hfstate.export_hf(self, out_dir, tokenizer, dtype)

    def param_manifest(self) -> list:
        return hfstate.param_manifest(self)

    @contextmanager
    def checkpoint_access(self):
        """Unpark what a checkpoint holds (params, optimizer state; gradients are never saved and stay where
        they are) and park it again on exit: one engine's state at a time on the device during a save or a load."""
        stash = getattr(self, "_stash", None)
        parked = [k for k in CHECKPOINTED if stash is not None and stash.parked(k)]
        self._unpark(parked)
        try:
            yield
        finally:
            self._park(parked)

    def checkpoint_state(self) -> tuple[dict, dict]:
        self._unpark(CHECKPOINTED)  # outside checkpoint_access (tests, export): stays unparked
        return hfstate.checkpoint_state(self)

    def load_checkpoint_state(self, tensors: dict, meta: dict) -> None:
        self._unpark(CHECKPOINTED)
        hfstate.load_checkpoint_state(self, tensors, meta)


@dataclass
class _Staged:
    """One micro-batch on the device, as the stage model takes it (engine._stage)."""

    ids: torch.Tensor  # [N, L] (L padded to a multiple of tp under sequence parallelism)
    pos: torch.Tensor  # [N, L] packed, [1, L] padded (positions shared by every row)
    mask: torch.Tensor | None  # megatron's [N, 1, L, L] bool (True = not allowed) for row-packed rows; None = causal
    index: fw.ResponseIndex
    varlen: object = None  # PackedSeqParams with the boundaries of packed sequences in one row (varlen_params)
    routes: torch.Tensor | None = None  # a MoE's routes of this rank's tokens in router order (engine._route_inputs)
    real: torch.Tensor | None = None  # a MoE's real-token mask of this rank's tokens, router order


class _Recorder:
    """The engine as loss_fn sees it inside the schedule: records the (detached) head outputs loss_fn read,
    so they can be replayed on the other PP stages."""

    def __init__(self, engine: MegatronEngine):
        self._engine, self.seen = engine, []

    def logprobs(self, tb, *, temperature: float = 1.0, with_entropy=False, chunk_size: int = 1024, top_k: int = -1,
                 top_p: float = 1.0):
        lp, ent = self._engine.logprobs(tb, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size,
                                        top_k=top_k, top_p=top_p)
        self.seen += [lp.detach().float()] + ([ent.detach().float()] if ent is not None else [])
        return lp, ent

    def values(self, tb):
        v = self._engine.values(tb)
        self.seen.append(v.detach().float())
        return v

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _MegatronLR:
    """LambdaLR semantics for megatron's optimizer (it owns its param groups)."""

    def __init__(self, optimizer, fn: Callable[[int], float], base_lr: float):
        self.optimizer, self.fn, self.base_lr, self.last_epoch = optimizer, fn, base_lr, 0
        self._set()

    def _set(self):
        for g in self.optimizer.param_groups:
            g["lr"] = self.base_lr * self.fn(self.last_epoch)

    def get_last_lr(self) -> list[float]:
        return [self.base_lr * self.fn(self.last_epoch)]

    def step(self):
        self.last_epoch += 1
        self._set()

    def state_dict(self):
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, sd):
        self.last_epoch = sd["last_epoch"]
        self._set()
