"""Resolving a reward function spec ("path/to/file.py:fn" or "package.module:fn") to a callable; every failure
is a one-line RewardError naming the spec. Kept apart from rewards/custom.py so the reward worker process
(rewards/worker.py) can load the function without importing the scoring code."""
from __future__ import annotations

from typing import Callable

from spmdrl.errors import RewardError
from spmdrl.process.usercode import load_object, one_line as _one_line

__all__ = ["_one_line", "load_reward_fn", "reward_fn_name"]


def reward_fn_name(fn: Callable) -> str:
    """How errors name a reward function: its spec when loaded from one, else module:qualname."""
    name = getattr(fn, "__spmdrl_spec__", None)
    if name:
        return name
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{module}:{qualname}"


def load_reward_fn(spec: str) -> Callable:
    """Resolve `spec` to a callable; every failure is a one-line RewardError naming the spec."""
    obj = load_object(spec, what="reward function", key="reward.custom_fn", error=RewardError)
    if not callable(obj):
        attr = spec.rpartition(":")[2]
        raise RewardError(f"reward function {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    try:
        obj.__spmdrl_spec__ = spec
    except (AttributeError, TypeError):
        pass
    return obj
