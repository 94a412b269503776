"""Weight resharding as a pure plan: who sends which slice of which parameter to whom.

Inputs are plain data, so the same code runs inside a job and in `spmdrl plan` on a laptop:
  * the parameters, HF names and full shapes, in the order the engine yields them;
  * the source layout: for every parameter, the rectangular block of it each training rank holds
    (FSDP2 dp x DTensor tp: `fsdp_blocks`; Megatron-core tp x pp x dp: `megatron_blocks`; both in dist/blocks.py,
    the layout arithmetic the engines check their real shards against);
  * the target layout: for every rollout rank, the block of each parameter its vLLM TP shard needs
    (`vllm_blocks`).

A block is (offsets, shape) in the full tensor. The distinct source blocks of a parameter partition it
(replicas hold identical blocks: tp ranks of a non-TP parameter, DP replicas under Megatron). For each
rollout rank and each distinct source block overlapping what it needs, the overlap is either already on the
rank (no bytes move) or sent by one replica (the least loaded so far, so replicas share the sending).
Nothing is sent twice and nothing a rank holds moves, so the bytes a rank receives equal the lower bound:
the bytes of its rollout shard that it does not already hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from spmdrl.dist.blocks import Block, intersect, numel


# --------------------------------------------------------------------------------------------------- the plan


def group_by_bytes(items: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Consecutive (key, bytes) items grouped so each group stays under `limit` bytes (one item at least)."""
    out, cur, size = [], [], 0
    for key, nbytes in items:
        if cur and size + nbytes > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += nbytes
    if cur:
        out.append(cur)
    return out


@dataclass(frozen=True)
class Transfer:
    name: str
    src: int
    dst: int
    block: Block  # in full-tensor coordinates


@dataclass
class SyncPlan:
    """Transfers per parameter plus what each rank holds/needs; byte figures in `elem_bytes` per element."""

    params: list[tuple[str, tuple[int, ...]]]
    sources: dict[str, list[tuple[int, Block]]]
    targets: dict[str, list[tuple[int, Block]]]
    transfers: dict[str, list[Transfer]] = field(default_factory=dict)  # remote only (src != dst)
    local: dict[str, list[Transfer]] = field(default_factory=dict)  # src == dst: copies, no bytes move
    elem_bytes: int = 2
    reads: object = None  # vllm_reads.VllmReads the targets were learnt from (None: whole tensors for every rank)

    def _bytes_by(self, side: str) -> dict[int, int]:
        out: dict[int, int] = {}
        for ts in self.transfers.values():
            for t in ts:
                rank = getattr(t, side)
                out[rank] = out.get(rank, 0) + numel(t.block) * self.elem_bytes
        return out

    def bytes_recv(self) -> dict[int, int]:
        return self._bytes_by("dst")

    def bytes_sent(self) -> dict[int, int]:
        return self._bytes_by("src")

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.params)

    @cached_property
    def target_of(self) -> dict[str, dict[int, list[Block]]]:
        """name -> rollout rank -> the blocks it needs (looked up on every sync)."""
        out: dict[str, dict[int, list[Block]]] = {}
        for name, ts in self.targets.items():
            mine = out.setdefault(name, {})
            for rank, b in ts:
                mine.setdefault(rank, []).append(b)
        return out

    def lower_bound(self) -> dict[int, int]:
        """Per rollout rank: bytes of its shard it does not already hold (independent of the transfers)."""
        out: dict[int, int] = {}
        for name, shape in self.params:
            held: dict[int, list[Block]] = {}
            for rank, b in self.sources[name]:
                held.setdefault(rank, []).append(b)
            for rank, need in self.targets[name]:
                have = 0
                for b in held.get(rank, []):
                    x = intersect(need, b)
                    have += numel(x) if x else 0
                out[rank] = out.get(rank, 0) + (numel(need) - have) * self.elem_bytes
        return out

    def buckets(self, bucket_bytes: int, full_elem_bytes: int | None = None) -> list[list[str]]:
        """Consecutive parameters grouped so a bucket's full tensors stay under bucket_bytes (at least one
        parameter each): the receiving side materialises full-shaped tensors one bucket at a time."""
        eb = full_elem_bytes or self.elem_bytes
        return group_by_bytes([(name, math.prod(shape) * eb) for name, shape in self.params], bucket_bytes)

    def summary(self, bucket_bytes: int) -> dict:
        recv, lb = self.bytes_recv(), self.lower_bound()
        buckets = self.buckets(bucket_bytes)
        remote = {n for n, ts in self.transfers.items() if ts}
        return {
            "bytes_recv_max": max(recv.values(), default=0),
            "bytes_lower_bound": max(lb.values(), default=0),
            "bytes_recv_total": sum(recv.values()),
            "bytes_sent_max": max(self.bytes_sent().values(), default=0),
            "bytes_recv_per_rank": {str(k): v for k, v in sorted(recv.items())},
            "collectives": sum(1 for b in buckets if any(n in remote for n in b)),
            "buckets": len(buckets),
        }


def plan_sync(
    params: list[tuple[str, tuple[int, ...]]],
    sources: dict[str, list[tuple[int, Block]]],
    targets: dict[str, list[tuple[int, Block]]],
    elem_bytes: int,
) -> SyncPlan:
    """Every target block covered exactly once: locally where the rank holds it, else by one source replica,
    the one that has sent the fewest bytes so far (ties: rotating with the receiver), so DP replicas, tp copies
    of a replicated tensor and tied-embedding copies share the sending."""
    plan = SyncPlan(params, sources, targets, elem_bytes=elem_bytes)
    sent: dict[int, int] = {}
    for name, shape in params:
        replicas: dict[Block, list[int]] = {}
        for rank, b in sources[name]:
            if numel(b):
                replicas.setdefault(b, []).append(rank)
        covered = sum(numel(b) for b in replicas)
        if covered != math.prod(shape):
            raise ValueError(f"{name}: source blocks cover {covered} of {math.prod(shape)} elements")
        remote, local = [], []
        for k, (dst, need) in enumerate(targets[name]):
            for b, holders in replicas.items():
                x = intersect(need, b)
                if x is None:
                    continue
                if dst in holders:
                    local.append(Transfer(name, dst, dst, x))
                else:
                    n = len(holders)
                    src = min(range(n), key=lambda i: (sent.get(holders[i], 0), (i - k) % n))
                    sent[holders[src]] = sent.get(holders[src], 0) + numel(x)
                    remote.append(Transfer(name, holders[src], dst, x))
        plan.transfers[name], plan.local[name] = remote, local
    return plan

