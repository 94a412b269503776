"""Collectives on packed tensors: batch redistribution between role layouts, and the metric all-reduce."""
from __future__ import annotations

import torch
import torch.distributed as dist

from spmdrl.batch import Batch

from .meshes import RoleMesh


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
    out = {}
    for k in sorted(batch.tensors):
        t = batch.tensors[k]
        if t.dim() == 2:
            width = torch.tensor([t.shape[1]], dtype=torch.long)
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            t = torch.nn.functional.pad(t, (0, int(width) - t.shape[1]))
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        out[k] = torch.cat([parts[r] for r in reps])[lo:hi]
    return Batch(out)


def reduce_mean(values: dict[str, float], weight: float = 1.0, group=None) -> dict[str, float]:
    """Weighted mean of scalar metrics over ranks in one all-reduce (keys must match on every rank)."""
    keys = sorted(values)
    packed = torch.tensor([values[k] * weight for k in keys] + [weight], dtype=torch.float64)
    dist.all_reduce(packed, group=group)
    total = float(packed[-1])
    return {k: float(packed[i]) / total if total else 0.0 for i, k in enumerate(keys)}


def reduce_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    values = values.to(torch.float64).clone()
    dist.all_reduce(values, group=group)
    return values
