"""Collectives on packed tensors: batch redistribution between role layouts, and the metric all-reduce."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spmdrl.batch import Batch

from .layout import RoleLayout
from .meshes import RoleMesh


def comm_device(group=None) -> torch.device:
    """Where a collective's tensors must live: the current CUDA device under NCCL, else the CPU (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class BatchMovePlan:
    """Per global rank: what it keeps of its own samples, sends and receives (global sample positions)."""

    keep: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # rank -> (lo, hi, first held)
    sends: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)  # rank -> peer -> local (lo, hi)
    recvs: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)  # rank -> peer -> global (lo, hi)


def batch_move_plan(src: RoleLayout, dst: RoleLayout, per_src: int) -> BatchMovePlan:
    """Samples are src dp-rank major: src dp rank i holds [i*per_src, (i+1)*per_src) on each of its ranks;
    dst dp rank j needs its contiguous share of the total. A dst rank keeps what it holds and receives the rest,
    each missing range from one replica of the src dp rank holding it (round-robin over the replicas)."""
    total = per_src * src.dp
    plan = BatchMovePlan()
    holders = [src.replica_ranks(i) for i in range(src.dp)]
    for k, rank in enumerate(dst.ranks):
        j = dst.coords(rank)[0]
        lo, hi = j * total // dst.dp, (j + 1) * total // dst.dp
        c = src.coords(rank)
        if c is not None:
            hlo = c[0] * per_src
            klo, khi = max(lo, hlo), min(hi, hlo + per_src)
            if klo < khi:
                plan.keep[rank] = (klo, khi, hlo)
        for i in range(src.dp):
            glo, ghi = max(lo, i * per_src), min(hi, (i + 1) * per_src)
            if glo >= ghi or (c is not None and c[0] == i):
                continue
            peer = holders[i][k % len(holders[i])]
            plan.recvs.setdefault(rank, {})[peer] = (glo, ghi)
            plan.sends.setdefault(peer, {})[rank] = (glo - i * per_src, ghi - i * per_src)
    return plan


def _pack(batch: Batch, keys: list[str], widths: list[int], dev) -> torch.Tensor:
    """All tensors of a batch as one float64 [B, sum of widths] matrix (token ids and lengths are exact in
    float64), each 2-D tensor right-padded to the agreed width."""
    cols = [torch.nn.functional.pad(batch.tensors[k].to(torch.float64).reshape(len(batch), -1), (0, w - 
            (batch.tensors[k].shape[1] if batch.tensors[k].dim() == 2 else 1))) for k, w in zip(keys, widths)]
    return torch.cat(cols, dim=1).to(dev)


def _unpack(rows: torch.Tensor, keys: list[str], widths: list[int], like: Batch) -> Batch:
    """The inverse of _pack: columns back into tensors of `like`'s dtypes and ranks, on the CPU."""
    out, off = {}, 0
    for k, w in zip(keys, widths):
        t = rows[:, off: off + w].cpu()
        out[k] = (t if like.tensors[k].dim() == 2 else t[:, 0]).to(like.tensors[k].dtype)
        off += w
    return Batch(out)


