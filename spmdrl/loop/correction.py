"""The rollout/trainer mismatch, measured and corrected around the actor update.

- `logprob_diff` is the one owner of the diagnostic `rollout/logprob_diff_mean|max`: |actor - rollout| log-prob
  of the sampled tokens, its token mean over the global batch (a global token sum) and its global maximum. The
  rollout engine returns processed log-probs (after temperature, top-k and top-p), so the actor side must be the
  same quantity: with a truncating sampler (`sampler_truncates`: top-p or top-k) the actor's log-probs under
  the same truncation (one extra forward pass without gradients, before the update); otherwise the old
  log-probs, or on-policy (no separate old-log-prob pass) the update's own, collected micro-batch by
  micro-batch (`ActorObjective.own_logprobs`, loop/update.py). loop/learner.py's `update_actor` picks which.
- The [rollout_correction] section (spmdrl/algos/rollout_correction.py) turns pi_old / pi_rollout into
  importance weights and a rejection mask (`correct_rollout`). pi_old is the untruncated, temperature-scaled
  actor policy that the loss's ratio uses; on-policy (no separate old-log-prob pass) it is computed here.
  Decoupled PPO (rollout_correction.decoupled) is the same pass with pi_old as the proximal policy: the ratio and
  clip use it, and the weights are pi_old / pi_rollout, capped at decoupled_cap (`decoupled_weights`), pi_rollout
  being each token's behaviour log-prob at the version that sampled it.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from spmdrl.algos.rollout_correction import decoupled_weights, rollout_correction
from spmdrl.batch import Batch
from spmdrl.config.derived import rollout_correction_active
from spmdrl.errors import ConfigError

log = logging.getLogger("spmdrl")

LOGP_FLOOR = -100.0  # a token outside the actor's kept set (log-prob -inf) counts as this in the diagnostic


def logprob_diff(pieces: list, reduce: Callable, reduce_max: Callable) -> dict[str, float]:
    """rollout/logprob_diff_mean (token mean over the global batch) and _max (global maximum) of |actor - rollout|
    log-prob. pieces: (actor_lp, rollout_lp, mask) triples that together cover this rank's samples once (the
    whole batch, or the update's micro-batches); reduce sums and reduce_max maxes over the actor's dp ranks."""
    sums, tops = [], []  # per piece, on its device: read once, in the all-reduces
    for actor_lp, rollout_lp, mask in pieces:
        valid = (mask != 0).to(actor_lp.device)
        diff = (actor_lp.double().clamp(min=LOGP_FLOOR) - rollout_lp.to(actor_lp.device).double()).abs()
        diff = torch.where(valid, diff, 0.0)
        sums.append(torch.stack([diff.sum(), valid.double().sum()]))
        tops.append(torch.cat([diff.flatten(), diff.new_zeros(1)]).max())
    total = torch.stack(sums).sum(0) if sums else torch.zeros(2, dtype=torch.float64)
    top = torch.stack(tops).max().view(1) if tops else torch.zeros(1, dtype=torch.float64)
    s = reduce(total)
    top = reduce_max(top)
    return {"rollout/logprob_diff_mean": float(s[0] / s[1]) if float(s[1]) else 0.0,
            "rollout/logprob_diff_max": float(torch.as_tensor(top)[0])}


class MismatchWatch:
    """rollout/logprob_diff_* against their bounds (config/derived.py logprob_diff_bounds), on the step's reduced
    metrics (the same on every rank): a max above `warn` gets one warning line per run; a token mean above
    `error` stops the run, since the update then trains another policy than the one that sampled. A batch sampled
    with older weights (train/weight_version_lag > 0) is not checked: there the difference is the update's."""

    def __init__(self, warn: float, error: float):
        self.warn, self.error, self.warned = warn, error, False

    def check(self, step: int, metrics: dict) -> None:
        if metrics.get("train/weight_version_lag", 0.0) > 0:  # sampled with older weights (split placement's
            return  # staleness): the difference is the policy's change, by design
        top, mean = metrics.get("rollout/logprob_diff_max"), metrics.get("rollout/logprob_diff_mean")
        if mean is not None and not mean <= self.error:  # NaN log-probs stop the run too
            raise ConfigError(
                f"step {step}: rollout/logprob_diff_mean = {mean:.3g} nats > rollout.logprob_diff_error = "
                f"{self.error:.3g}: the actor computes another policy than the rollout engine samples from (max "
                f"{top:.3g}); check the weight sync with rollout.verify_sync = true, or raise the bound if this is "
                "expected precision noise")
        if top is not None and not top <= self.warn and not self.warned:
            self.warned = True
            log.warning("step %d: rollout/logprob_diff_max = %.3g nats > rollout.logprob_diff_warn = %.3g (token mean "
                        "%.3g): some sampled tokens get another log-prob from the actor than from the rollout engine "
                        "(said once per run)", step, top, self.warn, mean or 0.0)


def correct_rollout(cfg, engine, batch: Batch, forward: Callable, reduce: Callable,
                    reduce_max: Callable) -> tuple[Batch, dict[str, float]]:
    """The batch the actor update trains on, plus the correction's metrics ([rollout_correction]; without it the
    batch itself and no metrics).

    forward(engine, batch) -> [B, R] log-probs with the rollout temperature. The returned batch carries
    `rollout_is_weights` (when they enter the loss), the response mask after rejection and `old_log_probs`;
    `batch` itself is not modified (its mask stays the sampled one)."""
    if not rollout_correction_active(cfg):
        return batch, {}
    metrics: dict[str, float] = {}
    rc = cfg.rollout_correction
    old = batch["old_log_probs"] if "old_log_probs" in batch else forward(engine, batch)
    corr = rollout_correction(
        old, batch["rollout_log_probs"], batch["response_mask"], rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold, rollout_is_in_loss=rc.rollout_is_in_loss,
        rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold,
        rollout_rs_threshold_lower=rc.rollout_rs_threshold_lower,
        rollout_token_veto_threshold=rc.rollout_token_veto_threshold, reduce=reduce, reduce_max=reduce_max,
    )
    tensors = {**batch.tensors, "old_log_probs": old, "response_mask": corr.response_mask}
    if corr.weights is not None:
        tensors["rollout_is_weights"] = corr.weights
    metrics.update(corr.metrics)
    if rc.decoupled:  # decoupled PPO: old is the proximal policy, the weights pi_prox / pi_behav (config refuses both)
        tensors["rollout_is_weights"], m = decoupled_weights(old, batch["rollout_log_probs"], corr.response_mask,
                                                             rc.decoupled_cap, reduce, reduce_max)
        metrics.update(m)
    if corr.metrics.get("rollout_corr/rollout_rs_masked_fraction", 0.0) >= 1.0:
        log.warning("rollout_correction rejected every response token of this step (rollout_rs = %s, window [%s, %s], "
                    "veto %s): the update trains on nothing; the step counts as bad (trainer.max_bad_steps)",
                    rc.rollout_rs, rc.rollout_rs_threshold_lower, rc.rollout_rs_threshold,
                    rc.rollout_token_veto_threshold)
    return Batch(tensors, dict(batch.meta)), metrics
