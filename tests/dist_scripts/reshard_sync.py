"""One weight sync through the planned resharding, on a given actor/rollout layout.

Builds the FSDP2 (+ DTensor TP) actor and the in-process vLLM engine on the layout, takes one real AdamW step
so the weights differ from the checkpoint vLLM loaded, syncs, and compares vLLM's log-probs of sampled tokens
with the actor's. Writes OUT/rank{r}.json with the sync metrics, the plan's figures and the comparison.

--verify: that sync runs with rollout.verify_sync, and two deliberately wrong syncs follow, each of which the
check must stop on every rank: a wrong vLLM slicing rule (rank r's q_proj rows taken as rank r+1's) and, on
rank 1 only, two rows of one parameter swapped on their way into vLLM. Their messages go into the json.

torchrun --nproc-per-node N reshard_sync.py --model M --out DIR --actor-tp A --rollout-tp R [--verify]
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
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args()

    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine, pack_sequences
    from spmdrl.dist.blocks import fsdp_tp_style, numel
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
    sync = WeightSync(actor, rollout, meshes["rollout"], dtype=torch.float32, bucket_mb=args.bucket_mb,
                      verify=args.verify)
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
    if args.verify:
        res["wrong_rule"] = wrong_sync(lambda: wrong_rule(actor, rollout, meshes, args.bucket_mb))
        res["swapped_rows"] = wrong_sync(lambda: swapped_rows(sync, rank))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    return 0


def wrong_sync(run) -> str:
    """The SyncMismatch message a deliberately wrong sync ends with ('' if it passes)."""
    from spmdrl.reshard.verify import SyncMismatch

    try:
        run()
    except SyncMismatch as e:
        return str(e)
    return ""


def wrong_rule(actor, rollout, meshes, bucket_mb):
    """A sync planned with a wrong slicing rule: rank r of the TP group is sent the q_proj rows vLLM's loader
    reads on rank r+1."""
    from spmdrl.reshard import vllm_reads
    from spmdrl.reshard.sync import WeightSync

    right = vllm_reads.vllm_targets

    def wrong(params, groups, reads):
        out = right(params, groups, reads)
        for name, shape in params:
            if name.endswith("q_proj.weight"):
                out[name] = [(rank, b) for g in groups for r, rank in enumerate(g)
                             for b in reads.blocks(name, shape, (r + 1) % len(g))]
        return out

    vllm_reads.vllm_targets = wrong
    try:
        sync = WeightSync(actor, rollout, meshes["rollout"], dtype=torch.float32, bucket_mb=bucket_mb, verify=True)
    finally:
        vllm_reads.vllm_targets = right
    sync()


def swapped_rows(sync, rank):
    """The right plan, but on rank 1 two rows of layer 1's down_proj are swapped on their way into vLLM."""
    from spmdrl.reshard import sync as sync_module

    execute = sync_module.execute

    def swapping(*args, deliver, **kwargs):
        def deliver_swapped(bucket):
            for name, t in bucket:
                if rank == 1 and name == "model.layers.1.mlp.down_proj.weight":
                    t[[0, 1]] = t[[1, 0]]
            deliver(bucket)
        return execute(*args, deliver=deliver_swapped, **kwargs)

    sync_module.execute = swapping
    try:
        sync()
    finally:
        sync_module.execute = execute


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
