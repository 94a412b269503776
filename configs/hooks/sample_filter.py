"""Example hook: drop samples that carry no useful signal (use with `hooks.files = ["configs/hooks/sample_filter.py"]`).

1. after_rollout: drop truncated responses (`batch["truncated"]` is 1 where generation hit
   data.max_response_length): their reward judges an unfinished answer (DAPO's overlong filtering).
2. after_reward: drop groups whose remaining samples all have the same score, a group of one included:
   GRPO-style advantages are zero there, so they only dilute the update.

Samples are dropped with `ctx.keep(mask)`, in place, at these two stages only. Afterwards the trainer trims
every rank to the smallest sample count over ranks, so the update stays in lockstep (docs/hooks.md). Unlike
algorithm.filter_groups this does not roll out more prompts to refill the batch; the step trains on fewer samples.
"""
import torch

from spmdrl.hooks import hook


@hook("after_rollout")
def drop_truncated(ctx):
    b = ctx.batch
    keep = b["truncated"] == 0
    ctx.log("filter/truncated_frac", 1.0 - keep.float().mean() if len(b) else 0.0)
    ctx.keep(keep)


@hook("after_reward")
def drop_uniform_groups(ctx):
    b = ctx.batch
    if not len(b):
        ctx.log("filter/uniform_frac", 0.0)
        return
    _, group = torch.unique(b["index"], return_inverse=True)  # samples of a prompt share its dataset row
    scores = b["scores"].float()
    lo = torch.full((int(group.max()) + 1,), float("inf")).scatter_reduce(0, group, scores, "amin")
    hi = torch.full((int(group.max()) + 1,), float("-inf")).scatter_reduce(0, group, scores, "amax")
    keep = (hi > lo)[group]
    ctx.log("filter/uniform_frac", 1.0 - keep.float().mean())
    ctx.keep(keep)
