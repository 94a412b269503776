"""Test hook: record, per training rank and step, the weight version each sample of the batch was generated with."""
import json
import os

import torch

from spmdrl.hooks import hook

OUT = os.environ["SPMDRL_TEST_DUMP"]


@hook("after_rollout")
def record_versions(ctx):
    rank = torch.distributed.get_rank()
    with open(os.path.join(OUT, f"versions_rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"step": ctx.step, "versions": ctx.batch["weight_version"].tolist()}) + "\n")
