"""Score samples with RewardModelScorer on every rank of a torchrun world. Reads <out>/inputs.json
({"samples": [...], "cases": [{"name", "rm", "tp", "split"}]}, split = sample indices per reward dp rank) and
writes <out>/scores_rank{r}.json ({case name: {"index": [...], "scores": [...]}})."""
import argparse
import json
import os


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.init import destroy_distributed, init_distributed
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.rewards.model import RewardModelScorer
    from spmdrl.tiny import build_tokenizer

    with open(os.path.join(args.out, "inputs.json")) as f:
        inputs = json.load(f)
    samples = inputs["samples"]
    env, device = init_distributed("cpu")
    policy_tok = build_tokenizer()
    res = {}
    for case in inputs["cases"]:
        layout = plan_layout(PlacementConfig(reward_tp=case["tp"]), env.world_size)
        mesh = RoleMeshes(layout, env.rank, device.type)["reward"]
        scorer = RewardModelScorer(case["rm"], mesh, device, policy_tokenizer=policy_tok, micro_batch_size=2)
        index = case["split"][mesh.dp_rank]
        mine = [samples[i] for i in index]
        scores = scorer.score([s["messages"] for s in mine], [s["response_text"] for s in mine],
                              [s["prompt_ids"] for s in mine], [s["response_ids"] for s in mine])
        res[case["name"]] = {"index": index, "scores": scores.tolist(), "dp": mesh.dp_size, "tp": mesh.tp_size}
    with open(os.path.join(args.out, f"scores_rank{env.rank}.json"), "w") as f:
        json.dump(res, f)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
