"""Rule-based reward functions, looked up by a row's data_source."""
from __future__ import annotations

from typing import Callable

from spmdrl.errors import ConfigError, RewardError
from spmdrl.registry import Registry

# fn(solution_str, ground_truth, extra_info) -> float | {"score": float, ...extras}
REWARD_FNS: Registry[Callable] = Registry("reward function")


def default_compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None):
    """Dispatch to the reward function registered for `data_source` (verl's compute_score signature)."""
    try:
        fn = REWARD_FNS.get(data_source)
    except ConfigError:
        raise RewardError(
            f"no reward function for data_source {data_source!r} (registered: {', '.join(REWARD_FNS.names())}); "
            "set reward.custom_fn='path/to/file.py:function' or register one with REWARD_FNS.register"
        ) from None
    return fn(solution_str, ground_truth, extra_info)


def accuracy_score_fn(fallback: Callable) -> Callable:
    """What validation reports as accuracy: the rule scorer registered for a sample's data_source, and `fallback`
    (the custom reward function) only for a data_source without one. A custom reward that gives partial credit
    thus leaves val/accuracy a rule accuracy; validation reports its own mean as val/reward_mean."""

    def score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None):
        if data_source in REWARD_FNS:
            return REWARD_FNS.get(data_source)(solution_str, ground_truth, extra_info)
        return fallback(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                        extra_info=extra_info)

    score.__spmdrl_spec__ = getattr(fallback, "__spmdrl_spec__", None) or getattr(fallback, "__name__", "reward.custom_fn")
    return score
