"""Geometry QA (data/geo3k.py, data_source hiyouga/geometry3k): 1 when the last \\boxed{...} of the response holds the
answer, else 0. Answers compare after dropping spaces, `$`, degree marks and a trailing period, and as numbers when
both sides are numbers (so "12.50" is "12.5"); a LaTeX answer (`3\\sqrt{3}`, `\\frac{5}{2}`) must match as written.
"""
from __future__ import annotations

import re

from spmdrl.rewards.gsm8k import same_number
from spmdrl.rewards.registry import REWARD_FNS

_DROP = re.compile(r"\s+|\$|\^\s*\{?\\circ\}?|°|\\!|\\,")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in text (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1: j]
    return None


def normalize(answer: str) -> str:
    return _DROP.sub("", str(answer)).rstrip(".")


def same_answer(a: str, b: str) -> bool:
    return same_number(normalize(a), normalize(b), tol=1e-6)


@REWARD_FNS.register("hiyouga/geometry3k", "geo3k")
def geo3k_reward(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    answer = last_boxed(solution_str)
    return 1.0 if answer is not None and same_answer(answer, ground_truth) else 0.0
