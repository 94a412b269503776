"""Per-token log-probabilities and entropies, computed without a float32 [B, T, V] logits tensor.

For a 150k vocabulary, float32 logits of 16k tokens are ~10 GB, and autograd would keep them (plus the
softmax) for backward. ``logprobs_from_hidden`` instead projects ``chunk_size`` rows at a time and wraps
each chunk in activation checkpointing: backward keeps only the hidden chunk and recomputes that chunk's
logits, so peak memory is O(chunk_size * V) whatever N is, at the cost of one extra lm_head matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint as _checkpoint

from spmdrl.errors import SpmdrlError


def _entropy_from_logprobs(logp: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v; terms with p_v == 0 (including logits of -inf) count as 0, not NaN."""
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H(softmax(z)) = logsumexp(z) - sum_v softmax(z)_v z_v, computed in float32 as
    -sum_v p_v (z_v - logsumexp(z)). logits [..., V] -> [...]."""
    return _entropy_from_logprobs(torch.log_softmax(logits.float(), dim=-1))


def logprobs_from_logits(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> Tensor:
    """log p(y) = z_y - logsumexp(z), in float32. logits [..., V], labels [...] -> [...];
    0 where labels == ignore_index."""
    if logits.shape[:-1] != labels.shape:
        raise SpmdrlError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)}: need [..., V] and [...]"
        )
    return _gather_logp(torch.log_softmax(logits.float(), dim=-1), labels, ignore_index)


def _gather_logp(logp_all: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
    keep = labels != ignore_index
    safe = torch.where(keep, labels, torch.zeros_like(labels))
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, logp, torch.zeros_like(logp))


def truncate_logits(logits: Tensor, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """Top-k then top-p (nucleus) truncation of (temperature-scaled) logits [..., V], as vLLM 0.32 samples:
    the dropped tokens get -inf, so log_softmax of the result renormalises over the kept set.

    top-k (k >= 1): drop z_v < z_(k), the k-th largest logit (ties with it are kept).
    top-p (p < 1): with p_v = softmax(z) over the top-k survivors, sort ascending and drop every token whose
    cumulative probability (its own included) is <= 1 - p; the most likely token is always kept.
    Returns a new float32 tensor; top_k <= 0 (or >= V) and top_p >= 1 disable the respective step.
    """
    z = logits.float().clone()
    V = z.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        z_sorted, order = z.sort(dim=-1, descending=False)
        cum = torch.softmax(z_sorted, dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - top_p
        drop[..., -1] = False
        z = z.scatter(-1, order, z_sorted.masked_fill(drop, float("-inf")))
    return z


def _chunk(h: Tensor, w: Tensor, b: Tensor | None, labels: Tensor, inv_temp: float, ignore_index: int,
           with_entropy: bool, entropy_grad: bool, top_k: int = -1, top_p: float = 1.0) -> tuple[Tensor, ...]:
    logits = F.linear(h, w, b).float()  # matmul in the model dtype, softmax math in float32
    if inv_temp != 1.0:
        logits = logits * inv_temp
    if top_k > 0 or top_p < 1.0:
        logits = truncate_logits(logits, top_k, top_p)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = _gather_logp(logp_all, labels, ignore_index)
    if not with_entropy:
        return (logp,)
    if entropy_grad:
        return logp, _entropy_from_logprobs(logp_all)
    with torch.no_grad():  # a metric only: no [N, V] tensors kept for a backward that will never come
        return logp, _entropy_from_logprobs(logp_all.detach())


def logprobs_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    lm_head_bias: Tensor | None = None,
    ignore_index: int = -100,
    checkpoint: bool = True,
    top_k: int = -1,
    top_p: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """log p(y_n | h_n) and H(p(. | h_n)) with p = softmax(W h_n / temperature), chunked over N.

    With top_k > 0 or top_p < 1, p is the sampling distribution instead: softmax of
    truncate_logits(W h_n / temperature, top_k, top_p), renormalised over the kept tokens (what vLLM's
    processed log-probs are); a label outside the kept set gets -inf.

    hidden [N, H] (or [..., H]), lm_head_weight [V, H], labels [N] (or [...]) -> (logp [N], entropy [N]
    or None), float32, shaped like ``labels``. logp is 0 where labels == ignore_index. Differentiable in
    hidden, weight and bias (the entropy too unless ``entropy_grad`` is False: then it is computed under
    no_grad, for logging); with ``checkpoint`` each chunk's logits are recomputed in backward instead
    of being kept.
    """
    if temperature <= 0:
        raise SpmdrlError(f"temperature must be > 0, got {temperature}")
    if chunk_size <= 0:
        raise SpmdrlError(f"chunk_size must be > 0, got {chunk_size}")
    H = hidden.shape[-1]
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != H or hidden.shape[:-1] != labels.shape:
        raise SpmdrlError(
            f"need hidden [..., H], lm_head_weight [V, H], labels [...]; got hidden {tuple(hidden.shape)}, "
            f"weight {tuple(lm_head_weight.shape)}, labels {tuple(labels.shape)}"
        )
    out_shape = labels.shape
    h2, y = hidden.reshape(-1, H), labels.reshape(-1)
    use_ckpt = checkpoint and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, lm_head_weight, lm_head_bias)
    )

    def run(hc: Tensor, yc: Tensor) -> tuple[Tensor, ...]:
        return _chunk(hc, lm_head_weight, lm_head_bias, yc, 1.0 / temperature, ignore_index, with_entropy, entropy_grad,
                      top_k, top_p)

    logps, ents = [], []
    for s in range(0, h2.shape[0], chunk_size):
        hc, yc = h2[s : s + chunk_size], y[s : s + chunk_size]
        res = _checkpoint(run, hc, yc, use_reentrant=False) if use_ckpt else run(hc, yc)
        logps.append(res[0])
        if with_entropy:
            ents.append(res[1])
    empty = h2.new_zeros(0, dtype=torch.float32)
    logp = (torch.cat(logps) if logps else empty).reshape(out_shape)
    ent = (torch.cat(ents) if ents else empty).reshape(out_shape) if with_entropy else None
    return logp, ent
