"""Bitwise resume of the Megatron engine on CUDA (megatron's distributed optimizer, bf16 params with float32
master weights) at world 1 (dp = tp = pp = 1). Run under torchrun --nproc-per-node 1 by tests/gpu/test_gpu_megatron.py.

Engine A (AdamW with weight decay, grad clipping, a 3-step linear warm-up so the LR scheduler's position
matters) takes 2 PPO steps, is checkpointed through spmdrl's CheckpointManager, exported (its own export_hf)
and takes step 3. Engine B, fresh from the HF model, loads the checkpoint and takes step 3. Writes
<out>/result.pt: the fusion flags the engine was built with, the bf16 parameters and float32 master weights of both after step 3, both right after the
save / load, both step-3 metrics; <out>/ckpt holds the checkpoint, <out>/export_step2 the engine's export.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_engine import hf_blocks  # noqa: E402
from objective_layout import global_batch  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from spmdrl.algos import POLICY_LOSSES
    from spmdrl.batch import Batch
    from spmdrl.checkpoint.manager import CheckpointManager
    from spmdrl.config import Config
    from spmdrl.dist.init import init_distributed
    from spmdrl.dist.layout import ROLES, RoleLayout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine
    from spmdrl.engines.megatron import dist_optim
    from spmdrl.loop.update import ActorObjective, run_updates

    # the comparison is of two runs of step 3 in this process: keep cuBLAS / atomics from reordering sums
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # deterministic mode would NaN-fill torch.empty
    env, device = init_distributed("cuda")
    assert env.world_size == 1
    mesh = RoleMeshes({r: RoleLayout(r, (0,), 1, 1, 1) for r in ROLES}, env.rank, "cuda")["actor"]

    def engine():
        return build_train_engine("megatron", args.model, mesh, device, trainable=True, dtype="bfloat16",
                                  total_steps=10, optim=dict(lr=1e-3, weight_decay=0.01, grad_clip=0.5,
                                                             warmup_steps=3, lr_scheduler="cosine"))

    cfg = Config()
    cfg.actor.policy_loss, cfg.actor.loss_agg_mode, cfg.data.max_response_length = "ppo", "token-mean", 8
    body = ActorObjective(cfg, POLICY_LOSSES.get("ppo"), 1.0)
    batch = Batch({k: v for k, v in global_batch().items() if v is not None})  # rollout_log_probs: None

    def step(e):
        return run_updates(e, batch, epochs=1, mini_size=len(batch), micro_size=4, pad_id=0, dp_size=1,
                           dp_group=mesh.group("dp"), objective=body, prefix="actor")

    def state(e):
        main = {n: [(pc.block, t.detach().clone()) for pc, t in pairs]
                for n, pairs in dist_optim.views(e)["main"].items()}
        return {"params": hf_blocks(e, lambda prm: prm.data), "main": main}

    a = engine()
    assert type(dist_optim.distributed_optimizer(a.optimizer)).__name__ == "DistributedOptimizer"
    from spmdrl.engines.megatron.model import fused_kernels, fusion_flags

    fusions = fusion_flags(device, a.use_te, True, fused_kernels())  # what this machine's kernels allow
    initial = state(a)
    step(a)
    step(a)
    root = os.path.join(args.out, "ckpt")
    path = CheckpointManager(root, keep_last=1, device=device).save(
        2, engines={"actor": a}, trainer_state={"step": 2}, config_toml="",
        hf_files=lambda d: a.hf_config().save_pretrained(d))
    a.export_hf(os.path.join(args.out, "export_step2"))
    res = {"initial": initial, "saved": state(a), "lr_saved": a.scheduler.get_last_lr()[0],
           "fusions": {f: getattr(a.tcfg, f) for f in fusions}, "fusions_allowed": fusions}
    res["metrics_a"] = step(a)
    res["after_a"] = state(a)

    b = engine()
    CheckpointManager(root, keep_last=1, device=device).load(path, engines={"actor": b}, config_toml="")
    res["loaded"] = state(b)
    res["lr_loaded"] = b.scheduler.get_last_lr()[0]
    res["metrics_b"] = step(b)
    res["after_b"] = state(b)
    res["path"] = path
    torch.save(res, os.path.join(args.out, "result.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
