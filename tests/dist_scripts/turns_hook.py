"""Test hook: at after_rollout of step 1 each rank saves what the hooks see of the multi-turn batch."""
import json
import os

import torch

from spmdrl.hooks import hook

OUT = os.environ["SPMDRL_TEST_DUMP"]


@hook("after_rollout")
def dump_turns(ctx):
    if ctx.step != 1:
        return
    b = ctx.batch
    rows = []
    for i, traj in enumerate(b.meta["trajectory"]):
        n = int(b["response_len"][i])
        rows.append({"turns": traj["turns"], "finish": traj["finish"], "messages": traj["messages"],
                     "ids": b["responses"][i, :n].tolist(), "mask": b["response_mask"][i, :n].tolist(),
                     "logprobs": b["rollout_log_probs"][i, :n].tolist(), "response_text": b.meta["response_text"][i],
                     "truncated": float(b["truncated"][i])})
    with open(os.path.join(OUT, f"turns_rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(rows, f)
