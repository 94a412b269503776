"""Test hook: save each rank's batch at before_update of step 1 (and the metrics of step 1) for checking."""
import os

import torch

from spmdrl.hooks import hook


@hook("before_update")
def dump_batch(ctx):
    if ctx.step == 1:
        rank = torch.distributed.get_rank()
        torch.save(dict(ctx.batch.tensors), os.path.join(os.environ["SPMDRL_TEST_DUMP"], f"batch_rank{rank}.pt"))
