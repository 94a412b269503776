"""Example hook: reward shaping at after_reward (use with `hooks.files = ["configs/hooks/reward_shaping.py"]`).

    score' = score + FORMAT_BONUS * [response is a bare integer] - LENGTH_PENALTY * response_len / max_response_length

`batch["scores"]` [B] holds the reward of each sample (rule/custom score times reward.rule_weight, plus the
reward model and DAPO overlong terms when configured). The trainer places `scores` on each response's last
token right after the after_reward hooks, so what is written here is what the advantage estimator sees.
Change the constants to taste; they are per-file, every rank reads the same file.
"""
import re

from spmdrl.hooks import hook

FORMAT_BONUS = 0.1     # for a response that is just the answer ("46"), the arithmetic task's format
LENGTH_PENALTY = 0.05  # at a response of max_response_length tokens; linear in the length

_BARE_INT = re.compile(r"-?\d+")


def bare_integer(text: str) -> bool:
    return _BARE_INT.fullmatch(text.strip()) is not None


@hook("after_reward")
def shape_reward(ctx):
    b = ctx.batch
    if not len(b):  # a filter before this hook dropped every sample of this rank
        return
    fmt = b["scores"].new_tensor([float(bare_integer(t)) for t in b.meta["response_text"]])
    length = b["response_len"].to(b["scores"].dtype) / ctx.config.data.max_response_length
    delta = FORMAT_BONUS * fmt - LENGTH_PENALTY * length
    b["scores"] = b["scores"] + delta  # same shape [B]; in place on the trainer's batch
    ctx.log("shaping/format_bonus_frac", fmt.mean())
    ctx.log("shaping/delta_mean", delta.mean())
