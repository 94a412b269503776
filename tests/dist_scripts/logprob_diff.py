"""The rollout/trainer log-prob gap as a step logs it, on 2 gloo ranks: the Learner's actor update and batch
metrics (the calls Trainer.step makes, in its order) on each rank's half of a fixed global batch, then the step's
metric all-reduce (reduce_mean, tp copies weighted out). Writes <out>/logprob_diff.pt on rank 0:
{case: {"logged": metrics, "rollout_log_probs": [B, R] global, "rank_max": [per-rank local max]}}.

The rollout log-probs are the actor's plus a small perturbation and one large one per rank (0.3 on rank 0's
half, 0.9 on rank 1's), so the ranks' maxima differ. Cases: off_policy (old log-probs given) and on_policy (no
old log-probs: the update's own are the actor's side)."""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from objective_layout import global_batch  # noqa: E402

SPIKES = {1: (2, 0.3), 5: (3, 0.9)}  # global sample -> (token, |perturbation|): sample 1 on rank 0, 5 on rank 1


def perturbation(mask: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    d = 0.01 * torch.randn(mask.shape, generator=g)
    for i, (t, v) in SPIKES.items():
        d[i, t] = v
    return d * mask


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from spmdrl.algos.kl import FixedKLController
    from spmdrl.batch import Batch
    from spmdrl.config import Config
    from spmdrl.dist.collectives import reduce_mean
    from spmdrl.dist.init import init_distributed
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines.fsdp import FSDPEngine
    from spmdrl.loop.learner import Learner

    env, device = init_distributed("cpu")
    cfg = Config()
    cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.micro_batch_size = 4, 2, 2  # 4 samples a rank, 2 micro
    cfg.data.max_response_length = 8
    meshes = RoleMeshes(plan_layout(cfg.placement, env.world_size), env.rank, "cpu")
    mesh = meshes["actor"]
    engine = FSDPEngine(args.model, mesh, device, trainable=True, optim=dict(lr=0.0, weight_decay=0.0, grad_clip=0.0))
    learner = Learner(cfg, meshes, engine, None, None, FixedKLController(0.0), pad_id=0)
    full = global_batch()
    B = len(full["index"])
    full["scores"], full["truncated"] = torch.zeros(B), torch.zeros(B)
    lo, hi = mesh.dp_rank * B // mesh.dp_size, (mesh.dp_rank + 1) * B // mesh.dp_size
    delta = perturbation(full["response_mask"])
    res = {}
    for case in ("off_policy", "on_policy"):
        local = Batch({k: v[lo:hi] for k, v in full.items() if k not in ("rollout_log_probs", "baseline_rewards")})
        if case == "on_policy":
            del local.tensors["old_log_probs"]
            actor_lp = learner.logprobs(engine, local)
        else:
            actor_lp = local["old_log_probs"]
        local.tensors["rollout_log_probs"] = actor_lp + delta[lo:hi]
        rank_max = float(((local["rollout_log_probs"] - actor_lp).abs() * local["response_mask"]).max())
        metrics = {}
        metrics.update(learner.update_actor(local, local, measured=False))  # as Trainer.step: the update, then the batch's metrics
        metrics.update(learner.batch_metrics(local, 0))
        logged = reduce_mean(metrics, weight=mesh.leader_weight())  # the step's metric all-reduce
        parts = [torch.zeros_like(local["rollout_log_probs"]) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local["rollout_log_probs"].contiguous())
        maxima = [None] * dist.get_world_size()
        dist.all_gather_object(maxima, rank_max)
        res[case] = {"logged": logged, "rollout_log_probs": torch.cat(parts), "rank_max": maxima}
    if env.rank == 0:
        torch.save(res, os.path.join(args.out, "logprob_diff.pt"))
    dist.barrier()
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
