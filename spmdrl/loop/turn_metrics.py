"""Multi-turn rollout metrics of a step's batch (docs/metrics.md, "Multi-turn"), from the turns each sample
carries (batch.meta["trajectory"], attached by the Scorer) and its response mask."""
from __future__ import annotations

import torch

from spmdrl.batch import Batch
from spmdrl.dist.collectives import reduce_max, reduce_sum
from spmdrl.dist.meshes import RoleMesh
from spmdrl.loop.generate import BRANCH, PADDING
from spmdrl.tools.base import FAILURES
from spmdrl.tools.runner import UNKNOWN


def trajectory_metrics(batch: Batch, tool_names: list[str], mesh: RoleMesh) -> dict[str, float]:
    """Means per trajectory (turns, model and tool tokens, the truncated and turn-limit ratios), the largest
    turn count, and per tool the step's calls, failures by kind and summed call time, over the whole batch (the
    dp ranks of `mesh` hold disjoint samples; every rank gets the same values). The keys depend on the
    configured tool names only, and a per-kind failure count appears when it is non-zero, so every rank reports
    the same keys."""
    names = sorted(set(tool_names)) + [UNKNOWN]
    if BRANCH in batch:  # [agent] branch rows: the padding rows are no trajectories
        batch = batch.select(batch[BRANCH] != PADDING)
    trajs = batch.meta["trajectory"]
    mask = batch["response_mask"]
    n = len(trajs)
    turns = torch.tensor([float(len(t["turns"])) for t in trajs])
    model_tokens = mask.sum(-1)
    tool_tokens = batch["response_len"].float() - model_tokens
    calls = {k: 0.0 for k in names}
    seconds = {k: 0.0 for k in names}
    failures = {(k, f): 0.0 for k in names for f in FAILURES}
    for t in trajs:
        for turn in t["turns"]:
            for r in turn["results"]:
                k = r["name"] if r["name"] in calls and r["name"] != UNKNOWN else UNKNOWN
                calls[k] += 1
                seconds[k] += float(r["seconds"])
                if r["failure"] in FAILURES:
                    failures[(k, r["failure"])] += 1
    local = [float(n), float(turns.sum()), float(model_tokens.sum()), float(tool_tokens.sum()),
             sum(t["finish"] == "length" for t in trajs), sum(t["finish"] == "turn_limit" for t in trajs),
             *calls.values(), *seconds.values(), *failures.values()]
    group = mesh.group("dp")
    tot = reduce_sum(torch.tensor(local, dtype=torch.float64), group=group).tolist()
    turns_max = reduce_max(torch.tensor([float(turns.max()) if n else 0.0]), group=group)[0]
    count = max(tot[0], 1.0)
    out = {
        "tools/calls": sum(tot[6: 6 + len(names)]), "tools/failures": sum(tot[6 + 2 * len(names):]),
        "multi_turn/turns_mean": tot[1] / count, "multi_turn/turns_max": turns_max,
        "multi_turn/model_tokens_mean": tot[2] / count, "multi_turn/tool_tokens_mean": tot[3] / count,
        "multi_turn/truncated_ratio": tot[4] / count, "multi_turn/turn_limit_ratio": tot[5] / count,
    }
    pos = 6
    for k in names:
        out[f"tools/calls/{k}"] = tot[pos]
        pos += 1
    for k in names:
        out[f"tools/seconds/{k}"] = tot[pos]
        pos += 1
    for k, f in failures:  # per tool and kind only when it happened (the same on every rank: summed above)
        if tot[pos]:
            out[f"tools/failures/{k}/{f}"] = tot[pos]
        pos += 1
    return out
