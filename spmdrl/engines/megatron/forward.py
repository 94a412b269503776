"""Heads on the last PP stage: log-probs and entropy from vocab-parallel logits, and critic values.

Log-probs never gather the vocabulary. With z the local logits [n, Vp/tp] of this tp rank (temperature T
applied first: z = W_t h / T), padding columns (global index >= V) set to -inf, and sums over tp written S_tp:
    m   = max_tp max_v z            (all-reduce MAX, no gradient: lse does not depend on m)
    lse = m + log S_tp sum_v exp(z_v - m)
    log p(y) = S_tp [z_y if y is in this rank's vocabulary range else 0] - lse
    H = lse - (S_tp sum_v e_v z_v) / (S_tp sum_v e_v),  e_v = exp(z_v - m)
The sums go through megatron's reduce_from_tensor_model_parallel_region (all-reduce forward, identity
backward). That backward is right only because nothing rank-local is computed from a reduced value: every
quantity after a reduction is identical on all tp ranks, so the gradient reaching each rank's local sum is the
full one. (Writing H with the local softmax p_v = e_v / S would use the global S in rank-local terms and lose
the other ranks' share of dH/dS.) The hidden states enter through copy_to_tensor_model_parallel_region (identity forward,
all-reduce backward) or, under sequence parallelism, through the sequence all-gather (reduce-scatter backward),
which adds the tp ranks' partial input gradients. Nothing is modified in place (megatron's own
vocab_parallel_cross_entropy is not used). Chunks of `chunk_size` rows are recomputed in backward
(activation checkpointing), so peak memory is O(chunk_size * V / tp).
"""
from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from spmdrl.engines.response_index import ResponseIndex  # noqa: F401  (re-exported for the engine)
from spmdrl.errors import SpmdrlError


def _vocab_chunk(h, w, labels, lo: int, vocab: int, inv_temp: float, with_entropy: bool, entropy_grad: bool, group):
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_tp

    z = F.linear(h, w).float() * inv_temp
    n_local = z.shape[-1]
    if lo + n_local > vocab:  # padding columns of the padded vocabulary
        cols = torch.arange(lo, lo + n_local, device=z.device)
        z = z.masked_fill(cols >= vocab, float("-inf"))
    m = z.detach().max(dim=-1).values
    if dist.get_world_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m[:, None])
    sumexp = reduce_tp(e.sum(-1), group=group)
    lse = m + torch.log(sumexp)
    local = labels - lo
    mine = (local >= 0) & (local < n_local)
    z_y = z.gather(-1, local.clamp(0, n_local - 1)[:, None]).squeeze(-1)
    z_y = reduce_tp(torch.where(mine, z_y, torch.zeros_like(z_y)), group=group)
    logp = z_y - lse
    if not with_entropy:
        return (logp,)

    def entropy(z, e, sumexp, lse):
        # every term after a reduction is the same on all tp ranks (see the module docstring): A = S_tp sum e z
        ez = reduce_tp((e * z.masked_fill(e == 0, 0.0)).sum(-1), group=group)
        return lse - ez / sumexp

    if entropy_grad:
        return logp, entropy(z, e, sumexp, lse)
    with torch.no_grad():
        return logp, entropy(z.detach(), e.detach(), sumexp.detach(), lse.detach())


