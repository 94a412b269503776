"""GSM8K: the answer is the number after the last "####" (strict) or the last number at all (flexible)."""
from __future__ import annotations

import re

from spmdrl.rewards.registry import REWARD_FNS

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_FLEXIBLE = re.compile(_NUMBER)


def _normalize(number: str) -> str:
    return number.replace(",", "").replace("$", "").strip()


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer as a comma-free number string, or None when there is none."""
    if method == "strict":
        found = _STRICT.findall(solution_str)
    elif method == "flexible":
        found = _FLEXIBLE.findall(solution_str)
    else:
        raise ValueError(f"gsm8k extraction method {method!r} is not strict or flexible")
    return _normalize(found[-1]) if found else None


def same_number(a: str, b: str, tol: float = 1e-9) -> bool:
    """a and b are the same string, or both numbers within tol of each other."""
    if a == b:
        return True
    try:
        return abs(float(a) - float(b)) < tol
    except ValueError:
        return False


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """score if the extracted answer equals ground_truth, format_score if an answer was extracted, else 0."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if same_number(answer, _normalize(str(ground_truth))) else format_score


@REWARD_FNS.register("openai/gsm8k", "gsm8k")
def gsm8k_reward(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    return compute_score(solution_str, ground_truth)
