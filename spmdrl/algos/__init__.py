"""RL algorithm core: pure tensor functions, registered by name, formula in each docstring."""
from spmdrl.algos.advantages import ADV_ESTIMATORS, discounted_returns, group_stats
from spmdrl.algos.distill import DISTILL_MODES, distill_sums
from spmdrl.algos.agg import LOSS_AGG, agg_loss, masked_mean, masked_sum, masked_var, masked_whiten
from spmdrl.algos.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from spmdrl.algos.losses import POLICY_LOSSES, value_loss
from spmdrl.algos.rollout_correction import LEVELS as ROLLOUT_CORRECTION_LEVELS
from spmdrl.algos.rollout_correction import rollout_correction
from spmdrl.algos.token_stats import entropy_from_logits, logprobs_from_hidden, logprobs_from_logits

__all__ = [
    "ADV_ESTIMATORS",
    "DISTILL_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGG",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTION_LEVELS",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "discounted_returns",
    "distill_sums",
    "entropy_from_logits",
    "group_stats",
    "kl_penalty",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "rollout_correction",
    "value_loss",
]
