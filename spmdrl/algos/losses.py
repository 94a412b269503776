"""Policy and value losses.

Every policy loss has one signature:

    fn(old_log_prob [B, T], log_prob [B, T], advantages [B, T], response_mask [B, T], *,
       clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
       loss_agg_norm=None, **_) -> (loss scalar, metrics {name: scalar Tensor})

rollout_is_weights [B, T] (optional, detached): the rollout-correction importance weights w_it
(spmdrl.algos.rollout_correction); every loss multiplies its per-token loss by them before aggregation,
L_it -> w_it L_it (GMPO, whose loss is per sequence, gets L_i * exp(mean_t log w_it), the geometric mean that
matches its geometric-mean ratio), and ignores them when None.

metrics: "pg_clipfrac" (fraction of valid tokens where the ratio clip is active), "ppo_kl" (every loss the
same: the mean over valid tokens of old_log_prob - log_prob, NOT clamped, the k1 estimate of KL(old || new)),
"pg_clipfrac_lower" (fraction where the dual clip is active). Masked positions never reach the loss or its
gradient, even if NaN.
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

# ppo, gspo, sapo, clip_cov, kl_cov and gmpo clamp the log-ratio to +-20 before exp: exp overflows float32 past
# about 88 nats, and an infinite ratio makes the gradient NaN even where the clipped branch is active (0 * inf in
# backward); past the clamp a token's ratio term has zero gradient (docs/algorithms.md, "Log-ratio clamp").
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


def _weigh(pg: Tensor, rollout_is_weights: Tensor | None) -> Tensor:
    """L_it * w_it with the rollout-correction importance weights (detached; spmdrl.algos.rollout_correction),
    or L unchanged without them."""
    if rollout_is_weights is None:
        return pg
    return pg * rollout_is_weights.detach().to(pg.dtype)


def _check_clip(low: float, high: float) -> None:
    """clip_ratio_low = 1 means no lower bound (the ratio is clipped at 1 - 1 = 0 from below)."""
    if not (0.0 <= low <= 1.0) or high < 0.0:
        raise ConfigError(f"need 0 <= clip_ratio_low <= 1 and clip_ratio_high >= 0, got low={low}, high={high}")


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
    rollout_is_weights: Tensor | None = None,
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
    loss = agg_loss(_weigh(pg, rollout_is_weights), response_mask, loss_agg_mode, norm=loss_agg_norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((l_clipped > l_unclipped).to(log_ratio.dtype), valid),
            "ppo_kl": masked_mean(-log_ratio, valid),
            "pg_clipfrac_lower": masked_mean((neg & (l1 > l_dual)).to(log_ratio.dtype), valid),
        }
    return loss, metrics


# GSPO and GMPO are sequence-level objectives: each response counts once whatever its length.
@POLICY_LOSSES.register("gspo", agg_mode="seq-mean-token-mean")
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
    rollout_is_weights: Tensor | None = None,
    **_,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025), token-level form.

    s_i   = exp(mean_{t valid} (logp_it - logp_old_it))                (sequence importance ratio)
    s_it  = sg[s_i] * exp(logp_it - sg[logp_it])                       (value s_i, gradient per token)
    L_it  = max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))
    loss  = mean over non-empty sequences of mean_t L_it   (always seq-mean-token-mean; the trainer
            rejects an explicit other actor.loss_agg_mode, and loss_agg_mode here is ignored)

    With A_it = A_i this has the same value and gradient as the sequence-level objective
    mean_i max(-A_i s_i, -A_i clip(s_i)). The paper's clip ranges are ~3e-4 / 4e-4, far below
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
    loss = agg_loss(_weigh(pg, rollout_is_weights), response_mask, "seq-mean-token-mean")
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



def resolve_agg_mode(policy_loss: str, configured: str) -> str:
    """The loss aggregation the update uses: ``configured`` ("auto": the policy loss's own, else token-mean).

    A loss that fixes its aggregation (``fn.agg_mode``: GSPO, GMPO) rejects an explicit other choice; a loss
    with a paper default (``fn.default_agg_mode``: SAPO) gets it under "auto" and accepts an explicit other.
    """
    fn = POLICY_LOSSES.get(policy_loss)
    fixed = getattr(fn, "agg_mode", None)
    if configured == "auto":
        return fixed or getattr(fn, "default_agg_mode", None) or "token-mean"
    if fixed is not None and configured != fixed:
        raise ConfigError(
            f"actor.policy_loss = {policy_loss!r} is a sequence-level objective (loss_agg_mode {fixed!r}); "
            f"actor.loss_agg_mode = {configured!r} conflicts with it: set actor.loss_agg_mode = \"auto\" or {fixed!r}"
        )
    return configured


def _ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _frac(flag: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    return masked_mean(flag.to(dtype), valid)


@POLICY_LOSSES.register("cispo")
def cispo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    loss_agg_norm: float | None = None,
    rollout_is_weights: Tensor | None = None,
    **_,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, section 3.1): clip the importance weight, never drop a token's
    gradient.

    d_it  = logp_it - logp_old_it,  r^_it = clip(exp(d_it), 1 - eps_low, 1 + eps_high)
    L_it  = -A_it * sg[r^_it] * exp(d_it - sg[d_it])    (value -A r^, gradient -sg[r^] A grad logp)
    loss  = agg(L, mask, loss_agg_mode)

    The gradient is the paper's sg(r^) A grad log pi for every token, at any log-ratio: those outside the
    clip range (PPO would zero them) and those with |d| > 20 too (no +-20 clamp anywhere: the clip bounds r^
    for any d, and d itself only enters as exp(d - sg[d]) = 1). The value is -A r^ (a
    ratio-weighted advantage like PPO's), not the paper's -sg(r^) A log pi: same gradient, a value comparable
    with the other losses. The paper sets no lower bound: clip_ratio_low = 1 (r^ = min(r, 1 + eps_high)).
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    valid, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(log_ratio)  # may be 0 or inf far off-policy; the clip bounds r^ (and low = 1 allows 0)
    clipped = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = -adv * clipped.detach() * torch.exp(log_ratio - log_ratio.detach())
    loss = agg_loss(_weigh(pg, rollout_is_weights), response_mask, loss_agg_mode, norm=loss_agg_norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _frac(ratio > 1.0 + clip_ratio_high, valid, log_ratio.dtype),
            "ppo_kl": masked_mean(-log_ratio, valid),
            "pg_clipfrac_lower": _frac(ratio < 1.0 - clip_ratio_low, valid, log_ratio.dtype),
        }
    return loss, metrics


# SAPO's paper objective averages each response's token mean (1/G sum_i 1/|y_i| sum_t): its "auto" default.
@POLICY_LOSSES.register("sapo", default_agg_mode="seq-mean-token-mean")
def sapo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    loss_agg_mode: str = "seq-mean-token-mean",
    loss_agg_norm: float | None = None,
    rollout_is_weights: Tensor | None = None,
    **_,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a soft, sign-dependent gate instead of a hard clip.

    r_it = exp(logp_it - logp_old_it),  tau_it = tau_pos if A_it > 0 else tau_neg
    f(r) = (4 / tau) * sigmoid(tau * (r - 1))      (f'(1) = 1: on-policy it is the plain policy gradient)
    L_it = -A_it * f(r_it),   loss = agg(L, mask, loss_agg_mode)

    The paper's objective is (1/G) sum_i (1/|y_i|) sum_t f(r_it) A_it, i.e. seq-mean-token-mean: that is this
    function's default and what actor.loss_agg_mode = "auto" resolves to (``sapo.default_agg_mode``); an
    explicit other mode is used as given. The gradient weight f'(r) = 4 sigmoid(tau (r-1)) (1 - sigmoid(tau
    (r-1))) decays smoothly as r leaves 1. metrics: pg_clipfrac is 0 (nothing is hard-clipped).
    """
    if sapo_tau_pos <= 0 or sapo_tau_neg <= 0:
        raise ConfigError(f"SAPO needs sapo_tau_pos > 0 and sapo_tau_neg > 0, got {sapo_tau_pos}, {sapo_tau_neg}")
    valid, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = _ratio(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, sapo_tau_pos), torch.full_like(adv, sapo_tau_neg))
    gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    pg = -adv * gate
    loss = agg_loss(_weigh(pg, rollout_is_weights), response_mask, loss_agg_mode, norm=loss_agg_norm)
    with torch.no_grad():
        zero = torch.zeros((), dtype=log_ratio.dtype, device=log_prob.device)
        metrics = {"pg_clipfrac": zero, "ppo_kl": masked_mean(-log_ratio, valid), "pg_clipfrac_lower": zero}
    return loss, metrics


