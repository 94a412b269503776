"""Per-token log-probabilities and entropies, computed without a float32 [B, T, V] logits tensor.

For a 150k vocabulary, float32 logits of 16k tokens are ~10 GB, and autograd would keep them (plus the
softmax) for backward. ``logprobs_from_hidden`` instead projects ``chunk_size`` rows at a time. Under autograd
(no top-k / top-p truncation) it runs ``LinearLogprob``: a custom autograd function whose forward keeps, per
token, only the log-sum-exp and the results, and whose backward recomputes each chunk's logits once and writes
the gradient of log p(y) and H straight into that buffer (d log p_y / dz = onehot(y) - p, dH / dz = -p (log p +
H)), so a chunk costs two float32 [chunk, V] buffers in forward and in backward (plus the gradient's copy in the
weight's dtype when that is bf16), instead of the logits, log-softmax, probabilities and their gradients that
autograd through log_softmax, gather and the entropy would keep. The projection matmuls run in the weight's
dtype (bf16 under mixed precision), the softmax math in float32. Total matmul work: forward, recompute, and the
two gradient matmuls, as with activation checkpointing.
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


def logprobs_from_model_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0, top_k: int = -1,
                               top_p: float = 1.0, with_entropy=False) -> tuple[Tensor, Tensor | None]:
    """(log p(y), H(p) or None) for logits [N, V] a model's own head produced, labels [N], with
    p = softmax(truncate(z / temperature)): the same quantity as logprobs_from_hidden, from whole logits.
    with_entropy "detached": the entropy without autograd (a metric)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if top_k > 0 or top_p < 1.0:
        z = truncate_logits(z, top_k, top_p)
    logp_all = torch.log_softmax(z, dim=-1)
    logp = _gather_logp(logp_all, labels, -100)
    if not with_entropy:
        return logp, None
    if with_entropy == "detached":
        with torch.no_grad():
            return logp, _entropy_from_logprobs(logp_all.detach())
    return logp, _entropy_from_logprobs(logp_all)


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


def soft_cap(logits: Tensor, cap: float | None) -> Tensor:
    """Final-logit soft-capping (Gemma 2 style): cap * tanh(z / cap); z unchanged when cap is None or 0."""
    return torch.tanh(logits / cap) * cap if cap else logits


def _chunk(h: Tensor, w: Tensor, b: Tensor | None, labels: Tensor, inv_temp: float, ignore_index: int,
           with_entropy: bool, entropy_grad: bool, top_k: int = -1, top_p: float = 1.0,
           softcap: float | None = None) -> tuple[Tensor, ...]:
    logits = soft_cap(F.linear(h, w, b).float(), softcap)  # matmul in the model dtype, softmax math in float32
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
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(y_n | h_n) and H(p(. | h_n)) with p = softmax(W h_n / temperature), chunked over N; with softcap
    (a model's final-logit soft-capping) the logits are softcap * tanh(W h_n / softcap) before the temperature.

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
                      top_k, top_p, softcap)

    if use_ckpt and top_k <= 0 and top_p >= 1.0:  # the training path: analytic backward, one recompute per chunk
        logp, ent = LinearLogprob.apply(h2, lm_head_weight, lm_head_bias, y, 1.0 / temperature, ignore_index,
                                        with_entropy, entropy_grad, chunk_size, softcap)
        return logp.reshape(out_shape), (ent.reshape(out_shape) if with_entropy else None)
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


class LinearLogprob(torch.autograd.Function):
    """(log p(y_n), H_n) with p = softmax((W h_n + b) * inv_temp), chunked over n, with an analytic backward.

    forward(h [N, H], w [V, H], b [V] or None, labels [N], inv_temp, ignore_index, with_entropy, entropy_grad,
    chunk_size) -> (logp [N], entropy [N] (zeros without with_entropy)), float32. Saved for backward: h, w, b,
    labels and three float32 [N] vectors; never a [N, V] tensor. The entropy's gradient flows only with
    entropy_grad (otherwise it is a metric). Labels equal to ignore_index give logp 0 and no gradient.
    """

    @staticmethod
    def forward(ctx, h, w, b, labels, inv_temp, ignore_index, with_entropy, entropy_grad, chunk_size, softcap=None):
        n = h.shape[0]
        logp = torch.zeros(n, dtype=torch.float32, device=h.device)
        ent = torch.zeros(n, dtype=torch.float32, device=h.device)
        lse = torch.zeros(n, dtype=torch.float32, device=h.device)
        keep = labels != ignore_index
        safe = torch.where(keep, labels, torch.zeros_like(labels))
        for s in range(0, n, chunk_size):
            z = soft_cap(F.linear(h[s: s + chunk_size], w, b).float(), softcap)
            if inv_temp != 1.0:
                z.mul_(inv_temp)
            m = z.logsumexp(-1)
            lse[s: s + chunk_size] = m
            z.sub_(m[:, None])  # log p, in the logits' buffer
            logp[s: s + chunk_size] = z.gather(-1, safe[s: s + chunk_size, None]).squeeze(-1)
            if with_entropy:  # H = -sum_v p_v log p_v (finite logits: no truncation on this path)
                ent[s: s + chunk_size] = -z.exp().mul_(z).sum(-1)
            del z
        logp = torch.where(keep, logp, torch.zeros_like(logp))
        ctx.save_for_backward(h, w, b, safe, keep, lse, ent)
        ctx.args = (inv_temp, with_entropy and entropy_grad, chunk_size, softcap)
        ctx.set_materialize_grads(False)  # an output nobody differentiates comes back as None, not zeros
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, w, b, labels, keep, lse, ent = ctx.saved_tensors
        inv_temp, ent_grad, chunk_size, softcap = ctx.args
        g_logp = torch.where(keep, g_logp, torch.zeros_like(g_logp)) if g_logp is not None else torch.zeros_like(lse)
        use_ent = ent_grad and g_ent is not None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = torch.zeros_like(h) if need_h else None
        dw = torch.zeros_like(w) if need_w else None  # accumulated like autograd's, in the weight's dtype
        db = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if need_b and b is not None else None
        for s in range(0, h.shape[0], chunk_size):
            hc, sl = h[s: s + chunk_size], slice(s, s + chunk_size)
            logp_all = F.linear(hc, w, b).float()
            if softcap:  # z = cap tanh(raw / cap): keep tanh for dz/draw = 1 - tanh^2
                tanh = logp_all.div_(softcap).tanh_()
                logp_all = tanh * softcap
            if inv_temp != 1.0:
                logp_all.mul_(inv_temp)
            logp_all.sub_(lse[sl, None])
            # dL/dz = g_logp (onehot(y) - p) + g_ent (-p (log p + H)), times inv_temp for z = inv_temp * (W h + b)
            if use_ent:
                p = logp_all.exp()
                gz = logp_all.add_(ent[sl, None]).mul_(p).mul_(-g_ent[sl, None])  # in the logits' buffer
                gz.sub_(p.mul_(g_logp[sl, None]))
                del p
            else:
                gz = logp_all.exp_().mul_(-g_logp[sl, None])
            gz.scatter_add_(-1, labels[sl, None], g_logp[sl, None])
            if inv_temp != 1.0:
                gz.mul_(inv_temp)
            if softcap:
                gz.mul_(tanh.square_().neg_().add_(1.0))
                del tanh
            gz = gz.to(w.dtype)
            if need_h:
                dh[sl] = gz @ w
            if need_w:
                dw.addmm_(gz.t(), hc.to(w.dtype))
            if db is not None:
                db += gz.float().sum(0)
        return dh, dw, (db.to(b.dtype) if db is not None else None), None, None, None, None, None, None, None
