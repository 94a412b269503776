"""Executing a SyncPlan: flat per-peer buffers, one batched point-to-point exchange per bucket.

For each bucket of parameters, every rank
  1. cuts from its local shards the slices the plan says it sends, casts them to the rollout dtype (cast
     before communicating) and packs them into one flat buffer per destination;
  2. posts all its sends and receives of the bucket in one `batch_isend_irecv` (NCCL fuses them into one
     group launch; gloo runs them concurrently);
  3. as a rollout rank, assembles each parameter of the bucket from its own local slices and what it
     received, and hands the bucket to the rollout engine.

What the rollout engine is given per parameter is a full-shaped tensor holding this rank's vLLM shard (the
rest is uninitialised memory that vLLM never reads): vLLM's weight loaders take HF-shaped tensors and cut the
rank's slice themselves (and on CPU re-pack the weights after loading), so the shard goes in through the
loader unchanged. Only the shard bytes cross ranks; the full-shaped buffers are local and live one bucket at
a time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spmdrl.dist.blocks import Block, numel
from .plan import SyncPlan


Shards = dict[str, dict[Block, torch.Tensor]]  # what a rank holds: name -> {its block: local tensor}


def held_shards(weight_shards) -> Shards:
    """An engine's weight_shards() ((name, tensor, block) triples) as name -> {block: tensor}. A rank may hold
    several disjoint blocks of one name (a Megatron rank's gate rows and up rows of a fused expert tensor)."""
    out: Shards = {}
    for name, t, block in weight_shards:
        out.setdefault(name, {})[block] = t
    return out


def contains(outer: Block, inner: Block) -> bool:
    return all(o <= i and i + m <= o + n for o, n, i, m in zip(outer[0], outer[1], inner[0], inner[1]))


def _slice(t: torch.Tensor, held: Block, want: Block) -> torch.Tensor:
    """The part `want` (full-tensor coordinates) of a local tensor that holds block `held`."""
    idx = tuple(slice(w - h, w - h + n) for h, w, n in zip(held[0], want[0], want[1]))
    return t[idx]


def cut(shards: Shards, name: str, want: Block) -> torch.Tensor:
    """The part `want` of parameter `name` from the one block this rank holds that contains it (the plan cuts
    every transfer out of a single source block)."""
    for held, t in shards[name].items():
        if contains(held, want):
            return _slice(t, held, want)
    raise RuntimeError(f"weight sync: {name}: no block this rank holds ({sorted(shards[name])}) contains {want}")


def _paste(full: torch.Tensor, want: Block, values: torch.Tensor) -> None:
    full[tuple(slice(o, o + n) for o, n in zip(want[0], want[1]))] = values.reshape(want[1])


def bucket_transfers(plan: SyncPlan, names: list[str], rank: int):
    """What `rank` sends and receives in the bucket of parameters `names`: ({dst: [(name, block)]},
    {src: [(name, block)]}), in the plan's order. A rank with neither makes no call for the bucket."""
    send: dict[int, list[tuple[str, Block]]] = {}
    recv: dict[int, list[tuple[str, Block]]] = {}
    for name in names:
        for t in plan.transfers[name]:
            if t.src == rank:
                send.setdefault(t.dst, []).append((name, t.block))
            if t.dst == rank:
                recv.setdefault(t.src, []).append((name, t.block))
    return send, recv


def bucket_calls(plan: SyncPlan, bucket_bytes: int, elem_bytes: int) -> list[dict[int, list[int]]]:
    """Per bucket, in order, the ranks that call `batch_isend_irecv` for it and their peers ({rank: peers}).
    The first entry is who makes the first call on the sync's group: on a lazily connected NCCL group it
    must be every member, unless the group is connected before (dist.meshes.connected_group)."""
    ranks = sorted({r for ts in plan.transfers.values() for t in ts for r in (t.src, t.dst)})
    out = []
    for names in plan.buckets(bucket_bytes, full_elem_bytes=elem_bytes):
        calls = {}
        for rank in ranks:
            send, recv = bucket_transfers(plan, names, rank)
            if send or recv:
                calls[rank] = sorted(set(send) | set(recv))
        out.append(calls)
    return out


@dataclass
class SyncStats:
    bytes_recv: int = 0
    bytes_sent: int = 0
    collectives: int = 0
    buckets: int = 0
    seconds: float = 0.0
    per_bucket_peak_bytes: list[int] = field(default_factory=list)


def execute(
    plan: SyncPlan,
    shards: Shards,
    rank: int,
    *,
    dtype: torch.dtype,
    comm_device: torch.device,
    bucket_bytes: int,
    deliver,
    group=None,
    fill: float | None = None,
) -> SyncStats:
    """Run `plan` on this rank. shards: what this rank holds, name -> {block: local tensor} (held_shards).
    deliver(list of (name, full-shaped tensor)) is called once per bucket on ranks that receive weights.
    Every bucket's exchange is complete before the next one starts, on senders too (on CUDA the host waits for
    the bucket's stream): one bucket's buffers are alive at a time, and nothing is left posted when this returns.
    fill: a value for the part of each full-shaped tensor outside this rank's shard (rollout.verify_sync fills
    NaN, so a loader reading outside the shard shows); None leaves it uninitialised."""
    stats = SyncStats()
    t0 = time.perf_counter()
    esize = torch.empty((), dtype=dtype).element_size()
    for index, names in enumerate(plan.buckets(bucket_bytes, full_elem_bytes=esize)):
        stats.buckets += 1
        sends, recv_layout = bucket_transfers(plan, names, rank)
        send = {peer: [cut(shards, name, block).to(comm_device, dtype).reshape(-1) for name, block in parts]
                for peer, parts in sends.items()}
        # the bucket's index as the tag: every rank counts buckets alike, and the group log (dist/group_log.py)
        # can tell which bucket a rank's first call on the group was
        ops, recv_bufs = [], {}
        for peer in sorted(send):
            buf = torch.cat(send[peer])
            stats.bytes_sent += buf.numel() * esize
            ops.append(dist.P2POp(dist.isend, buf, peer, group=group, tag=index))
        for peer in sorted(recv_layout):
            n = sum(numel(b) for _, b in recv_layout[peer])
            recv_bufs[peer] = torch.empty(n, dtype=dtype, device=comm_device)
            stats.bytes_recv += n * esize
            ops.append(dist.P2POp(dist.irecv, recv_bufs[peer], peer, group=group, tag=index))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            stats.collectives += 1
        # assemble this rank's rollout tensors for the bucket
        out = []
        for name in names:
            want = plan.target_of[name].get(rank)
            if want is None:
                continue
            full = torch.empty(plan.shapes[name], dtype=dtype, device=comm_device)  # vLLM reads only its slice
            if fill is not None:
                full.fill_(fill)
            for t in plan.local[name]:
                if t.dst == rank:
                    _paste(full, t.block, cut(shards, name, t.block).to(comm_device, dtype))
            out.append((name, full))
        fulls = dict(out)
        for peer, layout in recv_layout.items():
            off, buf = 0, recv_bufs[peer]
            for name, block in layout:
                n = numel(block)
                _paste(fulls[name], block, buf[off: off + n])
                off += n
        if out:
            stats.per_bucket_peak_bytes.append(sum(t.numel() * esize for _, t in out))
            deliver(out)
        del out, fulls, recv_bufs, send
        if comm_device.type == "cuda":
            # on NCCL work.wait() only orders the streams: the host would go on allocating the next buckets'
            # buffers while this one's transfer is in flight, each held until its transfer completes. Waiting
            # for the bucket here keeps one bucket's buffers alive at a time, as on gloo and as the plan counts.
            torch.cuda.current_stream(comm_device).synchronize()
    stats.seconds = time.perf_counter() - t0
    return stats
