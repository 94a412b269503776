"""Example hook: a custom metric (use with `hooks.files = ["configs/hooks/custom_metric.py"]`).

The fraction of responses that are only digits (the arithmetic task's answer format), from the decoded text
in `batch.meta["response_text"]`, logged for the step's training batch and for validation. Values logged on
each rank are averaged over ranks and land in metrics.jsonl (and TensorBoard) with the step's other metrics.
"""
import re

from spmdrl.hooks import hook

_DIGITS = re.compile(r"[0-9]+")


def digits_only_frac(texts: list[str]) -> float:
    return sum(_DIGITS.fullmatch(t.strip()) is not None for t in texts) / max(len(texts), 1)


@hook("after_step")
def train_digits_only(ctx):
    ctx.log("custom/digits_only_frac", digits_only_frac(ctx.batch.meta["response_text"]))


@hook("on_validation")
def val_digits_only(ctx):
    ctx.log("custom/val_digits_only_frac", digits_only_frac(ctx.batch.meta["response_text"]))
