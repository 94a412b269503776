"""One actor update on 2 ranks (FSDP2, gloo) under several micro-batch layouts; rank 0 saves the full
gradients each layout produced. python -m torch.distributed.run --nproc-per-node 2 packed_update.py MODEL OUT

The global batch: 16 samples with prompt lengths 3-12 and response lengths 1-40 (seeded); rank r holds
samples 8r..8r+7. The optimizer step is replaced by a recorder of the (unclipped) gradients, so every
layout starts from the same parameters.
"""
import sys

import torch
import torch.distributed as dist

from spmdrl.algos import POLICY_LOSSES
from spmdrl.batch import Batch
from spmdrl.config import load_config
from spmdrl.dist.layout import plan_layout
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.engines.fsdp import FSDPEngine
from spmdrl.loop.update import ActorObjective, run_updates

LAYOUTS = {  # name: (micro_batch_size, max_tokens_per_micro_batch, use_packing)
    "padded_one_micro": (8, 0, False),
    "padded_two_micro": (4, 0, False),
    "packed_token_budget": (8, 60, True),
    "padded_token_budget": (8, 60, False),
}


def global_batch(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(3, 13, (n,), generator=g)
    rlen = torch.randint(1, 41, (n,), generator=g)
    P, R = int(plen.max()), int(rlen.max())
    mask = (torch.arange(R)[None] < rlen[:, None]).float()
    return Batch({
        "prompts": torch.randint(3, 300, (n, P), generator=g), "prompt_len": plen,
        "responses": torch.randint(3, 300, (n, R), generator=g) * mask.long(), "response_len": rlen,
        "response_mask": mask, "advantages": torch.randn(n, R, generator=g) * mask, "rollout_log_probs": torch.zeros(n, R),
    })


def main():
    model, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = load_config(None, [f"model.path={model}", "actor.grad_clip=0", "actor.loss_agg_mode=token-mean"])
    mesh = RoleMeshes(plan_layout(cfg.placement, 2), rank, "cpu")["actor"]
    eng = FSDPEngine(model, mesh, torch.device("cpu"), trainable=True, optim=dict(lr=1e-3, grad_clip=0.0))
    recorded = {}
    eng.optimizer.step = lambda *a, **k: recorded.update(
        {n: p.grad.full_tensor().clone() for n, p in eng.hf.named_parameters() if p.grad is not None})
    local = global_batch().select(list(range(8 * rank, 8 * rank + 8)))
    body = ActorObjective(cfg, POLICY_LOSSES.get("ppo"), 1.0)
    result = {}
    for name, (micro, budget, packed) in LAYOUTS.items():
        recorded.clear()
        run_updates(eng, local, epochs=1, mini_size=8, micro_size=micro, pad_id=0, dp_size=2,
                    dp_group=mesh.mesh.get_group("dp"), objective=body, prefix="actor", max_tokens=budget, packed=packed)
        result[name] = dict(recorded)
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
