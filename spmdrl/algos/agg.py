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


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mu) / sqrt(var + eps) over all valid elements (unbiased var); + mu back if not ``shift_mean``.

    Statistics are computed in float64 so that all-equal inputs whiten to exactly 0. Masked positions
    are 0 in the output. Shape of ``x`` is kept; dtype of ``x`` is kept.
    """
    xd = x.double()
    w = _weights(xd, mask)
    mu = masked_mean(xd, w)
    out = (xd - mu) * torch.rsqrt(masked_var(xd, w) + eps)
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

    ``norm`` defaults to mask.shape[-1]; pass a constant (the max response length) so that the scale
    does not depend on how a batch happens to be padded.
    """
    if norm is None:
        norm = max(mask.shape[-1], 1)
    elif norm <= 0:
        raise SpmdrlError(f"seq-mean-token-sum-norm needs norm > 0, got {norm}")
    return _seq_mean(masked_sum(loss_mat, mask, dim=-1) / norm, mask)


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
