"""What vLLM's own weight loaders read of each HF parameter, per tensor-parallel rank, learnt by running them.

The weight sync sends each rollout rank only the part of an HF tensor that its vLLM shard needs. Instead of a
hand table of slicing rules per architecture, spmdrl asks vLLM: for a TP degree and a TP rank it builds the
rollout model class on the meta device (no memory, no process group: the parallel state is a stand-in that
answers the TP size and rank), hands each HF parameter to the model's `load_weights` as a meta tensor, and watches
every operation the loaders apply to it (a torch dispatch mode). Loaders narrow, chunk, unbind and transpose the
tensor, then copy the result into their parameter; each copy's source is a strided view of the probe, whose
storage offset and strides name the rectangle of the HF tensor it reads. The union of those rectangles is what
the rank needs: the planned route sends exactly that.

A parameter whose loader does anything else with the data (arithmetic, a copy into a new tensor, a
concatenation, reading values), or whose probe fails, takes the whole-tensor route: every rank of the TP group is
sent the whole tensor and vLLM's loader cuts it, as a checkpoint load would. So an architecture vLLM loads is
never refused for want of slicing rules; it moves more bytes where the loaders are opaque, and the plan says
which parameters and how many bytes.

Whether the learnt reads are right is not taken on trust: `tests/test_model_families.py` syncs tiny random models
of each family into a real vLLM engine at TP = 2 through the planned route, compares the engine's weights byte for
byte with a whole-tensor load of the same values, and checks that the bytes received equal the lower bound.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
import tempfile
import types
from dataclasses import dataclass, field

import torch

from spmdrl.dist.blocks import Block, full_block, intersect, numel

logger = logging.getLogger(__name__)

LAYER_INDEX = re.compile(r"\.(\d+)\.")


def family(name: str) -> str:
    """A parameter family: the HF name with layer and expert indices replaced by '*'."""
    return LAYER_INDEX.sub(".*.", LAYER_INDEX.sub(".*.", name))


@dataclass
class VllmReads:
    """Per HF parameter, the blocks each vLLM TP rank's loaders read (reads[name][tp_rank], disjoint blocks;
    an empty list: the loaders ignore the parameter), or the whole-tensor route (name in `whole`, with why)."""

    tp: int
    reads: dict[str, list[list[Block]]] = field(default_factory=dict)
    whole: dict[str, str] = field(default_factory=dict)

    def blocks(self, name: str, shape: tuple[int, ...], tp_rank: int) -> list[Block]:
        if name in self.whole or name not in self.reads:
            return [full_block(shape)]
        return self.reads[name][tp_rank]

    def route(self, name: str) -> str:
        return "whole" if name in self.whole or name not in self.reads else "planned"


# ------------------------------------------------------------------------------------------ blocks from views


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, s = [], 1
    for n in reversed(shape):
        strides.append(s)
        s *= n
    return strides[::-1]


def view_block(full_shape: tuple[int, ...], offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> Block | None:
    """The rectangle of a contiguous tensor of `full_shape` that a strided view (storage offset, shape, strides)
    covers, or None if the view is not a rectangle of it (merged or overlapping dimensions)."""
    full_strides = _contiguous_strides(full_shape)
    if 0 in shape:  # an empty view (a vocabulary shard wholly in the padding): reads nothing
        return tuple(0 for _ in full_shape), tuple(0 for _ in full_shape)
    offs = [(offset // s) % n if n else 0 for s, n in zip(full_strides, full_shape)]
    if sum(o * s for o, s in zip(offs, full_strides)) != offset:
        return None
    size, used = [1] * len(full_shape), set()
    for n, s in zip(shape, stride):
        if n == 1:
            continue
        dims = [d for d, fs in enumerate(full_strides) if fs == s and full_shape[d] > 1 and d not in used]
        if not dims:
            return None
        used.add(dims[0])
        size[dims[0]] = n
    if any(o + n > f for o, n, f in zip(offs, size, full_shape)):
        return None
    return tuple(offs), tuple(size)


def coalesce(blocks: list[Block]) -> list[Block]:
    """Distinct blocks merged where two differ only in one dimension and touch along it (per-expert reads of a
    fused expert tensor become one block per gate/up half); overlapping blocks become their bounding box.
    One sort-and-sweep per dimension, repeated until nothing merges (a 128-expert tensor: 256 reads, a few passes)."""
    out = sorted(set(b for b in blocks if numel(b)))
    changed = bool(out)
    while changed:
        changed = False
        for d in range(len(out[0][0]) if out else 0):
            rest = lambda b: (b[0][:d] + b[0][d + 1:], b[1][:d] + b[1][d + 1:])  # noqa: E731
            merged: list[Block] = []
            for b in sorted(out, key=lambda b: (rest(b), b[0][d])):
                last = merged[-1] if merged else None
                if last is not None and rest(last) == rest(b) and last[0][d] + last[1][d] == b[0][d]:
                    size = list(last[1])
                    size[d] += b[1][d]
                    merged[-1] = (last[0], tuple(size))
                    changed = True
                else:
                    merged.append(b)
            out = merged
    if any(intersect(a, b) for k, a in enumerate(out) for b in out[k + 1:]):
        lo = tuple(min(b[0][d] for b in out) for d in range(len(out[0][0])))
        hi = tuple(max(b[0][d] + b[1][d] for b in out) for d in range(len(out[0][0])))
        return [(lo, tuple(h - l for l, h in zip(lo, hi)))]
    return sorted(out)


# ------------------------------------------------------------------------------------------------ the probe


class _Watch(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the views of one probe tensor that are copied somewhere, and any other use of its data."""

    def __init__(self, probe: torch.Tensor):
        super().__init__()
        self.storage = _storage(probe)
        self.reads: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self.opaque: set[str] = set()

    def _mine(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "meta" and _storage(t) == self.storage

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.copy_.default,) and self._mine(args[1]):
            src = args[1]
            self.reads.append((src.storage_offset(), tuple(src.shape), tuple(src.stride())))
            return args[0]  # the destination is a meta parameter: nothing to write
        out = func(*args, **kwargs)
        ins = [a for a in list(args) + list(kwargs.values()) if self._mine(a)]
        ins += [x for a in args if isinstance(a, (list, tuple)) for x in a if self._mine(x)]
        if ins:
            outs = out if isinstance(out, (list, tuple)) else [out]
            if not all(self._mine(o) for o in outs if isinstance(o, torch.Tensor)) or not any(
                    isinstance(o, torch.Tensor) for o in outs):
                if func not in _METADATA_OPS:
                    self.opaque.add(str(func))
        return out


