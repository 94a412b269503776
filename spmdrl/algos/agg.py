"""Masked reductions and loss aggregation.

Every function here treats positions where ``mask == 0`` as absent: their values never reach the result,
not even as NaN or inf (a masked NaN gives neither a NaN result nor a NaN gradient). Empty reductions
return 0, never NaN. ``mask`` may be bool or numeric; numeric masks act as weights.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from spmdrl.errors import SpmdrlError
from spmdrl.registry import Registry

AggFn = Callable[..., Tensor]
LOSS_AGG: Registry[AggFn] = Registry("loss_agg_mode")


def _weights(x: Tensor, mask: Tensor) -> Tensor:
    if mask.shape != x.shape:
        try:
            mask = mask.expand_as(x)
        except RuntimeError:
            raise SpmdrlError(
                f"mask of shape {tuple(mask.shape)} does not match values of shape {tuple(x.shape)}"
            ) from None
    return mask.to(x.dtype)


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, 0 where den == 0 (and a zero, not NaN, gradient there)."""
    ok = den != 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """sum(x * m) over ``dim`` (all elements if None). x, mask: same shape (mask may broadcast)."""
    w = _weights(x, mask)
    y = torch.where(w != 0, x * w, torch.zeros((), dtype=x.dtype, device=x.device))
    return y.sum() if dim is None else y.sum(dim, keepdim=keepdim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """sum(x * m) / sum(m) over ``dim``; 0 where sum(m) == 0."""
    w = _weights(x, mask)
    den = w.sum() if dim is None else w.sum(dim, keepdim=keepdim)
    return _safe_div(masked_sum(x, w, dim, keepdim), den)


def masked_var(x: Tensor, mask: Tensor, dim: int | None = None, unbiased: bool = True) -> Tensor:
    """Masked variance: sum(m * (x - mu)^2) / (n - 1) (``unbiased``) or / n, with mu = masked_mean, n = sum(m).

    Returns 0 where the denominator is <= 0 (a single valid element with ``unbiased``, or none).
    """
    w = _weights(x, mask)
    mu = masked_mean(x, w, dim, keepdim=dim is not None)
    sq = masked_sum((x - mu) ** 2, w, dim)
    n = w.sum() if dim is None else w.sum(dim)
    den = n - 1 if unbiased else n
    return _safe_div(sq, den.clamp_min(0))


Reduce = Callable[[Tensor], Tensor]
"""Sums a float64 statistics vector over the ranks that share a batch (an all-reduce over the actor's
data-parallel group, one rank per tensor-parallel group) and returns it; None means this rank holds the
whole batch."""


def masked_moments(x: Tensor, mask: Tensor, reduce: Reduce | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(n, mean, M2) of the valid elements of ``x`` over the whole batch, float64 scalars.

    M2 = sum_j m_j (x_j - mean)^2. Each rank sends [n_r, s_r, M2_r, n_r mu_r^2] (mu_r its local mean, M2_r
    about mu_r) in ONE ``reduce``; then mean = sum s_r / n and M2 = sum M2_r + (sum n_r mu_r^2 - n mean^2)
    (Chan et al.'s pairwise combination). With a single rank the second term is exactly 0, so the result
    equals the plain two-pass computation bit for bit.
    """
    xd = x.double()
    w = _weights(xd, mask)
    n_r = w.sum()
    mu_r = masked_mean(xd, w)
    m2_r = masked_sum((xd - mu_r) ** 2, w)
    stats = torch.stack([n_r, n_r * mu_r, m2_r, n_r * mu_r * mu_r])
    if reduce is not None:
        stats = reduce(stats).to(device=x.device, dtype=torch.float64)
    n, s, m2, between = stats.unbind()
    mean = _safe_div(s, n)
    return n, mean, m2 + (between - n * mean * mean).clamp_min(0)


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, *, reduce: Reduce | None = None
) -> Tensor:
    """(x - mu) / sqrt(var + eps) over all valid elements (unbiased var); + mu back if not ``shift_mean``.

    mu and var are the statistics of the whole batch: with ``reduce`` (see ``Reduce``) every rank's valid
    elements count, through one all-reduce of 4 numbers (``masked_moments``); without it, this rank's.
    Statistics are computed in float64 so that all-equal inputs whiten to exactly 0. Masked positions
    are 0 in the output. Shape of ``x`` is kept; dtype of ``x`` is kept.
    """
    xd = x.double()
    w = _weights(xd, mask)
    n, mu, m2 = masked_moments(xd, w, reduce)
    var = _safe_div(m2, (n - 1).clamp_min(0))
    out = (xd - mu) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mu
    return torch.where(w != 0, out, torch.zeros_like(out)).to(x.dtype)


def _seq_mean(per_seq: Tensor, mask: Tensor) -> Tensor:
    """Mean of per-sequence values over sequences with at least one valid token; 0 if there are none."""
    return masked_mean(per_seq, (mask != 0).any(-1))


@LOSS_AGG.register("token-mean")
def token_mean(loss_mat: Tensor, mask: Tensor, **_) -> Tensor:
    """sum_{i,t} m_it l_it / sum_{i,t} m_it: every valid token weighs the same (DAPO)."""
    return masked_mean(loss_mat, mask)


@LOSS_AGG.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, **_) -> Tensor:
    """mean_i sum_t m_it l_it over non-empty sequences i."""
    return _seq_mean(masked_sum(loss_mat, mask, dim=-1), mask)


@LOSS_AGG.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, **_) -> Tensor:
    """mean_i (sum_t m_it l_it / sum_t m_it) over non-empty sequences i (original GRPO)."""
    return _seq_mean(masked_mean(loss_mat, mask, dim=-1), mask)


@LOSS_AGG.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, *, norm: float | None = None, **_) -> Tensor:
    """mean_i (sum_t m_it l_it / norm) over non-empty sequences i (Dr. GRPO).

    ``norm`` is required and must be a constant of the run (the trainer passes ``actor.loss_agg_norm``,
    default data.max_response_length): a norm taken from the padded width of each micro-batch would
    weigh micro-batches of short answers more and bring back the length bias Dr. GRPO removes.
    """
    if norm is None:
        raise SpmdrlError("seq-mean-token-sum-norm needs a constant norm (e.g. the max response length); got None")
    if norm <= 0:
        raise SpmdrlError(f"seq-mean-token-sum-norm needs norm > 0, got {norm}")
    return _seq_mean(masked_sum(loss_mat, mask, dim=-1) / norm, mask)


def agg_units(mask: Tensor, mode: str) -> Tensor:
    """What ``mode`` averages over, counted in ``mask`` [B, T]: valid tokens for token-mean, non-empty
    sequences for the seq-mean modes (float64 scalar). The update weighs each micro-batch by its share of
    the mini-batch's global count, so that the sum over micro-batches and ranks is the whole-batch loss."""
    m = mask != 0
    return (m.sum() if mode == "token-mean" else m.any(-1).sum()).double()


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", *, norm: float | None = None) -> Tensor:
    """Reduce a per-token loss ``loss_mat`` [B, T] under ``mask`` [B, T] to a scalar with ``mode``.

    The reduction is over the rows given (one micro-batch on one rank); scaling across micro-batches and
    data-parallel ranks is the trainer's job. ``norm`` only affects "seq-mean-token-sum-norm".
    """
    if loss_mat.shape != mask.shape:
        raise SpmdrlError(
            f"agg_loss: loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} differ in shape"
        )
    return LOSS_AGG.get(mode)(loss_mat, mask, norm=norm)
