"""Test hook: save each rank's batch of step 1 before any other hook changes it (after_rollout, listed first in
hooks.files), as the update sees it (before_update) and the validation batch, tensors and meta, for
tests/test_hooks.py."""
import os

import torch

from spmdrl.hooks import hook

OUT = os.environ["SPMDRL_TEST_DUMP"]


def _save(ctx, name):
    if ctx.step == 1:
        b = ctx.batch
        data = {"tensors": dict(b.tensors), "meta": {k: list(v) for k, v in b.meta.items()}}
        torch.save(data, os.path.join(OUT, f"{name}_rank{torch.distributed.get_rank()}.pt"))


@hook("after_rollout")
def dump_rollout(ctx):
    _save(ctx, "rollout")


@hook("before_update")
def dump_update(ctx):
    _save(ctx, "update")


@hook("on_validation")
def dump_validation(ctx):
    _save(ctx, "val")
