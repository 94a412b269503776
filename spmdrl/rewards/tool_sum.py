"""synthetic/tool_sum: the last assistant turn must be exactly the integer answer (spmdrl/data/tool_sums.py).

The response of a multi-turn trajectory holds every turn after the prompt: the calls, the tool results and the
template's glue between turns. Only the text after the last assistant header counts; a trajectory whose last
turn is still a tool call, or holds anything besides the number, scores 0.
"""
from __future__ import annotations

import re

from spmdrl.rewards.registry import REWARD_FNS

_INT = re.compile(r"[+-]?[0-9]+")
# the assistant header of ChatML templates, with its special tokens kept and with them skipped when decoding
_HEADERS = ("<|im_start|>assistant\n", "\nassistant\n")
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def last_assistant_turn(text: str) -> str:
    """The text of the last assistant turn of a decoded response (all of it for a single-turn response)."""
    for header in _HEADERS:
        if header in text:
            text = text.rsplit(header, 1)[1]
            break
    text = text.strip()
    for end in _END_TOKENS:
        text = text.split(end, 1)[0]
    return text.strip()


@REWARD_FNS.register("synthetic/tool_sum")
def tool_sum_reward(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    answer, truth = last_assistant_turn(solution_str), str(ground_truth).strip()
    if not _INT.fullmatch(answer) or not _INT.fullmatch(truth):
        return 0.0
    return 1.0 if int(answer) == int(truth) else 0.0
