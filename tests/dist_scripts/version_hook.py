"""Test hook: record, per training rank and step, the batch as it arrived from the rollout (every tensor) and the
weight version each sample was generated with."""
import json
import os

import torch

from spmdrl.hooks import hook

OUT = os.environ["SPMDRL_TEST_DUMP"]


@hook("after_rollout")
def record_versions(ctx):
    rank = torch.distributed.get_rank()
    tensors = {k: v.tolist() for k, v in ctx.batch.tensors.items()}
    with open(os.path.join(OUT, f"versions_rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"step": ctx.step, "versions": tensors.get("weight_version"), "all": tensors}) + "\n")
