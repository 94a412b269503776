"""Checkpoints of megatron's distributed optimizer (the CUDA path) in HF coordinates, without any gather.

megatron-core's DistributedOptimizer (0.16.1, get_megatron_optimizer with use_distributed_optimizer) keeps, per
dp rank, an fp32 "main" copy of a contiguous range of each model parameter's flattened elements (its shard of
the dp-partitioned grad buffer: `_get_model_param_range_map(p)["param"]` = [start, end) of p.view(-1)), and
the inner torch Adam/AdamW state (exp_avg, exp_avg_sq: 1-D, the shard's size) keyed by that main tensor:
`model_param_group_index_map[p]` = (group, index) into the inner optimizer's param_groups.

A flat range [s, e) of a [R, C] tensor is at most three rectangles: the tail of row s // C, the full rows in
between, the head of row e // C. Each rectangle, cut by the HF pieces of the parameter (convert.hf_pieces:
local rows [a, b) = an HF block whose columns are the local columns), is a rectangular block of one HF
parameter, and the matching elements of the 1-D shard are a contiguous [rows, cols] view. So every dp rank
saves exactly the main params and moments it holds, as ShardedTensor shards of the full HF tensors, with no
communication and no extra memory: the same format (HF names, full shapes) as the CPU path's AdamW moments,
plus the fp32 master weights under "main". DCP loads them in place into the views (resharding on its own
when the layout changes).

Blocks held by several ranks (tp-replicated norms and value head: every tp rank's grad buffer has the same
layout, so identical ranges) are saved by the first holder in [dp][pp][tp] grid order; after a load the tp
group's first rank broadcasts them. Every rank's block list is all-gathered once (cached) to build the global
ShardedTensor metadata, which megatron's range map gives only for the own rank.

The inner optimizer is always torch's Adam/AdamW (`torch_inner_adam`), also where TransformerEngine or apex is
installed and megatron would pick their FusedAdam: one optimizer state layout (per-parameter exp_avg /
exp_avg_sq, step per parameter) for every install, the one these checkpoints are tested with on CPU and on one
GPU. The cost is torch's multi-tensor (foreach) Adam instead of a fused kernel, once per optimizer step.

Not supported (refused at engine build by `check_checkpointable`, before any training): megatron's
precision-aware optimizer, more than one chained optimizer, and PP > 1 with tied embeddings (the last stage's copy
of the embedding has its own dp-sharded main param and moments, with ranges that differ from the first stage's).
A mixture of experts (whose expert buffers and 3-d expert blocks would be a second chained optimizer, not laid out
here) never comes here: on a GPU it trains with the host optimizer, host_optim.py, unless
memory.<role>_host_optimizer = false asks otherwise, which is refused
(config.derived.moe_distributed_optimizer_refusal).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist

from spmdrl.errors import CheckpointError, ConfigError

from .convert import Piece


@contextmanager
def torch_inner_adam():
    """While megatron builds its optimizer: torch's Adam/AdamW as the distributed optimizer's inner optimizer,
    whatever is installed. megatron-core 0.16.1 picks TransformerEngine's or apex's FusedAdam at import time when
    either imports, and reads that choice from one module flag, `USING_PYTORCH_OPTIMIZER`, at one place
    (_get_megatron_optimizer_based_on_param_groups); the flag is set for the call and restored. A megatron that
    no longer has the flag is refused here, and `check_checkpointable` checks the optimizer actually built."""
    from megatron.core import optimizer as mopt

    if not hasattr(mopt, "USING_PYTORCH_OPTIMIZER"):
        raise ConfigError("megatron backend: this megatron-core has no USING_PYTORCH_OPTIMIZER switch; spmdrl "
                          "supports megatron-core 0.16.1 (pip install megatron-core==0.16.1)")
    saved = mopt.USING_PYTORCH_OPTIMIZER
    mopt.USING_PYTORCH_OPTIMIZER = True
    try:
        yield
    finally:
        mopt.USING_PYTORCH_OPTIMIZER = saved


def step_if_finite(optimizer) -> tuple[float, bool]:
    """megatron's ChainedOptimizer.step (megatron-core 0.16.1 optimizer/optimizer.py:1308-1338), skipped when the
    gradient norm is not finite: (grad norm, finite). megatron skips a step only on the found-inf flag of a loss
    scaler, which a bf16 model has none of (MixedPrecisionOptimizer.prepare_grads), so a NaN gradient would step
    every weight to NaN while reporting success; spmdrl's other optimizers skip it and count a bad step
    (engines/base.clipped_step). The norm is all-reduced over the gradient-statistics group inside get_grad_norm,
    so every rank decides alike."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():  # copies the main gradients into place; a loss scaler's found-inf
        return float("nan"), False
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        return grad_norm, False
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm)
    return grad_norm, bool(optimizer.step_with_ready_grads())


