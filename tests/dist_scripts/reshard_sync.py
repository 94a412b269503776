"""One weight sync through the planned resharding, on a given actor/rollout layout.

Builds the FSDP2 (+ DTensor TP) actor and the in-process vLLM engine on the layout, takes one real AdamW step
so the weights differ from the checkpoint vLLM loaded, syncs, and compares vLLM's log-probs of sampled tokens
with the actor's. Writes OUT/rank{r}.json with the sync metrics, the plan's figures and the comparison.

torchrun --nproc-per-node N reshard_sync.py --model M --out DIR --actor-tp A --rollout-tp R
"""
import argparse
import json
import os

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--actor-tp", type=int, default=1)
    ap.add_argument("--rollout-tp", type=int, default=1)
    ap.add_argument("--bucket-mb", type=int, default=1)
    args = ap.parse_args()

    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine, pack_sequences
    from spmdrl.reshard.plan import fsdp_tp_style, numel
    from spmdrl.reshard.sync import WeightSync
    from spmdrl.rollout import SamplingSpec, build_engine

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = plan_layout(PlacementConfig(actor_tp=args.actor_tp, rollout_tp=args.rollout_tp), world)
    meshes = RoleMeshes(layout, rank, "cpu")
    actor = build_train_engine("fsdp", args.model, meshes["actor"], torch.device("cpu"), trainable=True,
                               optim=dict(lr=1e-2))
    rollout = build_engine("vllm", model_path=args.model, tp_size=args.rollout_tp, tp_group=meshes["rollout"].my_tp_group(),
                           max_model_len=128, seed=0, kv_cache_gb=0.1)
    torch.manual_seed(0)  # the same step on every rank

    prompts = [[5 + i, 40 + 3 * i, 77, 12 + i] for i in range(4)]
    responses = [[30 + i, 31, 32 + 2 * i] for i in range(4)]
    tb = pack_sequences([torch.tensor(p) for p in prompts], [torch.tensor(r) for r in responses], 0)

    def loss_fn(batch, eng):
        logp, _ = eng.logprobs(batch)
        return -(logp * batch.resp_mask).sum(), {}

    actor.train_step([tb], loss_fn)
    sync = WeightSync(actor, rollout, meshes["rollout"], dtype=torch.float32, bucket_mb=args.bucket_mb)
    metrics = sync()

    # vLLM samples from the synced weights; the actor scores the same tokens
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=8)
    g = meshes["rollout"].dp_rank
    gen_prompts = [[10 + g, 50, 60 + i] for i in range(3)]
    out = rollout.generate(gen_prompts, spec, [100 + 10 * g + i for i in range(3)])
    tb2 = pack_sequences([torch.tensor(gen_prompts[i // 2]) for i in range(6)],
                         [torch.tensor(r) for r in out.response_ids], 0)
    with torch.no_grad():
        actor.eval()
        logp, _ = actor.logprobs(tb2)
    diff = max((float((logp[i, : len(lp)] - torch.tensor(lp)).abs().max()) for i, lp in enumerate(out.logprobs) if lp),
               default=0.0)
    plan = sync.plan
    tp_bytes = sum(numel(t.block) * plan.elem_bytes for name, ts in plan.transfers.items() if fsdp_tp_style(name)
                   for t in ts)
    summary = plan.summary(args.bucket_mb << 20)
    res = {
        "rank": rank, "metrics": metrics, "logprob_max_diff": diff, "n_tokens": sum(len(r) for r in out.response_ids),
        "plan_recv": plan.bytes_recv().get(rank, 0), "plan_lower_bound": plan.lower_bound().get(rank, 0),
        "plan_summary": {k: v for k, v in summary.items() if k != "bytes_recv_per_rank"},
        "tp_sharded_bytes_moved": tp_bytes,
        "model_bytes": sum(torch.Size(s).numel() * 4 for _, s in actor.param_shapes()),
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