def vocab_parallel_logprobs(h, w, labels, *, vocab_start: int, vocab: int, temperature: float, chunk_size: int,
                            with_entropy, group):
    """h [n, H] (identical on the tp ranks), w [Vp/tp, H] this rank's rows starting at global row vocab_start,
    labels [n] -> (logp [n], entropy [n] or None), float32. with_entropy: True, "detached" or False."""
    if temperature <= 0:
        raise SpmdrlError(f"temperature must be > 0, got {temperature}")
    ent_grad = with_entropy != "detached"
    use_ckpt = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    logps, ents = [], []
    for s in range(0, max(h.shape[0], 1), chunk_size):
        args = (h[s: s + chunk_size], w, labels[s: s + chunk_size], vocab_start, vocab, 1.0 / temperature,
                bool(with_entropy), ent_grad, group)
        res = checkpoint(_vocab_chunk, *args, use_reentrant=False) if use_ckpt else _vocab_chunk(*args)
        logps.append(res[0])
        if with_entropy:
            ents.append(res[1])
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def gathered_truncated_logprobs(h, w, labels, *, vocab: int, temperature: float, top_k: int, top_p: float,
                                chunk_size: int, with_entropy, group):
    """Log-probs (and entropy) of the sampler's truncated distribution: softmax(truncate_logits(W h / T, top_k,
    top_p)), the FSDP2 engine's formula (spmdrl.algos.token_stats). Truncation needs every logit of a row (a
    global top-k and a sort for top-p), so each chunk's vocab-parallel logits are all-gathered over tp and the
    padding columns dropped; every tp rank then computes the same full-vocabulary result.

    Forward only (the rollout mismatch diagnostic and rollout correction, under no_grad). Memory per rank is
    O(chunk_size * V): the gathered float32 logits [chunk, V] plus truncate_logits' working copies (the sorted
    logits, the int64 sort order, softmax and cumsum), all freed after the chunk."""
    from spmdrl.algos.token_stats import entropy_from_logits, truncate_logits

    if temperature <= 0:
        raise SpmdrlError(f"temperature must be > 0, got {temperature}")
    if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
        raise SpmdrlError("megatron backend: log-probs with top_k / top_p truncation are forward-only (the rollout "
                          "mismatch diagnostic); the loss uses the untruncated distribution")
    tp = dist.get_world_size(group)
    logps, ents = [], []
    for s in range(0, h.shape[0], chunk_size):
        z = F.linear(h[s: s + chunk_size], w).float() * (1.0 / temperature)
        if tp > 1:
            parts = [torch.empty_like(z) for _ in range(tp)]
            dist.all_gather(parts, z.contiguous(), group=group)
            z = torch.cat(parts, dim=-1)  # tp ranks hold consecutive vocabulary rows
            del parts
        z = truncate_logits(z[:, :vocab], top_k, top_p)
        y = labels[s: s + chunk_size]
        logps.append(torch.log_softmax(z, dim=-1).gather(-1, y[:, None]).squeeze(-1))
        if with_entropy:
            ents.append(entropy_from_logits(z))
    empty = h.new_zeros(0, dtype=torch.float32)
    return (torch.cat(logps) if logps else empty), ((torch.cat(ents) if ents else empty) if with_entropy else None)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous. megatron's mappings all-reduce
    `grad.contiguous()` and return `grad`: on a non-contiguous gradient (the transposed / indexed views below)
    the reduction would land in a temporary copy and be lost."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def response_hidden(hidden: torch.Tensor, index: ResponseIndex, *, sequence_parallel: bool, replicated_use: bool):
    """Hidden states [L(/tp), N, H] -> [n, H] at the valid response positions (index.hidden, in resp_mask order).

    replicated_use: the caller's computation on the result is the same on every tp rank (value head), so the
    gradient must not be summed over tp; otherwise (vocab-parallel logits) each rank's gradient is a partial
    sum and is all-reduced (after selecting the rows: n rows move, not L * N)."""
    from megatron.core.tensor_parallel import mappings

    if sequence_parallel:
        hidden = mappings.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=not replicated_use)
        hidden = _ContiguousGrad.apply(hidden)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index.hidden)  # [n, H]
    if not sequence_parallel and not replicated_use:
        h = mappings.copy_to_tensor_model_parallel_region(_ContiguousGrad.apply(h))
    return h


def scatter_rows(values: torch.Tensor, index: ResponseIndex) -> torch.Tensor:
    """[n] values at the valid response positions -> [B, R], zero elsewhere."""
    return index.scatter(values)
