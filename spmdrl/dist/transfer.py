"""Moving batches between disjoint role rank sets (split placement) without a world-wide collective.

In split placement the rollout ranks and the training ranks run different stages at the same time, so a
transfer between them must involve only the ranks that send and receive: a collective over the world would
pair a rollout rank's call with whatever collective a training rank happens to be in. Batches therefore move
by point-to-point messages on a process group of their own (`RoleMeshes.batch_group`), planned by
`collectives.batch_move_plan`: each training dp rank receives exactly its contiguous share of the global batch,
from one replica of each rollout dp rank holding part of it. The sender does not wait: `post_batch` returns
the pending sends, which the rollout ranks complete later (`PendingSends.wait`) while they already generate
the next batch. A batch may also go out in several posts of consecutive rows (`post_rows`: asynchronous split
streams each set of groups as it completes), which `recv_batch` takes in the order they were posted.

Per message, two sends: a header (rows and the width of every tensor) and the rows packed into float64
(token ids and lengths are exact in float64), as `collectives.redistribute` packs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spmdrl.batch import Batch

from .collectives import _pack, _unpack, batch_move_plan, comm_device
from .meshes import RoleMesh


@dataclass
class PendingSends:
    """Sends posted and not yet known to be complete; the tensors stay referenced until `wait`."""

    works: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    bytes_sent: int = 0

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.tensors = [], []

    def extend(self, other: "PendingSends") -> None:
        self.works += other.works
        self.tensors += other.tensors
        self.bytes_sent += other.bytes_sent


def batch_bytes_plan(src: RoleMesh, dst: RoleMesh, per_src: int, row_bytes: int) -> dict[int, int]:
    """Bytes each dst rank receives for a batch of per_src samples per src dp rank, rows of row_bytes each."""
    plan = batch_move_plan(src.layout, dst.layout, per_src)
    return {rank: sum(hi - lo for lo, hi in peers.values()) * row_bytes for rank, peers in plan.recvs.items()}


def post_batch(batch: Batch, src: RoleMesh, dst: RoleMesh, group, tag: int = 0) -> PendingSends:
    """On a src rank: post (without waiting) the sends of this rank's rows to the dst ranks that need them.
    Every rank of a src dp group holds the same rows; the plan picks one replica per receiver."""
    return post_rows(batch, 0, len(batch), src, dst, group, tag)


def post_rows(rows: Batch, first: int, per_src: int, src: RoleMesh, dst: RoleMesh, group, tag: int = 0) -> PendingSends:
    """On a src rank: post (without waiting) rows [first, first + len(rows)) of this rank's per_src rows of a batch
    to the dst ranks whose share holds them, one message (header and rows) per dst rank. A batch can go out in
    several such posts, in row order (a stream of groups as they complete); `recv_batch` takes them as they come
    until its share is whole."""
    plan = batch_move_plan(src.layout, dst.layout, per_src)
    keys = sorted(rows.tensors)
    widths = [rows.tensors[k].shape[1] if rows.tensors[k].dim() == 2 else 1 for k in keys]
    dev = comm_device(group)
    packed = _pack(rows, keys, widths, dev)
    out = PendingSends()
    for peer, (lo, hi) in sorted(plan.sends.get(src.rank, {}).items()):
        lo, hi = max(lo, first) - first, min(hi, first + len(rows)) - first
        if lo >= hi:
            continue
        header = torch.tensor([hi - lo, *widths], dtype=torch.long, device=dev)
        part = packed[lo:hi].contiguous()
        for t in (header, part):
            out.works.append(dist.isend(t, peer, group=group, tag=tag))
            out.tensors.append(t)
        out.bytes_sent += part.numel() * part.element_size()
    return out


def recv_batch(like: Batch, src: RoleMesh, dst: RoleMesh, per_src: int, group, tag: int = 0) -> tuple[Batch, int, int]:
    """On a dst rank: receive its share of a batch whose src dp ranks hold per_src rows each; `like` gives the
    keys, dtypes and ranks (zero rows is fine). From each src peer, messages (`post_batch`, `post_rows`) are taken
    in the order they were posted until that peer's rows are all there. Returns (batch, bytes received, messages).
    `tag` tells apart batches in flight at once between the same ranks (gloo matches by tag; NCCL delivers in
    order)."""
    plan = batch_move_plan(src.layout, dst.layout, per_src)
    keys = sorted(like.tensors)
    dev = comm_device(group)
    parts, nbytes, messages = [], 0, 0
    for peer, (glo, ghi) in sorted(plan.recvs.get(dst.rank, {}).items()):
        got = 0
        while got < ghi - glo:
            header = torch.empty(1 + len(keys), dtype=torch.long, device=dev)
            dist.recv(header, peer, group=group, tag=tag)
            rows, w = int(header[0]), [int(x) for x in header[1:].tolist()]
            if not 0 < rows <= ghi - glo - got:
                raise RuntimeError(f"rank {dst.rank} expected {ghi - glo - got} more rows from rank {peer}, got {rows}")
            buf = torch.empty(rows, sum(w), dtype=torch.float64, device=dev)
            dist.recv(buf, peer, group=group, tag=tag)
            nbytes += buf.numel() * buf.element_size()
            parts.append((glo + got, w, buf))
            got += rows
            messages += 1
    if not parts:
        return Batch({k: v[:0] for k, v in like.tensors.items()}), 0, 0
    widths = [max(p[1][i] for p in parts) for i in range(len(keys))]
    batches = [_unpack(buf, keys, w, like) for _, w, buf in sorted(parts, key=lambda p: p[0])]
    return Batch.cat([_pad_to(b, keys, widths, like) for b in batches]), nbytes, messages


def _pad_to(batch: Batch, keys: list[str], widths: list[int], like: Batch) -> Batch:
    """Right-pad 2-D tensors to the common widths (parts from different senders may differ in width)."""
    out = {}
    for k, w in zip(keys, widths):
        t = batch.tensors[k]
        out[k] = torch.nn.functional.pad(t, (0, w - t.shape[1])) if like.tensors[k].dim() == 2 else t
    return Batch(out)
