"""synthetic/arith and synthetic/count (data/count_shapes.py): the whole (stripped) response must be the integer
answer."""
from __future__ import annotations

import re

from spmdrl.rewards.registry import REWARD_FNS

_INT = re.compile(r"[+-]?[0-9]+")


@REWARD_FNS.register("synthetic/arith", "synthetic/count")
def arith_reward(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    answer, truth = solution_str.strip(), str(ground_truth).strip()
    if not _INT.fullmatch(answer) or not _INT.fullmatch(truth):
        return 0.0
    return 1.0 if int(answer) == int(truth) else 0.0
