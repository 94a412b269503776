"""rollout.verify_sync: after a weight sync, every rollout rank checks what its engine computes with against the
actor's values, by a route that shares nothing with the plan's slicing rules or its transfers.

1. The rollout rank snapshots what its engine holds after the sync (`weight_snapshot`: for vLLM, every parameter
   and buffer of its model shard, and the effective weight of a linear layer whose weight the CPU backend
   repacked out of its parameter).
2. Every parameter comes to it whole: each distinct block the actor engine's ranks hold is sent by the lowest
   rank holding it, point to point. The rollout rank loads these whole tensors through the engine's own loaders,
   as a checkpoint load would: vLLM's weight loaders cut its TP slice, pack q/k/v and gate/up, pad the vocabulary.
3. It snapshots again and compares the two byte for byte.

Under this flag the sync fills the part of each full-shaped buffer outside the rank's shard with NaN, so a loader
that reads outside what the plan sent shows as NaN. A wrong slicing rule, a misplaced slice or a wrong value
fails the check, naming the parameter (vLLM's name), the rank and the largest absolute difference. The engine
holds the actor's weights afterwards either way (step 2 loaded them).

Cost (a debug flag): two host copies of the rank's rollout weights, every parameter whole on every rollout rank
one bucket at a time, and a second load. In split placement the training ranks keep the blocks they post until
the next sync, as they keep the sync's own sends.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from spmdrl.dist.blocks import Block, numel
from .plan import SyncPlan
from .transport import Shards

logger = logging.getLogger(__name__)


class SyncMismatch(RuntimeError):
    """The rollout engine's weights after a sync differ from the actor's (rollout.verify_sync)."""


def gather_whole(plan: SyncPlan, names: list[str], shards: Shards, *, dtype: torch.dtype, device: torch.device,
                 group=None) -> list[tuple[str, torch.Tensor]]:
    """Parameters `names` whole, in `dtype`, on every rollout rank (the ranks the plan has targets on; other ranks
    get []). Each distinct block of the actor's sources (what the actor engine's ranks hold, checked against the
    engine at the first sync) goes from the lowest rank holding it to every rollout rank, point to point, cast
    where it is held as the sync casts. Every rank waits for its sends and receives before returning, as the
    sync itself does."""
    rank = dist.get_rank()
    ops, recvs, out = [], [], []
    for name in names:
        dsts = sorted(plan.target_of[name])
        full = covered = None
        if rank in dsts:
            full = torch.empty(plan.shapes[name], dtype=dtype, device=device)
            covered = torch.zeros(plan.shapes[name], dtype=torch.bool, device=device)
            out.append((name, full, covered))
        holders: dict[Block, int] = {}
        for r, block in plan.sources[name]:
            if numel(block):
                holders[block] = min(r, holders.get(block, r))
        for block, src in holders.items():
            where = tuple(slice(o, o + n) for o, n in zip(*block))
            if src == rank:
                mine = shards[name][block].to(device, dtype).contiguous()
                ops += [dist.P2POp(dist.isend, mine, dst, group=group) for dst in dsts if dst != rank]
                if full is not None:
                    full[where], covered[where] = mine, True
            elif full is not None:
                buf = torch.empty(block[1], dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buf, src, group=group))
                recvs.append((full, covered, where, buf))
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    for full, covered, where, buf in recvs:
        full[where], covered[where] = buf, True
    for name, _, covered in out:
        if not bool(covered.all()):
            raise SyncMismatch(f"rollout.verify_sync: the actor's ranks hold {int(covered.sum())} of the "
                               f"{covered.numel()} elements of {name}")
    return [(name, full) for name, full, _ in out]


def differences(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """One line per tensor that is not bitwise the same in both snapshots (NaN equal to NaN)."""
    out = []
    for name in sorted(before.keys() | after.keys()):
        a, b = before.get(name), after.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{name}: {'missing' if a is None or b is None else f'{tuple(a.shape)} vs {tuple(b.shape)}'}")
            continue
        floating = a.is_floating_point()
        same = (a == b) | (a.isnan() & b.isnan()) if floating else a == b
        if not bool(same.all()):
            diff = float((a.double() - b.double()).abs().max())
            unfilled = floating and bool(a.isnan().any()) and not bool(b.isnan().any())
            out.append(f"{name}: {int((~same).sum())} of {a.numel()} elements differ, max abs diff {diff:g}"
                       + (" (the engine read buffer memory the sync did not fill)" if unfilled else ""))
    return out


def verify_sync(plan: SyncPlan, shards: Shards, rollout, *, dtype: torch.dtype, device: torch.device,
                bucket_bytes: int, group=None, agree: bool = True) -> None:
    """Run the check after a sync, on every rank of the sync (the actor's ranks send, the rollout ranks check).
    agree (colocated): the ranks then agree, and every rank raises SyncMismatch naming the first rollout rank that
    differs. Split placement (agree False: no collective beyond the transfers at this point of the schedule): a
    rollout rank that differs raises by itself (its launcher then stops the job)."""
    t0 = time.perf_counter()
    before = rollout.weight_snapshot() if rollout is not None else {}
    esize = torch.empty((), dtype=dtype).element_size()
    for names in plan.buckets(bucket_bytes, full_elem_bytes=esize):
        bucket = gather_whole(plan, names, shards, dtype=dtype, device=device, group=group)
        if rollout is not None and bucket:
            rollout.update_weights(bucket)
        del bucket
    found = []
    if rollout is not None:
        rollout.finish_weight_update()
        found = differences(before, rollout.weight_snapshot())
    del before
    if agree:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (dist.get_rank(), found), group=group)
    else:
        everyone = [(dist.get_rank(), found)]
    bad = [(rank, lines) for rank, lines in sorted(everyone) if lines]
    if bad:
        rank, lines = bad[0]
        raise SyncMismatch(
            f"rollout.verify_sync: after the weight sync, rank {rank}'s rollout engine differs from the actor's weights "
            f"loaded whole through the engine's own loaders in {len(lines)} tensor(s), first {lines[0]}"
            + (f"; ranks {[r for r, _ in bad]} differ" if len(bad) > 1 else "")
        )
    if rollout is not None:
        logger.info("rollout.verify_sync: the rollout engine holds the actor's weights exactly (%.1fs)",
                    time.perf_counter() - t0)
