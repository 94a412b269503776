"""Rollout routing replay on tiny MoE models (one after another in one process group), 2 ranks: real vLLM at
rollout TP = 2 records the experts it routes each token to; the batch goes the real way (rollout_to_batch,
redistribute to the actor's dp = 2); the FSDP2 actor's log-prob passes (forward_all, packed and padded) run without
and with replay. Then every trainer router is perturbed (a hook ahead of the replay hook shifts its top-k choice to
other experts) and both passes run again. Writes OUT/<model dir name>.rank{r}.json with, per case, the router
counts summed over the dp ranks and the largest |actor - vLLM| log-prob gap.

torchrun --nproc-per-node 2 router_replay.py OUT MODEL_DIR [MODEL_DIR ...]
"""
import json
import os
import sys

import torch
import torch.distributed as dist


def one_model(path: str, out: str) -> None:
    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.collectives import reduce_max, reduce_sum, redistribute
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine
    from spmdrl.engines.router_replay import moe_routers
    from spmdrl.loop.generate import rollout_to_batch
    from spmdrl.loop.update import forward_all
    from spmdrl.rollout import SamplingSpec, build_engine
    from spmdrl.rollout.routes import route_shape

    rank = dist.get_rank()
    layout = plan_layout(PlacementConfig(rollout_tp=2), 2)
    meshes = RoleMeshes(layout, rank, "cpu")
    actor = build_train_engine("fsdp", path, meshes["actor"], torch.device("cpu"), trainable=True, router_replay=True)
    rollout = build_engine("vllm", model_path=path, tp_size=2, tp_group=meshes["rollout"].my_tp_group(),
                           max_model_len=128, seed=0, kv_cache_gb=0.05, capture_routes=True)
    prompts = [[5, 40, 77, 12, 9], [6, 43, 77], [7, 8, 9, 10, 11, 12, 13]]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=10)
    res = rollout.generate(prompts, spec, [11, 12, 13])
    batch = rollout_to_batch(prompts, [0, 1, 2], res, spec.n, 0)
    computed = sum(len(prompts[i // spec.n]) + len(r) - 1 for i, r in enumerate(res.response_ids))  # positions vLLM ran
    batch = redistribute(batch, meshes["rollout"], meshes["actor"])
    shape = route_shape(actor.hf_config())
    dp = meshes["actor"].group("dp")

    def case(replay: bool, packed: bool) -> dict:
        actor.router.replay = replay
        lp = forward_all(actor, batch, 2, 0, "logprobs", packed=packed, route_shape=shape)
        mask = batch["response_mask"].bool()
        gap = float((lp - batch["rollout_log_probs"]).abs()[mask].max())
        counts = actor.moe_counts()
        summed = reduce_sum(torch.stack([counts["agree_own"], counts["agree_used"], counts["routed"]]), group=dp)
        return {"agree_own": float(summed[0]), "agree_used": float(summed[1]), "routed": float(summed[2]),
                "gap": float(reduce_max(torch.tensor([gap]), group=dp)[0])}

    result = {"routed_expected": computed * shape[0] * shape[1], "top_k": shape[1], "cases": {}}
    for replay in (False, True):
        for packed in (True, False):
            result["cases"][f"replay={replay},packed={packed}"] = case(replay, packed)
    experts = actor.router.num_experts

    def shift(module, args, output):  # the trainer's router picks the next experts instead of its own
        logits, weights, idx = output
        return logits, weights, (idx + 1) % experts

    for _, gate in moe_routers(actor.hf):
        gate.register_forward_hook(shift, prepend=True)
    for replay in (False, True):
        for packed in (True, False):
            result["cases"][f"perturbed,replay={replay},packed={packed}"] = case(replay, packed)
    with open(os.path.join(out, f"{os.path.basename(path)}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    rollout.close()


def main(out: str, *paths: str) -> int:
    dist.init_process_group("gloo")
    for path in paths:
        one_model(path, out)
        dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