_METADATA_OPS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
                 torch.ops.aten.sym_storage_offset.default, torch.ops.aten.is_same_size.default}


def _storage(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


class _Group:
    """Stands in for a vLLM GroupCoordinator while the model class is built: its size and this rank's place."""

    def __init__(self, size: int, rank: int):
        self.world_size, self.rank_in_group, self.rank, self.local_rank = size, rank, rank, rank
        self.ranks = list(range(size))
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self.unique_name = "spmdrl-probe"
        self.device_group = self.cpu_group = types.SimpleNamespace(size=lambda: size, rank=lambda: rank)


_GROUPS = ("_WORLD", "_TP", "_PP", "_DP", "_EP", "_EPLB", "_DCP", "_PCP", "_ETP", "_INNER_DP_WORLD")


@contextlib.contextmanager
def _stand_in_groups(tp: int, tp_rank: int, expert_parallel: bool):
    from vllm.distributed import parallel_state as ps

    saved = {g: getattr(ps, g) for g in _GROUPS if hasattr(ps, g)}
    try:
        for g in saved:
            sized = g == "_TP" or (g == "_EP" and expert_parallel)
            setattr(ps, g, _Group(tp, tp_rank) if sized else _Group(1, 0))
        yield
    finally:
        for g, v in saved.items():
            setattr(ps, g, v)


@contextlib.contextmanager
def _expert_maps_on_cpu():
    """vLLM's expert-parallel maps (ExpertMapManager: which global experts a rank holds, computed from values at
    construction and read by the experts' weight loaders with .item()) are built on the CPU while the rest of the
    probed model is on the meta device."""
    try:
        from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
    except ImportError:  # another vLLM: the probe reports what fails, and those tensors go whole
        yield
        return
    init = ExpertMapManager.__init__

    def on_cpu(self, *args, **kwargs):
        with torch.device("cpu"):
            init(self, *args, **kwargs)

    ExpertMapManager.__init__ = on_cpu
    try:
        yield
    finally:
        ExpertMapManager.__init__ = init


def _engine_config(hf_config, tp: int, dtype: str, expert_parallel: bool, trust_remote_code: bool):
    """A VllmConfig for the model of `hf_config` at TP = tp, as the rollout engine would build it (config.json only,
    no weights, no tokenizer)."""
    from vllm.engine.arg_utils import EngineArgs

    with tempfile.TemporaryDirectory(prefix="spmdrl-probe-") as d:
        config = hf_config.to_dict()
        if not config.get("architectures"):  # a bare config: vLLM would pick the backbone (a pooling model)
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"), "")]
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        args = EngineArgs(model=d, tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
                          enforce_eager=True, dtype=dtype, skip_tokenizer_init=True, load_format="dummy",
                          enable_expert_parallel=expert_parallel, trust_remote_code=trust_remote_code,
                          max_model_len=min(4096, getattr(hf_config, "max_position_embeddings", 4096) or 4096))
        env = dict(os.environ)
        try:
            return args.create_engine_config()
        finally:  # building a config may set launcher variables: the job's own stay as they were
            os.environ.clear()
            os.environ.update(env)


def probe_rank(hf_config, params: list[tuple[str, tuple[int, ...]]], tp: int, tp_rank: int, *, dtype: str,
               expert_parallel: bool = False, trust_remote_code: bool = False) -> tuple[dict, dict]:
    """({name: blocks read}, {name: why whole}) for TP rank tp_rank of tp."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    from spmdrl.models.checkpoint import checkpoint_views
    from spmdrl.rollout.vllm_classes import transformers_classes_kept

    cfg = _engine_config(hf_config, tp, dtype, expert_parallel, trust_remote_code)
    as_stored = checkpoint_views(hf_config)  # what the sync hands to vLLM (VLLMEngine.update_weights)
    reads, whole = {}, {}
    with _stand_in_groups(tp, tp_rank, expert_parallel), set_current_vllm_config(cfg), _expert_maps_on_cpu(), \
            transformers_classes_kept(hf_config):  # the probe's model only loads weights: no instance to adopt
        with torch.device("meta"):
            model = initialize_model(cfg)
        seen: dict[tuple, str] = {}  # (family, shape) -> the parameter probed for it: layers load alike
        for name, shape in params:
            first = seen.setdefault((family(name), shape), name)
            if first != name:
                if first in reads:
                    reads[name] = reads[first]
                else:
                    whole[name] = whole[first]
                continue
            probe = torch.empty(shape, device="meta", dtype=cfg.model_config.dtype)
            watch = _Watch(probe)
            try:
                with watch:
                    model.load_weights(as_stored(name, probe))
            except Exception as e:  # the loader needs real values or companions: vLLM cuts the whole tensor
                whole[name] = f"its loader failed on a probe ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                continue
            if watch.opaque:
                whole[name] = f"its loader computes with the values ({', '.join(sorted(watch.opaque))[:120]})"
                continue
            blocks = [view_block(shape, *r) for r in watch.reads]
            if any(b is None for b in blocks):
                whole[name] = "its loader reads a view that is not a rectangle of the tensor"
                continue
            reads[name] = coalesce(blocks)
    return reads, whole


@contextlib.contextmanager
def _quiet_vllm():
    """vLLM's config messages (on stdout, at INFO) are about an engine that is never built: keep them out of the
    job's log and of `spmdrl plan --json`, unless vLLM's logger is at DEBUG (logging.verbosity = debug)."""
    before = logging.root.manager.disable
    if logging.getLogger("vllm").getEffectiveLevel() > logging.DEBUG:
        logging.disable(logging.WARNING)  # vLLM configures its own logger on first use, so its level cannot hold
    try:
        yield
    finally:
        logging.disable(before)


_PROBED: dict[tuple, VllmReads] = {}  # per process: the trainer and `spmdrl plan` ask once per layout


def _probe(hf_config, params: tuple, tp: int, dtype: str, expert_parallel: bool, trust_remote_code: bool) -> VllmReads:
    out = VllmReads(tp)
    per_rank = []
    try:
        with _quiet_vllm():
            for r in range(tp):
                per_rank.append(probe_rank(hf_config, list(params), tp, r, dtype=dtype,
                                           expert_parallel=expert_parallel, trust_remote_code=trust_remote_code))
    except Exception as e:  # the model class itself did not build here: every parameter goes whole
        detail = " ".join(str(e).split())[:300]
        why = f"vLLM's model class did not build for the probe ({type(e).__name__}: {detail})"
        logger.warning("weight sync: %s; every parameter takes the whole-tensor route", why)
        out.whole = {name: why for name, _ in params}
        return out
    for name, shape in params:
        whys = [w[name] for _, w in per_rank if name in w]
        if whys:
            out.whole[name] = whys[0]
        else:
            out.reads[name] = [reads[name] for reads, _ in per_rank]
    return out


def probe_vllm_reads(hf_config, params: list[tuple[str, tuple[int, ...]]], tp: int, *, dtype: str = "float32",
                     expert_parallel: bool = False, trust_remote_code: bool = False) -> VllmReads:
    """What each vLLM TP rank's loaders read of every parameter of `params` (HF names and full shapes) for the
    model of `hf_config` (cached per process: the trainer and `spmdrl plan` ask once per layout)."""
    key = (hf_config.to_json_string(use_diff=False), tuple(params), tp, dtype, expert_parallel, trust_remote_code)
    if key not in _PROBED:  # the config object itself goes to vLLM (its JSON need not load back: inf values)
        if len(_PROBED) >= 8:
            _PROBED.pop(next(iter(_PROBED)))
        _PROBED[key] = _probe(copy.deepcopy(hf_config), *key[1:])
    return _PROBED[key]


def vllm_targets(params: list[tuple[str, tuple[int, ...]]], groups: list[list[int]], reads: VllmReads) -> dict:
    """Target blocks of the rollout TP groups (global ranks, in vLLM TP-rank order): per parameter, (rank, block)
    for every block its loaders read there (several for a fused expert tensor, none where vLLM ignores it)."""
    return {name: [(rank, b) for g in groups for r, rank in enumerate(g) for b in reads.blocks(name, shape, r)]
            for name, shape in params}


def rollout_targets(params, tp_groups: list[list[int]], hf_config, loads_tp_shards: bool, *,
                    dtype: str = "float32", expert_parallel: bool = False):
    """(targets, reads): what each rollout rank needs, and for vLLM how it was learnt: the blocks its weight
    loaders read at each TP rank (reshard/vllm_reads.py; a parameter whose loader is opaque goes whole). Engines
    that hold full weights get every tensor whole (reads None). tp_groups: the rollout role's TP groups (global
    ranks, vLLM TP order)."""
    if loads_tp_shards:
        reads = probe_vllm_reads(hf_config, params, len(tp_groups[0]), dtype=dtype, expert_parallel=expert_parallel)
        return vllm_targets(params, tp_groups, reads), reads
    ranks = [r for g in tp_groups for r in g]
    return {name: [(r, full_block(shape)) for r in ranks] for name, shape in params}, None


def route_summary(params: list[tuple[str, tuple[int, ...]]], reads: VllmReads, elem_bytes: int) -> list[dict]:
    """Per parameter family: the route, how many tensors, and the bytes one rollout rank needs by the route
    (the planned route: the largest per-rank share; the whole-tensor route: every tensor whole)."""
    fams: dict[str, dict] = {}
    for name, shape in params:
        f = fams.setdefault(family(name), {"family": family(name), "route": reads.route(name), "tensors": 0,
                                           "bytes_per_rank": 0, "full_bytes": 0, "why": reads.whole.get(name, "")})
        f["tensors"] += 1
        f["full_bytes"] += math.prod(shape) * elem_bytes
        per_rank = [sum(numel(b) for b in reads.blocks(name, shape, r)) for r in range(reads.tp)]
        f["bytes_per_rank"] += max(per_rank, default=0) * elem_bytes
        if reads.route(name) == "whole":
            f["route"] = "whole"
    return list(fams.values())
