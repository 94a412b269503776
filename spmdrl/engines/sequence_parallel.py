"""Ulysses sequence parallelism for the FSDP2 engine: the sp ranks of a data-parallel replica split every
forward's token dimension and exchange attention heads for tokens around each attention call.

The sp ranks of a replica hold the same TokenBatch. Each pads its width (the packed row's tokens, or a padded
batch's columns) to a multiple of sp and keeps its contiguous part, so a packed sequence may start on one rank
and end on the next. Everything but attention is per token and runs on the local tokens alone. Attention needs
the whole sequence: an all-to-all turns q, k, v of [N, H, W / sp, D] (all heads, local tokens) into
[N, H / sp, W, D] (local heads, all tokens), attention runs per head over the full width exactly as without
sp (the packed boundaries cu_seqlens are the full row's), and the reverse all-to-all brings the output back to
the local tokens. Grouped key/value heads fewer than sp are repeated to sp heads first (each rank's query heads
then meet the one key/value head they use); the repeat's backward sums the copies' gradients.

The log-prob (and value) heads run on the local response tokens; `gather` sums the [B, R] results over the sp
group (each position is computed on exactly one rank; the others add zeros), so every sp rank sees the same
[B, R] and computes the same loss. Its backward passes each rank's gradient through unchanged: the loss is the
same on every sp rank, so d loss / d (local result) is already the right gradient, and the parameters' gradient
summed over the sp ranks is the sp = 1 gradient. FSDP2 shards over dp x sp and averages over them: the engine
scales the loss by sp before backward (FSDPEngine.train_step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmdrl.errors import ConfigError

from .response_index import ResponseIndex
from .token_batch import TokenBatch


class _AllToAll(torch.autograd.Function):
    """[sp, ...] chunks: chunk s goes to sp rank s, chunk s of the result came from rank s; backward reverses."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        out = torch.empty_like(g, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, g, group=ctx.group)
        return out, None


class _SumOverSp(torch.autograd.Function):
    """Forward: the sum over the sp group (of results each rank holds at its own positions). Backward: the
    gradient as it is (every sp rank computes the same loss from the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


@dataclass
class SequenceShard:
    """This rank's part of one TokenBatch's token dimension: positions [lo, hi) of the width padded to
    `width` (a multiple of sp), and the sp group the attention exchanges heads with."""

    group: object
    size: int
    lo: int
    hi: int
    width: int
    cu_seqlens: torch.Tensor | None  # packed: the full row's boundaries, the padding (if any) one more sequence
    max_seqlen: int

    @classmethod
    def of(cls, b: TokenBatch, mesh) -> "SequenceShard":
        """The shard of b on this rank of the role mesh (spmdrl.dist.meshes.RoleMesh, sp > 1)."""
        if b.mask is not None and b.mask.dim() == 4:
            raise ConfigError("sequence parallelism takes padded or packed (cu_seqlens) batches, not a row-packed batch "
                              "with a dense mask; set model.attn_implementation = 'auto'")
        L = b.input_ids.shape[1]
        width = mesh.sp_padded(L)
        r = mesh.sp_range(width)
        cu, longest = b.cu_seqlens, b.max_seqlen
        if cu is not None and width > L:
            cu = torch.cat([cu, cu.new_tensor([width])])
            longest = max(longest, width - L)
        return cls(mesh.group("sp"), mesh.sp_size, r.start, r.stop, width, cu, longest)

    # ---- inputs -------------------------------------------------------------------------------------------
    def local(self, t: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """[N, L] per-token inputs -> this rank's [N, hi - lo], padded on the right with `fill` first."""
        if t.shape[1] < self.width:
            t = torch.cat([t, t.new_full((t.shape[0], self.width - t.shape[1]), fill)], 1)
        return t[:, self.lo: self.hi]

    def local_index(self, index: ResponseIndex, width: int) -> ResponseIndex:
        """A batch-first ResponseIndex of the full batch (rows of `width` positions) -> the response tokens whose
        hidden state is on this rank, indexing the local hidden states [N, hi - lo, H] flattened."""
        row, pos = index.hidden // width, index.hidden % width
        keep = ((pos >= self.lo) & (pos < self.hi)).nonzero().squeeze(1)
        hidden = row[keep] * (self.hi - self.lo) + pos[keep] - self.lo
        return ResponseIndex(hidden, index.labels[keep], index.out[keep], index.shape)

    def to(self, device) -> "SequenceShard":
        cu = self.cu_seqlens.to(device) if self.cu_seqlens is not None else None
        return SequenceShard(self.group, self.size, self.lo, self.hi, self.width, cu, self.max_seqlen)

    # ---- results --------------------------------------------------------------------------------------------
    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """[B, R] results at this rank's positions (zero elsewhere) -> the whole [B, R] on every sp rank."""
        return _SumOverSp.apply(values, self.group)

    # ---- attention ------------------------------------------------------------------------------------------
    def heads_to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H, W / sp, D] (all heads, local tokens) -> [N, H / sp, W, D] (local heads, all tokens)."""
        N, H, n, D = x.shape
        chunks = x.reshape(N, self.size, H // self.size, n, D).transpose(0, 1)  # [sp, N, H/sp, n, D]
        out = _AllToAll.apply(chunks, self.group)  # chunk s: rank s's tokens of my heads
        return out.permute(1, 2, 0, 3, 4).reshape(N, H // self.size, self.size * n, D)

    def tokens_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[N, W, H / sp, D] (attention's output layout: all tokens, local heads) -> [N, W / sp, H, D]."""
        N, W, h, D = x.shape
        n = W // self.size
        chunks = x.reshape(N, self.size, n, h, D).transpose(0, 1)  # [sp, N, n, h, D]: chunk s = rank s's tokens
        out = _AllToAll.apply(chunks, self.group)  # chunk s: my tokens of rank s's heads
        return out.permute(1, 2, 0, 3, 4).reshape(N, n, self.size * h, D)

    def spread_kv(self, k: torch.Tensor, n_q: int) -> torch.Tensor:
        """Key/value heads [N, Hkv, n, D] -> as many as the exchange needs: Hkv itself when sp divides it, else
        each head repeated sp / Hkv times (sp must then be a multiple of Hkv, and divide the query heads)."""
        hkv = k.shape[1]
        if hkv % self.size == 0:
            return k
        if self.size % hkv or n_q % self.size:
            raise ConfigError(f"sequence parallelism over {self.size} ranks needs the attention heads ({n_q}) divisible "
                              f"by sp and the key/value heads ({hkv}) a multiple or a divisor of it; choose such an sp")
        return k.repeat_interleave(self.size // hkv, dim=1)

