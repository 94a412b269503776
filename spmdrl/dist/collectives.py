"""Collectives on packed tensors: batch redistribution between role layouts, and the metric all-reduce."""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from spmdrl.batch import Batch

from .meshes import RoleMesh


def comm_device(group=None) -> torch.device:
    """Where a collective's tensors must live: the current CUDA device under NCCL, else the CPU (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slice_of(src: RoleMesh, dst: RoleMesh, rank: int, n_local: int) -> tuple[int, int, int, int]:
    """(needed lo, hi, held lo, hi) in global sample positions for `rank`."""
    g = n_local * src.dp_size
    d = dst.layout.coords(rank)[0]
    s = src.layout.coords(rank)[0]
    return d * g // dst.dp_size, (d + 1) * g // dst.dp_size, s * n_local, (s + 1) * n_local


def redistribute(batch: Batch, src: RoleMesh, dst: RoleMesh) -> Batch:
    """Move a batch laid out by `src`'s data-parallel ranks to `dst`'s (tensors only; meta is dropped).

    Global sample order is src dp-rank major. When every rank already holds the slice it needs (the
    colocated default: rollout tp >= actor tp), this is a local slice with no communication. Otherwise one
    all-gather per tensor of padded, packed rows.
    """
    n = len(batch)
    local = all(
        hlo <= lo and hi <= hhi
        for r in src.layout.ranks
        for lo, hi, hlo, hhi in [_slice_of(src, dst, r, n)]
    )
    lo, hi, hlo, _ = _slice_of(src, dst, src.rank, n)
    if local:
        return Batch({k: v[lo - hlo: hi - hlo] for k, v in batch.tensors.items()})
    world = dist.get_world_size()
    # one representative per src dp rank: its tp rank 0
    reps = [grp[0][0] for grp in src.layout.mesh_ranks()]
    dev = comm_device()
    out = {}
    for k in sorted(batch.tensors):
        t = batch.tensors[k].to(dev)
        if t.dim() == 2:
            width = torch.tensor([t.shape[1]], dtype=torch.long, device=dev)
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            t = torch.nn.functional.pad(t, (0, int(width) - t.shape[1]))
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        out[k] = torch.cat([parts[r] for r in reps])[lo:hi].cpu()
    return Batch(out)


def take_global_rows(batch: Batch, lo: int, hi: int, group=None) -> Batch:
    """Rows [lo, hi) of the concatenation, in `group` rank order, of every rank's `batch` (tensors only;
    meta is dropped). Ranks may hold different row counts. One all-gather of the counts, then one
    all-gather (plus a width all-reduce for 2-D tensors) per tensor of rows padded to the largest count."""
    dev = comm_device(group)
    size = dist.get_world_size(group)
    count = torch.tensor([len(batch)], dtype=torch.long, device=dev)
    counts = [torch.zeros_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    rows = max(counts)
    out = {}
    for k in sorted(batch.tensors):
        t = batch.tensors[k].to(dev)
        if t.dim() == 2:
            width = torch.tensor([t.shape[1]], dtype=torch.long, device=dev)
            dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
            t = torch.nn.functional.pad(t, (0, int(width) - t.shape[1]))
        t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        out[k] = torch.cat([p[:c] for p, c in zip(parts, counts)])[lo:hi].cpu()
    return Batch(out)


def reduce_mean(values: dict[str, float], weight: float = 1.0, group=None) -> dict[str, float]:
    """Weighted mean of scalar metrics over ranks: one all-reduce of a packed vector when every rank has the
    same keys (the common case, checked with a 2-int all-reduce); ranks may also report different keys
    (e.g. a hook logging on some ranks only), then each key is averaged over the ranks that have it."""
    keys = sorted(values)
    digest = zlib.crc32("\x00".join(keys).encode())
    dev = comm_device(group)
    check = torch.tensor([digest, -digest], dtype=torch.int64, device=dev)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    check = check.cpu()
    if not (check[0] == digest and check[1] == -digest):
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, keys, group=group)  # key names only, rare path
        keys = sorted(set().union(*gathered))
    packed = torch.tensor(
        [values.get(k, 0.0) * weight for k in keys] + [weight if k in values else 0.0 for k in keys],
        dtype=torch.float64, device=dev,
    )
    dist.all_reduce(packed, group=group)
    packed = packed.cpu()
    n = len(keys)
    return {k: float(packed[i]) / float(packed[n + i]) if float(packed[n + i]) else 0.0 for i, k in enumerate(keys)}


def reduce_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ranks (float64), returned on the CPU."""
    values = values.to(comm_device(group), torch.float64).clone()
    dist.all_reduce(values, group=group)
    return values.cpu()


def reduce_min(value: int, group=None) -> int:
    t = torch.tensor([value], dtype=torch.long, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t[0])
