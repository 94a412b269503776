"""Test hook: rank 1 raises at after_reward of step 2 while rank 0 goes on into the next collective."""
import torch

from spmdrl.hooks import hook


@hook("after_reward")
def explode(ctx):
    if ctx.step == 2 and torch.distributed.get_rank() == 1:
        raise RuntimeError("hook failure on purpose\nsecond line")
