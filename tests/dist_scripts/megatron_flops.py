"""One Megatron actor update (spmdrl.loop.update.run_updates, one micro-batch) of a tiny fp32 Qwen2 in one
plain process (world size 1), under torch's FLOP counter, padded and packed. Megatron's own attention
(attention="local": baddbmm / bmm over the dense [sq, sk] scores, which the counter sees; CPU SDPA's fused
kernel it does not). Prints one JSON object: {"padded" | "packed": {"flops": total counted, "rows", "width",
"lengths", "response_lengths"}}."""
import argparse
import json
import os

import torch
from torch.utils.flop_counter import FlopCounterMode


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    args = p.parse_args()
    os.environ.setdefault("MASTER_PORT", "29533")
    from spmdrl.algos import POLICY_LOSSES
    from spmdrl.batch import Batch
    from spmdrl.config import Config
    from spmdrl.dist.init import init_distributed
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine
    from spmdrl.loop.update import ActorObjective, run_updates

    env, device = init_distributed("cpu")
    cfg = Config()
    mesh = RoleMeshes(plan_layout(cfg.placement, env.world_size), env.rank, "cpu")["actor"]
    eng = build_train_engine("megatron", args.model, mesh, device, trainable=True, attention="local",
                             optim=dict(lr=0.0, weight_decay=0.0, grad_clip=0.0))
    plens, rlens = [5, 12, 7, 30, 2, 9], [20, 3, 40, 9, 1, 17]
    B, P, R = len(plens), max(plens), max(rlens)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(5, 300, (B, P), generator=g) * (torch.arange(P)[None] < torch.tensor(plens)[:, None])
    rmask = (torch.arange(R)[None] < torch.tensor(rlens)[:, None]).float()
    batch = Batch({"prompts": prompts, "prompt_len": torch.tensor(plens),
                   "responses": torch.randint(5, 300, (B, R), generator=g) * rmask.long(),
                   "response_len": torch.tensor(rlens), "response_mask": rmask,
                   "advantages": torch.randn(B, R, generator=g) * rmask, "old_log_probs": torch.zeros(B, R),
                   "index": torch.arange(B)})
    cfg.data.max_response_length = R
    body = ActorObjective(cfg, POLICY_LOSSES.get(cfg.actor.policy_loss), 1.0)
    lens = [a + b for a, b in zip(plens, rlens)]
    out = {}
    for packed in (False, True):
        with FlopCounterMode(display=False) as fc:
            run_updates(eng, batch, epochs=1, mini_size=B, micro_size=B, pad_id=0, dp_size=1,
                        dp_group=mesh.group("dp"), objective=body, prefix="actor", packed=packed)
        # packed: one row of every token, which megatron runs with the batch's dense [1, 1, T, T] block mask
        rows, width = (1, sum(lens)) if packed else (B, max(lens))
        out["packed" if packed else "padded"] = {"flops": fc.get_total_flops(), "rows": rows, "width": width,
                                                 "lengths": lens, "response_lengths": rlens}
    print("FLOPS " + json.dumps(out))


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
