"""Packed variable-length batches and token-budget micro-batches (padding removal), torch-native.

Padded layout: one sequence per row, right-padded to the longest sequence of the micro-batch; every row costs
as much as the longest one. Packed layout (`pack_varlen`): all sequences of a micro-batch one after another in
a single row of exactly their tokens, no padding, each with its own position ids (0, 1, ...), and their
boundaries as cu_seqlens (int32 [n + 1], the cumulative lengths in batch order) and max_seqlen. The FSDP2
engine's default attention (spmdrl.engines.attention) takes those boundaries directly: each token attends to the
earlier tokens of its own sequence, as in the padded layout, with no mask tensor; the cost per sequence is its
own length squared, not the row's.

Row-packed reference layout (`pack_rows`): whole sequences first-fit into rows of `row_len` tokens with a dense
[rows, 1, L, L] block-diagonal causal mask (`block_causal_mask`) and a masked tail per row. It is what the
engine runs under model.attn_implementation = "sdpa" (transformers' SDPA with that mask), and the dense mask
that consumers without a varlen path take from a packed batch.
"""
from __future__ import annotations

import torch

from spmdrl.errors import ConfigError


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices whose lengths sum to <= capacity: longest first, each into the first bin it fits.

    Deterministic (ties keep index order); every item longer than capacity is an error, not a silent overflow.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ConfigError(f"a sequence of {n} tokens does not fit a packed row of {capacity} tokens: raise the row length")
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def balanced_partition(lengths: list[int], parts: int, max_items: int = 0) -> list[list[int]]:
    """Split item indices into `parts` non-empty groups with near-equal token sums (longest first into the
    lightest group that has fewer than max_items items; 0: no cap), each group in ascending index order.
    Needs len(lengths) >= parts (and <= parts * max_items)."""
    if parts < 1 or len(lengths) < parts or (max_items and len(lengths) > parts * max_items):
        raise ConfigError(f"cannot split {len(lengths)} sequences into {parts} non-empty micro-batches")
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        open_ = [k for k in range(parts) if not max_items or len(groups[k]) < max_items]
        g = min(open_, key=lambda k: (load[k], len(groups[k]), k))
        groups[g].append(i)
        load[g] += lengths[i]
    return [sorted(g) for g in groups]


def micro_batch_count(lengths: list[int], max_tokens: int, max_seqs: int) -> int:
    """Micro-batches this rank needs so that balanced_partition's split holds at most max_tokens tokens
    (0: no budget) and max_seqs sequences (0: no cap) per micro-batch. The caller takes the max
    over data-parallel ranks, since every rank must run the same number of forwards (each is a collective
    under FSDP); a rank that then splits into more micro-batches than it needed only gets smaller ones."""
    if not lengths:
        return 0
    if max_tokens and max(lengths) > max_tokens:
        raise ConfigError(
            f"a sequence of {max(lengths)} tokens exceeds actor.max_tokens_per_micro_batch = {max_tokens}: raise it "
            "to at least max_prompt_length + max_response_length"
        )
    by_seqs = -(-len(lengths) // max_seqs) if max_seqs else 1
    k = max(1, by_seqs, -(-sum(lengths) // max_tokens) if max_tokens else 1)
    # the lower bound may not be reachable by balanced_partition's greedy split: add micro-batches until it is
    while max_tokens and k < len(lengths) and max(
        sum(lengths[i] for i in g) for g in balanced_partition(lengths, k, max_seqs)
    ) > max_tokens:
        k += 1
    return k


def packed_layout(lengths: list[int], row_len: int) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Rows of sequence indices, plus for each sequence its row and its first column.

    Returns (rows, row_of [B], start_of [B]).
    """
    rows = first_fit_decreasing(lengths, row_len)
    row_of = torch.zeros(len(lengths), dtype=torch.long)
    start_of = torch.zeros(len(lengths), dtype=torch.long)
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            row_of[i], start_of[i] = r, col
            col += lengths[i]
    return rows, row_of, start_of


def block_causal_mask(seq_id: torch.Tensor) -> torch.Tensor:
    """[rows, L] sequence ids -> [rows, 1, L, L] bool, True where query q may attend key k: same sequence and
    k <= q. Padding carries its own id, so it never mixes with a real sequence."""
    L = seq_id.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=seq_id.device).tril()
    same = seq_id[:, :, None] == seq_id[:, None, :]
    return (same & causal)[:, None]


def seq_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] index of the sequence each packed token belongs to, from cu_seqlens [n + 1]."""
    cu = cu_seqlens.long()
    return torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu.diff())


def pack_varlen(prompts: list[torch.Tensor], responses: list[torch.Tensor], R: int):
    """The packed tensors of a TokenBatch: (input_ids [1, T], position_ids [1, T], cu_seqlens int32 [n + 1],
    max_seqlen, resp_pos [B, R]): sequence i = prompt i + response i at [cu_seqlens[i], cu_seqlens[i + 1]),
    its position ids 0..len - 1; resp_pos[i, j] the index of the hidden state that predicts response token j."""
    lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    T = int(cu[-1])
    input_ids = torch.cat([t for p, r in zip(prompts, responses) for t in (p, r)]).long()[None]
    position_ids = (torch.arange(T) - cu[:-1].long().repeat_interleave(lengths))[None]
    plen = torch.tensor([len(p) for p in prompts])
    resp_pos = (cu[:-1, None].long() + plen[:, None] - 1 + torch.arange(R)[None, :]).clamp(max=T - 1)
    return input_ids, position_ids, cu, int(lengths.max()), resp_pos


def pack_rows(prompts: list[torch.Tensor], responses: list[torch.Tensor], pad_id: int, R: int, row_len: int = 0):
    """The packed tensors of a TokenBatch: (input_ids [N, L], mask [N, 1, L, L], position_ids [N, L],
    resp_pos [B, R], row_of [B]), rows of L = row_len tokens (0: the longest sequence)."""
    plen = torch.tensor([len(p) for p in prompts])
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    L = row_len or max(lengths)
    rows, row_of, start_of = packed_layout(lengths, L)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    seq_id = torch.full((len(rows), L), -1, dtype=torch.long)  # the tail padding of a row is one block of its own
    position_ids = torch.arange(L).repeat(len(rows), 1)  # the tail padding counts from 0 like a sequence
    used = [0] * len(rows)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        row, s, n = int(row_of[i]), int(start_of[i]), lengths[i]
        input_ids[row, s: s + len(p)] = p
        input_ids[row, s + len(p): s + n] = r
        seq_id[row, s: s + n] = i
        position_ids[row, s: s + n] = torch.arange(n)
        used[row] = max(used[row], s + n)
    for row, u in enumerate(used):
        position_ids[row, u:] = torch.arange(L - u)
    resp_pos = (start_of[:, None] + plen[:, None] - 1 + torch.arange(R)[None, :]).clamp(max=L - 1)
    return input_ids, block_causal_mask(seq_id), position_ids, resp_pos, row_of