def _covariance(adv: Tensor, log_prob: Tensor, valid: Tensor) -> Tensor:
    """cov_it = (A_it - mean(A)) (logp_it - mean(logp)), means over the valid tokens given (no grad)."""
    with torch.no_grad():
        lp = log_prob.detach().to(adv.dtype)
        return (adv - masked_mean(adv, valid)) * (lp - masked_mean(lp, valid))


@POLICY_LOSSES.register("clip_cov")
def clip_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    loss_agg_mode: str = "token-mean",
    loss_agg_norm: float | None = None,
    rollout_is_weights: Tensor | None = None,
    **_,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617).

    r_it  = exp(clamp(logp_it - logp_old_it, -20, 20))                           (LOG_RATIO_CLAMP)
    L1_it = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))                    (PPO, no dual clip)
    cov_it = (A_it - mean A) (logp_it - mean logp)   over the valid tokens of this call's rows
    C = valid tokens not clipped by L1 with clip_cov_lb < cov_it < clip_cov_ub; of C, the
        k = max(1, floor(clip_cov_ratio * #valid)) with the largest cov_it get no gradient:
    L_it = L1_it * (0 if it in the k else 1),   loss = agg(L, mask, loss_agg_mode)

    The paper (and verl) pick the k at random among C; this picks the k largest, so a step is a function of
    its inputs (a rerun or a resume repeats it exactly, with no RNG state in the loss). Defaults: ratio
    2e-4, bounds (1, 5), the authors' released recipe (recipe/dapo/7b_clip_cov.sh, also verl's defaults);
    that recipe runs with clip_ratio_low = clip_ratio_high = 1 (ratio clip (0, 2)). The covariance means are
    over the rows of one call (one micro-batch), as in the paper's code, so the selected tokens depend on
    the micro-batch split. metrics: pg_clipfrac = fraction of valid tokens detached by the covariance rule.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    if clip_cov_ratio <= 0 or clip_cov_lb >= clip_cov_ub:
        raise ConfigError(f"clip_cov needs clip_cov_ratio > 0 and clip_cov_lb < clip_cov_ub, got "
                          f"{clip_cov_ratio}, {clip_cov_lb}, {clip_cov_ub}")
    valid, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = _ratio(log_ratio)
    l_unclipped = -adv * ratio
    l_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    cov = _covariance(adv, log_prob, valid)
    cand = valid & ~(l_clipped > l_unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    k = min(max(1, int(clip_cov_ratio * int(valid.sum()))), int(cand.sum()))
    drop = torch.zeros_like(valid)
    if k > 0:
        score = torch.where(cand, cov, torch.full_like(cov, -float("inf"))).flatten()
        drop.view(-1)[torch.topk(score, k).indices] = True
    pg = torch.where(drop, torch.zeros_like(ratio), torch.maximum(l_unclipped, l_clipped))
    loss = agg_loss(_weigh(pg, rollout_is_weights), response_mask, loss_agg_mode, norm=loss_agg_norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _frac(drop, valid, log_ratio.dtype),
            "ppo_kl": masked_mean(-log_ratio, valid),
            "pg_clipfrac_lower": torch.zeros((), dtype=log_ratio.dtype, device=log_prob.device),
        }
    return loss, metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    kl_cov_ratio: float = 2e-3,
    kl_cov_coef: float = 1.0,
    loss_agg_mode: str = "token-mean",
    loss_agg_norm: float | None = None,
    rollout_is_weights: Tensor | None = None,
    **_,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): a KL penalty on the highest-covariance tokens only.

    cov_it = (A_it - mean A) (logp_it - mean logp)  over the valid tokens of this call's rows
    K = the k = max(1, floor(kl_cov_ratio * #valid)) valid tokens with the largest cov_it
    L_it = -A_it r_it + (kl_cov_coef * |logp_it - logp_old_it|  if it in K),   r = exp(clamp(logp - logp_old, +-20))
    loss = agg(L, mask, loss_agg_mode)

    No ratio clipping; K is the top-k, as in the paper and verl. Defaults: ratio 2e-3 and coefficient 1, the
    authors' Qwen2.5-7B recipe (recipe/dapo/7b_kl_cov.sh: k_percent = 0.2 %, ppo_kl_coef = 1; their 32B
    recipe uses 2e-4); verl's config defaults are 2e-4 and 0.1. Covariance statistics are per call
    (micro-batch), as in the paper's code. metrics: pg_clipfrac = fraction of valid tokens in K; ppo_kl is
    the signed k1 mean like every loss (verl logs the mean |logp - logp_old| for KL-Cov).
    """
    if kl_cov_ratio <= 0 or kl_cov_coef < 0:
        raise ConfigError(f"kl_cov needs kl_cov_ratio > 0 and kl_cov_coef >= 0, got {kl_cov_ratio}, {kl_cov_coef}")
    valid, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages, response_mask)
    ratio = _ratio(log_ratio)
    cov = _covariance(adv, log_prob, valid)
    n_valid = int(valid.sum())
    pick = torch.zeros_like(valid)
    if n_valid:
        k = max(1, int(kl_cov_ratio * n_valid))
        score = torch.where(valid, cov, torch.full_like(cov, -float("inf"))).flatten()
        pick.view(-1)[torch.topk(score, k).indices] = True
    pg = -adv * ratio + torch.where(pick, kl_cov_coef * log_ratio.abs(), torch.zeros_like(ratio))
    loss = agg_loss(_weigh(pg, rollout_is_weights), response_mask, loss_agg_mode, norm=loss_agg_norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _frac(pick, valid, log_ratio.dtype),
            "ppo_kl": masked_mean(-log_ratio, valid),
            "pg_clipfrac_lower": torch.zeros((), dtype=log_ratio.dtype, device=log_prob.device),
        }
    return loss, metrics


@POLICY_LOSSES.register("gmpo", "geo_mean", agg_mode="seq-mean-token-mean")
def gmpo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: Tensor | None = None,
    **_,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): maximise the geometric mean of the token ratios.

    d_it  = logp_it - logp_old_it;  c_it = clip(d_it, -eps_low, eps_high)    (clip in LOG space)
    A_i   = mean_t A_it  (the response's advantage; with outcome estimators every token already carries it)
    d~_it = min(d_it, c_it) if A_i > 0,  max(d_it, c_it) if A_i < 0,  d_it if A_i == 0   (pessimistic)
    rho_i = exp(clamp(mean_t d~_it, +-20)),  L_i = -A_i rho_i * exp(mean_t log w_it)   (w: rollout IS weights, else 1)
    loss  = mean over non-empty sequences of L_i   (always sequence-level: agg_mode seq-mean-token-mean)

    The clip direction follows the sign of A_i, the advantage that multiplies rho_i, so the clipped
    objective is a pessimistic bound whatever the advantage layout; a token whose own A_it is 0 (or of the
    other sign, with token-level advantages) is clipped like the rest of its response. A response with
    A_i == 0 has loss 0 and gradient 0. Responses with no valid token do not count in the mean. The rollout
    weights enter through their geometric mean, so L_i is -A_i times the geometric mean of rho_it * w_it.
    eps_low / eps_high are actor.clip_ratio_low / clip_ratio_high read as log-ratio bounds (the paper uses
    0.4, i.e. ratios in (e^-0.4, e^0.4)). pg_clipfrac / pg_clipfrac_lower: fraction of valid tokens whose
    log-ratio was clipped in a response with A_i > 0 / A_i < 0.
    """
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ConfigError(f"gmpo needs clip_ratio_low, clip_ratio_high >= 0, got {clip_ratio_low}, {clip_ratio_high}")
    valid, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages, response_mask)
    a_seq = masked_mean(adv, valid, dim=-1, keepdim=True)  # [B, 1]
    c = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    d = torch.where(a_seq > 0, torch.minimum(log_ratio, c), torch.where(a_seq < 0, torch.maximum(log_ratio, c), log_ratio))
    rho = torch.exp(masked_mean(d, valid, dim=-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    pg = -a_seq * rho
    if rollout_is_weights is not None:
        w = rollout_is_weights.detach().to(log_ratio.dtype).clamp_min(torch.finfo(log_ratio.dtype).tiny)
        pg = pg * torch.exp(masked_mean(torch.log(w), valid, dim=-1, keepdim=True))
    loss = agg_loss(pg.expand_as(log_ratio), response_mask, "seq-mean-token-mean")
    with torch.no_grad():
        clipped = valid & (c != log_ratio)
        metrics = {
            "pg_clipfrac": _frac(clipped & (a_seq > 0), valid, log_ratio.dtype),
            "ppo_kl": masked_mean(-log_ratio, valid),
            "pg_clipfrac_lower": _frac(clipped & (a_seq < 0), valid, log_ratio.dtype),
        }
    return loss, metrics



@POLICY_LOSSES.register("gpg")
def gpg_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    loss_agg_norm: float | None = None,
    rollout_is_weights: Tensor | None = None,
    **_,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025, arXiv 2504.02546): the plain policy gradient, no ratio, no clip.

    L_it = -A_it logp_it,   loss = agg(L, mask, loss_agg_mode)
    Pair with ``algorithm.adv_estimator = "gpg"``. metrics: clip fractions are 0.
    """
    valid, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages, response_mask)
    lp = torch.where(valid, log_prob.to(log_ratio.dtype), torch.zeros_like(log_ratio))
    loss = agg_loss(_weigh(-adv * lp, rollout_is_weights), response_mask, loss_agg_mode, norm=loss_agg_norm)
    with torch.no_grad():
        zero = torch.zeros((), dtype=log_ratio.dtype, device=log_prob.device)
        metrics = {"pg_clipfrac": zero, "ppo_kl": masked_mean(-log_ratio, valid), "pg_clipfrac_lower": zero}
    return loss, metrics
