"""Reward functions: built-in rule-based scorers keyed by data_source, user functions, batch scoring."""
from spmdrl.rewards.registry import REWARD_FNS, default_compute_score
from spmdrl.rewards import arith, geo3k, gsm8k, tool_sum  # noqa: F401  (registers the built-in scorers)
from spmdrl.rewards.custom import compute_rewards, load_reward_fn

__all__ = ["REWARD_FNS", "compute_rewards", "default_compute_score", "load_reward_fn"]
