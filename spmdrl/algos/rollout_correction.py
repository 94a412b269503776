"""Rollout correction: importance weights and rejection masks between the policy that sampled the tokens
(the rollout engine, pi_rollout: its processed log-probs) and the actor's old policy pi_old (the actor's
log-probs of the same tokens, computed after the weight sync), as verl's `algorithm.rollout_correction`.

Per valid token t of response i (padding contributes nothing anywhere):

    log r_it = log pi_old(y_it) - log pi_rollout(y_it)

A *level* turns the token log-ratios into the log-ratio each token is judged by (LEVELS):

    token:      l_it = log r_it
    sequence:   l_it = sum_t' log r_it'          (log of the product of the sequence's token ratios)
    geometric:  l_it = mean_t' log r_it'         (log of their geometric mean)

Importance sampling (rollout_is = token | sequence; truncation cap C = rollout_is_threshold):

    w_it = exp(min(l_it, log C)) = min(r, C),   computed in log space (no overflow for long sequences)

w is detached and multiplies the per-token policy loss (spmdrl.algos.losses). Rejection sampling
(rollout_rs = token | sequence | geometric; bounds [L, U] = [rollout_rs_threshold_lower,
rollout_rs_threshold]; L defaults to 1 / U):

    keep_it = L <= exp(l_it) <= U          (a sequence level keeps or drops the whole response)

and, with rollout_token_veto_threshold = v > 0, response i is dropped when any r_it < v. Dropped tokens leave
the response mask, so they leave the loss and its normalisation (token counts, non-empty responses).

Every statistic is over the global batch: `reduce` sums a float64 vector over the data-parallel ranks and
`reduce_max` takes its elementwise maximum (None: the rows given are the whole batch), so the metrics do not
depend on the layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from spmdrl.errors import SpmdrlError
from spmdrl.registry import Registry

LevelFn = Callable[[Tensor, Tensor], Tensor]
LEVELS: Registry[LevelFn] = Registry("rollout correction level")
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
LOG_BOUND = 20.0  # exp(+-20): ratios beyond it are treated as exp(+-20) (the sum of a long sequence can be huge)

Reduce = Callable[[Tensor], Tensor]


@LEVELS.register("token")
def token_level(log_ratio: Tensor, valid: Tensor) -> Tensor:
    """l_it = log r_it."""
    return torch.where(valid, log_ratio, torch.zeros_like(log_ratio))


@LEVELS.register("sequence")
def sequence_level(log_ratio: Tensor, valid: Tensor) -> Tensor:
    """l_it = sum over the valid tokens of response i of log r (the log of the product of its ratios)."""
    s = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(-1, keepdim=True)
    return s.expand_as(log_ratio)


@LEVELS.register("geometric")
def geometric_level(log_ratio: Tensor, valid: Tensor) -> Tensor:
    """l_it = mean over the valid tokens of response i of log r (the log of the geometric mean ratio)."""
    lr = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
    n = valid.sum(-1, keepdim=True).clamp(min=1)
    return (lr.sum(-1, keepdim=True) / n).expand_as(log_ratio)


@dataclass
class Correction:
    """What the update uses: the importance weights (None when they stay out of the loss), the response mask
    after rejection, and the metrics (global, the same on every rank)."""

    weights: Tensor | None
    response_mask: Tensor
    metrics: dict[str, float]


def rollout_correction(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str = "none",
    rollout_is_threshold: float = 2.0,
    rollout_is_in_loss: bool = True,
    rollout_rs: str = "none",
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_lower: float | None = None,
    rollout_token_veto_threshold: float = 0.0,
    reduce: Reduce | None = None,
    reduce_max: Reduce | None = None,
) -> Correction:
    """Importance weights, rejection mask and mismatch metrics for one batch [B, T] (see the module docstring).

    Metrics (prefix rollout_corr/):
      kl          mean over valid tokens of log pi_rollout - log pi_old (k1 estimate of KL(rollout || old),
                  the tokens being samples of pi_rollout)
      k3_kl       mean of r - 1 - log r (k3 estimate of the same KL; >= 0)
      chi2_token  mean of r^2, minus 1
      training_ppl, rollout_ppl   mean over non-empty responses of exp(-mean_t log pi) for pi_old / pi_rollout
      rollout_is_mean | std | max | min   of the untruncated ratio exp(l) at the IS level, over its units
                  (valid tokens for token, non-empty responses for sequence); ratios bounded to exp(+-20)
      rollout_is_truncated_fraction   fraction of those units with ratio > C (their weight is C)
      rollout_is_weight_mean          mean of the weights w (after truncation) over valid tokens
      rollout_rs_masked_fraction      fraction of valid tokens dropped by rejection and veto
      rollout_rs_seq_masked_fraction  fraction of non-empty responses with at least one dropped token
      rollout_rs_veto_fraction        fraction of non-empty responses dropped by the veto
    """
    shapes = {t.shape for t in (old_log_prob, rollout_log_prob, response_mask)}
    if len(shapes) != 1 or old_log_prob.dim() != 2:
        raise SpmdrlError(f"old_log_prob, rollout_log_prob, response_mask must all be [B, T]; got "
                          f"{[tuple(t.shape) for t in (old_log_prob, rollout_log_prob, response_mask)]}")
    if rollout_is not in ("none", *IS_LEVELS):
        raise SpmdrlError(f"rollout_is = {rollout_is!r}: use none, {', '.join(IS_LEVELS)}")
    if rollout_rs not in ("none", *RS_LEVELS):
        raise SpmdrlError(f"rollout_rs = {rollout_rs!r}: use none, {', '.join(RS_LEVELS)}")
    if rollout_is_threshold <= 0 or rollout_rs_threshold <= 0:
        raise SpmdrlError(f"rollout_is_threshold = {rollout_is_threshold} and rollout_rs_threshold = "
                          f"{rollout_rs_threshold} must be > 0")
    f64 = torch.float64
    valid = response_mask != 0
    zero = torch.zeros((), dtype=f64, device=old_log_prob.device)
    old = torch.where(valid, old_log_prob.detach().to(f64), zero)
    roll = torch.where(valid, rollout_log_prob.detach().to(f64), zero)
    log_ratio = old - roll
    ratio = torch.exp(log_ratio.clamp(-LOG_BOUND, LOG_BOUND))
    seq_len = valid.sum(-1)
    nonempty = seq_len > 0
    n = seq_len.clamp(min=1).to(f64)
    vf = valid.to(f64)

    sums = {
        "tokens": vf.sum(), "seqs": nonempty.to(f64).sum(),
        "kl": (-log_ratio * vf).sum(), "k3": ((ratio - 1 - log_ratio) * vf).sum(), "r2": (ratio**2 * vf).sum(),
        "ppl_old": (torch.exp(-old.sum(-1) / n) * nonempty).sum(),
        "ppl_roll": (torch.exp(-roll.sum(-1) / n) * nonempty).sum(),
    }
    peaks = {}  # reduced by max; a min is the max of the negation
    weights = None
    if rollout_is != "none":
        level = LEVELS.get(rollout_is)(log_ratio, valid).clamp(-LOG_BOUND, LOG_BOUND)
        first = torch.arange(valid.shape[1], device=valid.device)[None] == 0
        unit = valid if rollout_is == "token" else valid & first & nonempty[:, None]  # one unit per non-empty response
        uf = unit.to(f64)
        r = torch.exp(level)
        log_c = math.log(rollout_is_threshold)
        w = torch.exp(level.clamp(max=log_c)) * vf
        sums.update(is_units=uf.sum(), is_sum=(r * uf).sum(), is_sq=(r**2 * uf).sum(),
                    is_trunc=((level > log_c).to(f64) * uf).sum(), is_w=w.sum())
        floor = torch.full((1,), -math.inf, dtype=f64, device=r.device)  # the max of no units
        peaks.update(is_max=torch.cat([torch.where(unit, r, -math.inf).flatten(), floor]).max(),
                     is_negmin=torch.cat([torch.where(unit, -r, -math.inf).flatten(), floor]).max())
        if rollout_is_in_loss:
            weights = w.to(old_log_prob.dtype if old_log_prob.is_floating_point() else torch.float32)
    keep = valid
    if rollout_rs != "none" or rollout_token_veto_threshold > 0:
        if rollout_rs != "none":
            upper = rollout_rs_threshold
            lower = 1.0 / upper if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower
            level = LEVELS.get(rollout_rs)(log_ratio, valid)
            log_lo = math.log(lower) if lower > 0 else -math.inf
            keep = keep & (level >= log_lo) & (level <= math.log(upper))
        veto = torch.zeros_like(nonempty)
        if rollout_token_veto_threshold > 0:
            veto = (valid & (log_ratio < math.log(rollout_token_veto_threshold))).any(-1)
            keep = keep & ~veto[:, None]
        dropped = valid & ~keep
        sums.update(rs_tok=dropped.to(f64).sum(), rs_seq=dropped.any(-1).to(f64).sum(), rs_veto=veto.to(f64).sum())
    mask = keep.to(response_mask.dtype)

    keys = list(sums)
    total = torch.stack([sums[k] for k in keys])
    total = reduce(total) if reduce is not None else total
    g = dict(zip(keys, total.tolist()))
    if peaks:
        pk = list(peaks)
        top = torch.stack([peaks[k] for k in pk])
        top = reduce_max(top) if reduce_max is not None else top  # a tensor or a list of floats
        peaks = dict(zip(pk, torch.as_tensor(top, dtype=f64).tolist()))

    def div(a: float, b: float) -> float:
        return a / b if b else 0.0

    m = {
        "kl": div(g["kl"], g["tokens"]), "k3_kl": div(g["k3"], g["tokens"]),
        "chi2_token": div(g["r2"], g["tokens"]) - 1.0 if g["tokens"] else 0.0,
        "training_ppl": div(g["ppl_old"], g["seqs"]), "rollout_ppl": div(g["ppl_roll"], g["seqs"]),
    }
    if rollout_is != "none":
        mean = div(g["is_sum"], g["is_units"])
        var = max(div(g["is_sq"], g["is_units"]) - mean**2, 0.0)
        has = g["is_units"] > 0
        m.update(rollout_is_mean=mean, rollout_is_std=math.sqrt(var),
                 rollout_is_max=peaks["is_max"] if has else 0.0, rollout_is_min=-peaks["is_negmin"] if has else 0.0,
                 rollout_is_truncated_fraction=div(g["is_trunc"], g["is_units"]),
                 rollout_is_weight_mean=div(g["is_w"], g["tokens"]))
    if "rs_tok" in g:
        m.update(rollout_rs_masked_fraction=div(g["rs_tok"], g["tokens"]),
                 rollout_rs_seq_masked_fraction=div(g["rs_seq"], g["seqs"]),
                 rollout_rs_veto_fraction=div(g["rs_veto"], g["seqs"]))
    return Correction(weights, mask, {f"rollout_corr/{k}": float(v) for k, v in m.items()})


def decoupled_weights(prox_log_prob: Tensor, behav_log_prob: Tensor, response_mask: Tensor, cap: float = 0.0,
                      reduce: Reduce | None = None, reduce_max: Reduce | None = None) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO's per-token importance weights (Hilton et al. 2021) and their metrics, for one batch [B, T].

        w_it = exp(min(log pi_prox(y_it) - log pi_behav(y_it), log C))      (C = cap; 0: no cap)

    pi_prox: the actor before the update (the ratio's and the clip's reference); pi_behav: the policy that sampled
    the token (the rollout engine's log-prob, at the token's weight version). Log-ratios are bounded to +-20 before
    the exponential; padding gets weight 0. The loss multiplies its per-token term by w (spmdrl.algos.losses), so
    with the PPO clip this is L_it = -w_it min(rho_it A_it, clip(rho_it, 1 - eps_low, 1 + eps_high) A_it),
    rho_it = pi_theta(y_it) / pi_prox(y_it).

    Metrics (global over the rows of every rank when `reduce` / `reduce_max` are given): decoupled/weight_mean,
    weight_max, weight_min (of w over valid tokens) and capped_fraction (valid tokens whose ratio exceeds C).
    """
    f64 = torch.float64
    valid = response_mask != 0
    log_w = (prox_log_prob.detach().to(f64) - behav_log_prob.detach().to(f64)).clamp(-LOG_BOUND, LOG_BOUND)
    capped = valid & (log_w > math.log(cap)) if cap > 0 else torch.zeros_like(valid)
    if cap > 0:
        log_w = log_w.clamp(max=math.log(cap))
    w = torch.where(valid, log_w.exp(), torch.zeros_like(log_w))
    vf = valid.to(f64)
    sums = torch.stack([vf.sum(), (w * vf).sum(), capped.to(f64).sum()])
    big = torch.tensor(1e300, dtype=f64, device=w.device)
    tops = torch.stack([torch.where(valid, w, -big).max() if valid.any() else -big,
                        torch.where(valid, -w, -big).max() if valid.any() else -big])
    if reduce is not None:
        sums = reduce(sums)
    if reduce_max is not None:
        tops = reduce_max(tops)
    n = float(sums[0])
    metrics = {"decoupled/weight_mean": float(sums[1]) / n if n else 0.0,
               "decoupled/capped_fraction": float(sums[2]) / n if n else 0.0}
    if n:
        metrics.update({"decoupled/weight_max": float(tops[0]), "decoupled/weight_min": -float(tops[1])})
    return w.to(prox_log_prob.dtype), metrics
