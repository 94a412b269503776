"""The rollout/trainer mismatch, measured and corrected just before the actor update.

Two things need the actor's log-probs of the sampled tokens before its parameters move:

- The diagnostic `rollout/logprob_diff_mean|max` compares like with like: the rollout engine returns processed
  log-probs (after temperature, top-k and top-p), so when the sampler truncates (rollout.top_p < 1 or
  rollout.top_k > 0) the actor's log-probs are recomputed with the same truncation (one extra forward pass
  without gradients); without truncation the old log-probs (or, on-policy, the update's own) already are the
  same quantity and loop/learner.py and loop/update.py measure it there.
- The [rollout_correction] section (spmdrl/algos/rollout_correction.py) turns pi_old / pi_rollout into
  importance weights and a rejection mask. pi_old is the untruncated, temperature-scaled actor policy that the
  loss's ratio uses; on-policy (no separate old-log-prob pass) it is computed here.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from spmdrl.algos.rollout_correction import rollout_correction
from spmdrl.batch import Batch
from spmdrl.config.validate import rollout_correction_active

log = logging.getLogger("spmdrl")

LOGP_FLOOR = -100.0  # a token outside the actor's kept set (log-prob -inf) counts as this in the diagnostic


def sampler_truncates(cfg) -> bool:
    """Whether training rollouts sample from a truncated distribution (top-k or top-p)."""
    return cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0


def logprob_diff(actor_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, reduce: Callable,
                 reduce_max: Callable) -> dict[str, float]:
    """rollout/logprob_diff_mean (token mean over the global batch) and _max of |actor - rollout| log-prob."""
    valid = mask != 0
    diff = torch.where(valid, (actor_lp.double().clamp(min=LOGP_FLOOR) - rollout_lp.double()).abs(), 0.0)
    s = reduce(torch.stack([diff.sum(), valid.double().sum()]))
    top = reduce_max(torch.cat([diff.flatten(), torch.zeros(1, dtype=torch.float64)]).max().view(1))
    return {"rollout/logprob_diff_mean": float(s[0] / s[1]) if float(s[1]) else 0.0,
            "rollout/logprob_diff_max": float(torch.as_tensor(top)[0])}


def prepare_actor_update(cfg, engine, batch: Batch, forward: Callable, reduce: Callable,
                         reduce_max: Callable) -> tuple[Batch, dict[str, float]]:
    """The batch the actor update trains on, plus metrics.

    forward(engine, batch, top_k=, top_p=) -> [B, R] log-probs with the rollout temperature. The returned batch
    carries `rollout_is_weights` (when they enter the loss), the response mask after rejection and, when
    correction is on, `old_log_probs`; `batch` itself is not modified (its mask stays the sampled one)."""
    metrics: dict[str, float] = {}
    r = cfg.rollout
    if sampler_truncates(cfg):
        processed = forward(engine, batch, top_k=r.top_k, top_p=r.top_p)
        metrics.update(logprob_diff(processed, batch["rollout_log_probs"], batch["response_mask"], reduce, reduce_max))
    if not rollout_correction_active(cfg):
        return batch, metrics
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
    if corr.metrics.get("rollout_corr/rollout_rs_masked_fraction", 0.0) >= 1.0:
        log.warning("rollout_correction rejected every response token of this step (rollout_rs = %s, window [%s, %s], "
                    "veto %s): the update trains on nothing; the step counts as bad (trainer.max_bad_steps)",
                    rc.rollout_rs, rc.rollout_rs_threshold_lower, rc.rollout_rs_threshold,
                    rc.rollout_token_veto_threshold)
    return Batch(tensors, dict(batch.meta)), metrics
