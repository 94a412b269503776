"""The equivalence harness of the weight sync, one model family after another in one process group.

For each model directory: the actor takes one real AdamW step, so its weights differ from the
checkpoint vLLM was built from (FSDP2 over dp = world / --actor-tp, DTensor TP over --actor-tp); the sync into vLLM at TP = --rollout-tp runs with rollout.verify_sync, which
compares the engine's weights after the planned sync byte for byte with a load of every tensor whole through
vLLM's own loaders (and fills the part of each buffer outside the planned blocks with NaN, so a loader reading
outside them shows); then vLLM samples and the actor scores the same tokens. For a mixture of experts vLLM records
the experts it routed each token to and the actor replays them (route_counts: the router counts of that pass, this
rank's tokens). Writes OUT/<family>.rank{r}.json.

torchrun --nproc-per-node 2 model_families.py --out DIR --rollout-tp 2 [--actor-tp 2] MODEL_DIR [MODEL_DIR ...]
"""
import argparse
import json
import os

import torch
import torch.distributed as dist


def one_family(path: str, rollout_tp: int, actor_tp: int) -> dict:
    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine, pack_sequences
    from spmdrl.reshard.sync import WeightSync
    from spmdrl.rollout import SamplingSpec, build_engine

    rank, world = dist.get_rank(), dist.get_world_size()
    layout = plan_layout(PlacementConfig(rollout_tp=rollout_tp, actor_tp=actor_tp), world)
    meshes = RoleMeshes(layout, rank, "cpu")
    from spmdrl.models.model import load_hf_config
    from spmdrl.rollout.routes import route_shape

    moe = route_shape(load_hf_config(path))  # (layers, top_k) of a mixture of experts: routes recorded and replayed
    actor = build_train_engine("fsdp", path, meshes["actor"], torch.device("cpu"), trainable=True, optim=dict(lr=1e-2),
                               router_replay=moe is not None)
    rollout = build_engine("vllm", model_path=path, tp_size=rollout_tp, tp_group=meshes["rollout"].my_tp_group(),
                           max_model_len=128, seed=0, kv_cache_gb=0.05, capture_routes=moe is not None)
    try:
        torch.manual_seed(0)
        prompts = [[5 + i, 40 + 3 * i, 77, 12 + i] for i in range(4)]
        responses = [[30 + i, 31, 32 + 2 * i] for i in range(4)]
        tb = pack_sequences([torch.tensor(p) for p in prompts], [torch.tensor(r) for r in responses], 0)

        def loss_fn(batch, eng):
            logp, _ = eng.logprobs(batch)
            return -(logp * batch.resp_mask).sum(), {}

        actor.train_step([tb], loss_fn)
        sync = WeightSync(actor, rollout, meshes["rollout"], dtype=torch.float32, bucket_mb=1, verify=True)
        metrics = sync()  # raises SyncMismatch on every rank if the planned route differs from the whole load

        spec = SamplingSpec(n=2, temperature=1.0, max_tokens=8)
        g = meshes["rollout"].dp_rank
        gen = [[10 + g, 50, 60 + i] for i in range(3)]
        out = rollout.generate(gen, spec, [100 + 10 * g + i for i in range(3)])
        seqs = [(torch.tensor(gen[i // 2]), torch.tensor(r)) for i, r in enumerate(out.response_ids)]
        routes = None
        if moe is not None:  # vLLM's routes of prompt + response (the last token has none: -1)
            routes = [torch.full((len(p) + len(r), *moe), -1, dtype=torch.long) for p, r in seqs]
            for rt, got in zip(routes, out.routed_experts):
                rt[: len(got)] = torch.as_tensor(got[: len(rt)], dtype=torch.long)
        tb2 = pack_sequences([p for p, _ in seqs], [r for _, r in seqs], 0, routes=routes)
        actor.moe_counts()  # the training step's routing: not compared
        with torch.no_grad():
            actor.eval()
            logp, _ = actor.logprobs(tb2)
        counts = {k: float(v) for k, v in actor.moe_counts().items() if k != "load"}
        if moe is not None:  # every position vLLM computed (all but each sequence's last), every layer and choice
            counts["expected"] = float(sum(len(p) + len(r) - 1 for p, r in seqs) * moe[0] * moe[1])
        diff = max((float((logp[i, : len(lp)] - torch.tensor(lp)).abs().max()) for i, lp in enumerate(out.logprobs)
                    if lp), default=0.0)
        plan = sync.plan
        return {
            "rank": rank, "metrics": metrics, "logprob_max_diff": diff, "n_tokens": sum(len(r) for r in out.response_ids),
            "plan_recv": plan.bytes_recv().get(rank, 0), "plan_lower_bound": plan.lower_bound().get(rank, 0),
            "whole": sorted(plan.reads.whole), "model_type": actor.hf_config().model_type, "route_counts": counts,
        }
    finally:
        rollout.close()
        del actor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rollout-tp", type=int, default=2)
    ap.add_argument("--actor-tp", type=int, default=1)
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    for path in args.models:
        res = one_family(path, args.rollout_tp, args.actor_tp)
        with open(os.path.join(args.out, f"{os.path.basename(path)}.rank{dist.get_rank()}.json"), "w") as f:
            json.dump(res, f)
        dist.barrier()
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