def distributed_optimizer(optimizer):
    """The one DistributedOptimizer inside get_megatron_optimizer's ChainedOptimizer."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(opts) != 1:  # a mixture of experts' second one never gets here (config.derived.megatron_host_optimizer)
        raise ConfigError(f"megatron backend: megatron-core built {len(opts)} chained distributed optimizers, and "
                          "spmdrl's checkpoints save one; this megatron-core is not 0.16.1: pip install "
                          "megatron-core==0.16.1")
    return opts[0]


def check_checkpointable(engine) -> None:
    """ConfigError at engine build for a GPU configuration whose optimizer state checkpoint_state cannot save."""
    dopt = distributed_optimizer(engine.optimizer)
    inner = getattr(dopt, "optimizer", None)
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(f"megatron backend: the distributed optimizer's inner optimizer is {type(inner).__name__}, "
                          "expected torch's Adam/AdamW (spmdrl chooses it at build); this megatron-core is not "
                          "0.16.1: pip install megatron-core==0.16.1")
    if getattr(dopt.config, "use_precision_aware_optimizer", False):
        raise ConfigError("megatron backend: checkpoints of the precision-aware distributed optimizer are not "
                          "implemented")
    gpt = engine.stage.gpt
    if engine.mesh.pp_size > 1 and gpt.share_embeddings_and_output_weights:
        raise ConfigError("megatron backend on GPU: checkpoints with pipeline parallelism and tied embeddings "
                          "(tie_word_embeddings) are not implemented (the last stage's copy of the embedding has "
                          "its own optimizer shard); use placement pp = 1 or trainer.backend = 'fsdp'")


def init_state(dopt) -> None:
    """torch Adam's lazily created per-parameter state, created now (zeros, step 0) so that a fresh engine has
    tensors for DCP to load into; the same values torch's first step would start from."""
    from torch.optim.optimizer import _get_scalar_dtype

    inner = dopt.optimizer
    for group in inner.param_groups:
        for main in group["params"]:
            st = inner.state[main]
            if st:
                continue
            on_device = group.get("capturable") or group.get("fused")
            st["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=main.device)
                          if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype()))
            st["exp_avg"] = torch.zeros_like(main, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(main, memory_format=torch.preserve_format)


def shard(dopt, param) -> tuple[int, int, torch.Tensor, dict] | None:
    """(start, end, main, state) of this dp rank's range [start, end) of param.view(-1); None when it holds none."""
    if param not in dopt.model_param_group_index_map:
        return None
    rng = dopt._get_model_param_range_map(param)["param"]
    # a bf16 param's fp32 shard is its .main_param (the tensor in the inner optimizer's group); an fp32 param
    # is stepped in place through a view of its own range, found by its (group, index)
    main = getattr(param, "main_param", None)
    if main is None:
        g, i = dopt.model_param_group_index_map[param]
        main = dopt.optimizer.param_groups[g]["params"][i]
        if main.data_ptr() != param.data.view(-1)[rng.start:].data_ptr():
            raise CheckpointError("megatron distributed optimizer: an fp32 parameter's optimizer tensor is not a view "
                                  "of its range (mixed bf16 / fp32 parameters?)")
    if main.dim() != 1 or main.numel() != rng.end - rng.start or main.dtype != torch.float32:
        raise CheckpointError(f"megatron distributed optimizer: the main param of a {tuple(param.shape)} parameter is "
                              f"{main.dtype} {tuple(main.shape)}, expected float32 ({rng.end - rng.start},)")
    return rng.start, rng.end, main, dopt.optimizer.state[main]


def flat_rects(start: int, end: int, shape: tuple[int, ...]) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """[start, end) of a row-major [R, C] (or [R]) tensor as (offset in the range, rows, cols) rectangles."""
    if len(shape) == 1:
        return [(0, (start, end), (0, 1))] if end > start else []
    C = shape[1]
    out, pos = [], start
    while pos < end:
        r, c = divmod(pos, C)
        if c or end - pos < C:  # a partial row
            stop = min(end, (r + 1) * C)
            out.append((pos - start, (r, r + 1), (c, c + stop - pos)))
        else:  # full rows up to the last full one
            stop = (end // C) * C
            out.append((pos - start, (r, stop // C), (0, C)))
        pos = stop
    return out


def hf_rects(start: int, end: int, shape: tuple[int, ...], pieces: list[Piece]):
    """(Piece of the HF block, offset in the 1-D range, [rows, cols] of that block or [n]) for the elements
    [start, end) of a local tensor of `shape` that lie in one of its HF `pieces`."""
    out = []
    for off, (r0, r1), (c0, c1) in flat_rects(start, end, shape):
        w = c1 - c0
        for pc in pieces:
            a, b = pc.rows
            lo, hi = max(r0, a), min(r1, b)
            if lo >= hi:
                continue
            (offs, size) = pc.block
            if len(shape) == 1:
                block = ((offs[0] + lo - a,), (hi - lo,))
                out.append((Piece(pc.hf_name, block, (lo, hi)), off + lo - r0, (hi - lo,)))
            else:
                assert size[1] == shape[1], (pc.hf_name, size, shape)  # a piece spans the local columns
                block = ((offs[0] + lo - a, offs[1] + c0), (hi - lo, w))
                out.append((Piece(pc.hf_name, block, (lo, hi)), off + (lo - r0) * w, (hi - lo, w)))
    return out


def local_rects(engine) -> list[tuple[torch.nn.Parameter, int, int, list]]:
    """(param, start, end, hf_rects) of every local parameter this dp rank holds a shard of."""
    dopt = distributed_optimizer(engine.optimizer)
    out = []
    for _, p, pieces in engine._local_params():
        sh = shard(dopt, p)
        if sh is not None:
            out.append((p, sh[0], sh[1], hf_rects(sh[0], sh[1], tuple(p.shape), pieces)))
    return out


def rect_owners(engine) -> dict:
    """(HF name, block) -> the global rank that saves it (first holder in grid order), from every rank's list
    (all-gathered once: collective). Checks that the blocks this rank does not save are a tp-replicated
    parameter's whole shard, held identically by its tp group's first rank (broadcast after a load)."""
    if getattr(engine, "_rect_owner_cache", None) is not None:
        return engine._rect_owner_cache
    mine = [(pc.hf_name, pc.block) for _, _, _, rects in local_rects(engine) for pc, _, _ in rects]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    owners: dict = {}
    for d_ranks in engine.mesh.grid():
        for tp_ranks in d_ranks:
            for rank in tp_ranks:
                for key in every[rank]:
                    owners.setdefault(tuple(key), rank)
    me = engine.mesh.rank
    leader = dist.get_global_rank(engine.mesh.group("tp"), 0) if engine.mesh.tp_size > 1 else me
    for p, _, _, rects in local_rects(engine):
        # a tp-sharded parameter's blocks are this rank's alone; a replicated one's are the tp leader's
        want = me if getattr(p, "tensor_model_parallel", False) else leader
        if any(owners[(pc.hf_name, pc.block)] != want for pc, _, _ in rects):
            raise ConfigError("megatron distributed optimizer: the optimizer shard of "
                              f"{rects[0][0].hf_name if rects else 'a parameter'} differs across tp ranks (their grad "
                              "buffers are laid out differently); its checkpoint cannot be laid out")
    engine._rect_owner_cache = owners
    return owners


def views(engine) -> dict[str, dict[str, list]]:
    """{"main" | "exp_avg" | "exp_avg_sq": {HF name: [(Piece, view of the 1-D shard tensor)]}} (Adam's lazy
    state is created first, see init_state)."""
    dopt = distributed_optimizer(engine.optimizer)
    init_state(dopt)
    out: dict[str, dict] = {k: {} for k in ("main", "exp_avg", "exp_avg_sq")}
    for p, _, _, rects in local_rects(engine):
        _, _, main, st = shard(dopt, p)
        for kind, t in (("main", main.data), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
            for pc, off, shp in rects:
                n = 1
                for s in shp:
                    n *= s
                out[kind].setdefault(pc.hf_name, []).append((pc, t[off: off + n].view(shp)))
    return out


def replicated_shards(engine) -> list[torch.Tensor]:
    """The main params and moments of this rank's tp-replicated parameters: broadcast from the tp group's first
    rank after a load (identical ranges, checked by rect_owners)."""
    if engine.mesh.tp_size == 1:
        return []
    dopt = distributed_optimizer(engine.optimizer)
    out = []
    for p, _, _, _ in local_rects(engine):
        if not getattr(p, "tensor_model_parallel", False):
            _, _, main, st = shard(dopt, p)
            out += [main.data, st["exp_avg"], st["exp_avg_sq"]]
    return out


def group_meta(dopt) -> list[dict]:
    """The inner optimizer's param groups without their tensors, JSON-able values only (lr, weight_decay,
    betas, eps, megatron's wd_mult / lr_mult / max_lr ...)."""
    def plain(v):
        return v is None or isinstance(v, (bool, int, float, str)) or (
            isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v))

    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params" and plain(v)}
            for g in dopt.optimizer.param_groups]


def load_meta(dopt, meta: dict) -> None:
    """Restore the step counters and param-group values saved by group_meta."""
    inner = dopt.optimizer
    if len(inner.param_groups) != len(meta["param_groups"]):
        raise CheckpointError(f"megatron distributed optimizer: the checkpoint has {len(meta['param_groups'])} param "
                              f"groups, this optimizer {len(inner.param_groups)}")
    for g, saved in zip(inner.param_groups, meta["param_groups"]):
        g.update({k: tuple(v) if isinstance(g.get(k), tuple) else v for k, v in saved.items() if k in g})
        for main in g["params"]:
            st = inner.state[main]
            st["step"] = torch.tensor(float(meta["step"]), dtype=st["step"].dtype, device=st["step"].device)


def step_of(dopt) -> float:
    steps = {float(st["step"]) for st in dopt.optimizer.state.values() if "step" in st}
    if len(steps) > 1:
        raise CheckpointError(f"megatron distributed optimizer: parameters at different steps {sorted(steps)}")
    return steps.pop() if steps else 0.0
