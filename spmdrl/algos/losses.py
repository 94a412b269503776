"""Policy and value losses.

Every policy loss has one signature:

    fn(old_log_prob [B, T], log_prob [B, T], advantages [B, T], response_mask [B, T], *,
       clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
       loss_agg_norm=None, **_) -> (loss scalar, metrics {name: scalar Tensor})

metrics: "pg_clipfrac" (fraction of valid tokens where the ratio clip is active), "ppo_kl"
(mean_t of old_log_prob - log_prob, the k1 estimate of KL(old || new)), "pg_clipfrac_lower" (fraction
where the dual clip is active). Masked positions never reach the loss or its gradient, even if NaN.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from spmdrl.algos.agg import agg_loss, masked_mean
from spmdrl.errors import ConfigError, SpmdrlError
from spmdrl.registry import Registry

LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: Registry[LossFn] = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0


def _prepare(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor):
    """Shape-check; return (valid, log_ratio, advantages) with masked positions set to 0 before any math."""
    shapes = {t.shape for t in (old_log_prob, log_prob, advantages, response_mask)}
    if len(shapes) != 1 or log_prob.dim() != 2:
        raise SpmdrlError(
            "old_log_prob, log_prob, advantages, response_mask must all be [B, T]; got "
            f"{[tuple(t.shape) for t in (old_log_prob, log_prob, advantages, response_mask)]}"
        )
    valid = response_mask != 0
    dtype = torch.promote_types(log_prob.dtype, torch.float32)  # never do the ratio math in bf16
    zero = torch.zeros((), dtype=dtype, device=log_prob.device)
    log_ratio = torch.where(valid, log_prob.to(dtype) - old_log_prob.detach().to(dtype), zero)
    adv = torch.where(valid, advantages.detach().to(dtype), zero)
    return valid, log_ratio, adv


def _check_clip(low: float, high: float) -> None:
    if not (0.0 <= low < 1.0) or high < 0.0:
        raise ConfigError(f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got low={low}, high={high}")


@POLICY_LOSSES.register("ppo", "vanilla")
def ppo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    loss_agg_norm: float | None = None,
    **_,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate with asymmetric clip (DAPO clip-higher) and dual clip (Ye et al. 2020).

    rho = exp(clamp(logp - logp_old, -20, 20))
    L1 = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))
    L  = min(L1, -c A)  where A < 0  (dual clip, c = clip_ratio_c > 1),  L1 elsewhere
    loss = agg(L, mask, loss_agg_mode)
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    if clip_ratio_c <= 1.0:
        raise ConfigError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    valid, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    l_unclipped = -adv * ratio
    l_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    l1 = torch.maximum(l_unclipped, l_clipped)
    l_dual = -adv * clip_ratio_c
    neg = adv < 0
    pg = torch.where(neg, torch.minimum(l1, l_dual), l1)
    loss = agg_loss(pg, response_mask, loss_agg_mode, norm=loss_agg_norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((l_clipped > l_unclipped).to(log_ratio.dtype), valid),
            "ppo_kl": masked_mean(-log_ratio, valid),
            "pg_clipfrac_lower": masked_mean((neg & (l1 > l_dual)).to(log_ratio.dtype), valid),
        }
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "seq-mean-token-mean",
    loss_agg_norm: float | None = None,
    **_,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025), token-level form.

    s_i   = exp(mean_{t valid} (logp_it - logp_old_it))                (sequence importance ratio)
    s_it  = sg[s_i] * exp(logp_it - sg[logp_it])                       (value s_i, gradient per token)
    L_it  = max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))
    loss  = agg(L, mask, loss_agg_mode)   (default seq-mean-token-mean)

    With A_it = A_i and seq-mean-token-mean this has the same value and gradient as the sequence-level
    objective mean_i max(-A_i s_i, -A_i clip(s_i)). The paper's clip ranges are ~3e-4 / 4e-4, far below
    PPO's; set them in config. No dual clip: pg_clipfrac_lower is 0.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    valid, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages, response_mask)
    seq_log_ratio = masked_mean(log_ratio, valid, dim=-1, keepdim=True)  # [B, 1]
    lp = log_prob.to(log_ratio.dtype)
    log_s = seq_log_ratio.detach() + lp - lp.detach()
    log_s = torch.where(valid, log_s, torch.zeros_like(log_s))
    ratio = torch.exp(log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    l_unclipped = -adv * ratio
    l_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(l_unclipped, l_clipped)
    loss = agg_loss(pg, response_mask, loss_agg_mode, norm=loss_agg_norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((l_clipped > l_unclipped).to(log_ratio.dtype), valid),
            "ppo_kl": masked_mean(-log_ratio, valid),
            "pg_clipfrac_lower": torch.zeros((), dtype=log_ratio.dtype, device=log_prob.device),
        }
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    loss_agg_norm: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO2). All tensors [B, T].

    V_clip = V_old + clip(V - V_old, -c, c)
    L      = 0.5 * max((V - R)^2, (V_clip - R)^2)
    loss   = agg(L, mask, loss_agg_mode); metrics["vf_clipfrac"] = fraction of valid tokens where the
    clipped term is the larger.
    """
    shapes = {t.shape for t in (values, old_values, returns, response_mask)}
    if len(shapes) != 1:
        raise SpmdrlError(
            "values, old_values, returns, response_mask must share one shape; got "
            f"{[tuple(t.shape) for t in (values, old_values, returns, response_mask)]}"
        )
    if cliprange_value < 0:
        raise ConfigError(f"cliprange_value must be >= 0, got {cliprange_value}")
    valid = response_mask != 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(valid, values, zero)
    v_old = torch.where(valid, old_values.detach().to(v.dtype), zero)
    r = torch.where(valid, returns.detach().to(v.dtype), zero)
    v_clip = v_old + (v - v_old).clamp(-cliprange_value, cliprange_value)
    l1 = (v - r) ** 2
    l2 = (v_clip - r) ** 2
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), response_mask, loss_agg_mode, norm=loss_agg_norm)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((l2 > l1).to(v.dtype), valid)}
    return loss, metrics