def redistribute(batch: Batch, src: RoleMesh, dst: RoleMesh, group=None) -> Batch:
    """Move a batch laid out by `src`'s data-parallel ranks to `dst`'s (tensors only; meta is re-derived).

    Global sample order is src dp-rank major; every rank of a src tp group holds its dp rank's samples. When
    every dst rank already holds what it needs (colocated, rollout tp >= actor tp), this is a local slice with
    no communication. Otherwise one all-reduce agrees on sizes and widths, and one batched point-to-point
    exchange of packed float64 rows gives each dst rank exactly the samples it lacks, from one replica of the
    src dp rank that holds them (tp copies are never gathered). Every rank passes a batch with the same keys
    (a rank outside src passes zero-row tensors of the right dtype and rank). group: the ranks that take part
    (every rank of src and dst; None: the world), e.g. the training ranks of a split layout moving a batch
    between two training roles.
    """
    me = src.rank
    probe = batch_move_plan(src.layout, dst.layout, dst.layout.dp)  # structure only: does anything move?
    if not probe.recvs:
        plan = batch_move_plan(src.layout, dst.layout, len(batch))
        if me not in plan.keep:
            return Batch({k: v[:0] for k, v in batch.tensors.items()})
        lo, hi, hlo = plan.keep[me]
        return Batch({k: v[lo - hlo: hi - hlo] for k, v in batch.tensors.items()})
    keys = sorted(batch.tensors)
    dev = comm_device()
    local_w = [batch.tensors[k].shape[1] if batch.tensors[k].dim() == 2 else 1 for k in keys]
    agreed = torch.tensor([len(batch) if src.active else 0, *local_w], dtype=torch.long, device=dev)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    per_src, widths = int(agreed[0]), [int(w) for w in agreed[1:]]
    plan = batch_move_plan(src.layout, dst.layout, per_src)
    packed = _pack(batch, keys, widths, dev)
    ops, received = [], []
    for peer, (lo, hi) in sorted(plan.sends.get(me, {}).items()):
        ops.append(dist.P2POp(dist.isend, packed[lo:hi].contiguous(), peer, group=group))
    for peer, (glo, ghi) in sorted(plan.recvs.get(me, {}).items()):
        buf = torch.empty(ghi - glo, sum(widths), dtype=torch.float64, device=dev)
        received.append((glo, buf))
        ops.append(dist.P2POp(dist.irecv, buf, peer, group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if me in plan.keep:
        lo, hi, hlo = plan.keep[me]
        received.append((lo, packed[lo - hlo: hi - hlo]))
    rows = torch.cat([p for _, p in sorted(received, key=lambda x: x[0])]) if received else packed[:0]
    return _unpack(rows, keys, widths, batch)


def gather_tp_slices(part: torch.Tensor, mesh: RoleMesh, n: int) -> torch.Tensor:
    """Concatenate over the tp group each rank's `tp_range(n)` share of a per-sample tensor (one all-gather)."""
    sizes = [len(r) for r in mesh.tp_ranges(n)]
    group = mesh.group("tp")
    dev = comm_device(group)
    padded = torch.zeros((max(sizes), *part.shape[1:]), dtype=part.dtype, device=dev)
    padded[: part.shape[0]] = part.to(dev)
    chunks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(chunks, padded, group=group)
    return torch.cat([c[:k] for c, k in zip(chunks, sizes)]).cpu()


def all_gather_strings(texts: list[str], mesh: RoleMesh, n: int) -> list[str]:
    """Each tp rank's share of n strings (its `tp_range(n)`), shared over the tp group as packed UTF-8 bytes:
    one all-gather of the byte lengths, one of the bytes."""
    encoded = [t.encode("utf-8") for t in texts]
    lens = torch.tensor([len(b) for b in encoded], dtype=torch.long)
    all_lens = gather_tp_slices(lens, mesh, n)
    flat = torch.frombuffer(bytearray(b"".join(encoded)), dtype=torch.uint8) if sum(lens) else torch.zeros(0, dtype=torch.uint8)
    group = mesh.group("tp")
    dev = comm_device(group)
    totals = [int(all_lens[r.start: r.stop].sum()) for r in mesh.tp_ranges(n)]
    padded = torch.zeros(max(totals + [1]), dtype=torch.uint8, device=dev)
    padded[: flat.numel()] = flat.to(dev)
    chunks = [torch.empty_like(padded) for _ in totals]
    dist.all_gather(chunks, padded, group=group)
    data = b"".join(bytes(c[:k].cpu().numpy().tobytes()) for c, k in zip(chunks, totals))
    out, off = [], 0
    for k in all_lens.tolist():
        out.append(data[off: off + k].decode("utf-8"))
        off += k
    return out


def sum_over_tp(values: dict[str, float], mesh: RoleMesh) -> dict[str, float]:
    """Per-key sums of small scalar dicts over this rank's tp group (the ranks may hold different keys): one
    all_gather_object of the dicts; every rank of the group gets the same result."""
    if mesh.tp_size == 1:
        return dict(values)
    gathered: list = [None] * mesh.tp_size
    dist.all_gather_object(gathered, values, group=mesh.group("tp"))
    out: dict[str, float] = {}
    for d in gathered:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def take_global_rows(batch: Batch, lo: int, hi: int, group=None) -> Batch:
    """Rows [lo, hi) of the concatenation, in `group` rank order, of every rank's `batch` (tensors only;
    meta is dropped). Ranks may hold different row counts but have the same keys. One all-gather agrees on
    counts and widths, one all-gather moves every tensor packed into float64 rows (as `redistribute` does)."""
    keys = sorted(batch.tensors)
    dev = comm_device(group)
    size = dist.get_world_size(group)
    local_w = [batch.tensors[k].shape[1] if batch.tensors[k].dim() == 2 else 1 for k in keys]
    sizes = torch.tensor([len(batch), *local_w], dtype=torch.long, device=dev)
    everyone = [torch.empty_like(sizes) for _ in range(size)]
    dist.all_gather(everyone, sizes, group=group)
    counts = [int(x[0]) for x in everyone]
    widths = torch.stack(everyone)[:, 1:].max(0).values.tolist()
    packed = _pack(batch, keys, widths, dev)
    packed = torch.cat([packed, packed.new_zeros(max(counts) - len(batch), packed.shape[1])])
    parts = [torch.empty_like(packed) for _ in range(size)]
    dist.all_gather(parts, packed, group=group)
    rows = torch.cat([p[:c] for p, c in zip(parts, counts)])[lo:hi]
    return _unpack(rows, keys, widths, batch)


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


def reduce_max(values: torch.Tensor, group=None) -> list[float]:
    """Element-wise max over ranks of a small vector (float64), as Python floats."""
    t = values.to(comm_device(group), torch.float64).clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def is_group_leader(group=None) -> bool:
    """Whether this rank is the first rank of `group` (always, for None or a one-rank group)."""
    return group is None or dist.get_rank(group) == 0


def broadcast_from_leader(obj, group=None):
    """`obj` as the first rank of `group` holds it, on every rank of the group (a pickled broadcast; the other
    ranks' `obj` is ignored). No communication for None or a one-rank group."""
    if group is None or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                               device=comm_device(group) if dist.get_backend(group) == "nccl" else None)
    return box[0]


def group_agrees(values: list[int], group=None) -> bool:
    """Whether every rank of `group` passed the same small list of integers (one max all-reduce of the values and
    their negations; each value is folded into 62 bits). True for None or a one-rank group."""
    if group is None or dist.get_world_size(group) == 1:
        return True
    v = torch.tensor([x % (1 << 62) for x in values], dtype=torch.int64)
    t = torch.cat([v, -v]).to(comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(t.cpu(), torch.cat([v, -v])))
