"""One actor update and the advantage estimators on a fixed global batch, at whatever world size torchrun
gives (actor dp = world): writes the full gradients, logged metrics and advantages to <out>/layout_dp<W>_mb<M>.pt.

The optimizer runs with lr = 0, so every case starts from the same parameters; the gradient is read just
before the optimizer step (after FSDP's reduce-scatter over dp), as full tensors."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

CASES = [  # (policy_loss, loss_agg_mode)
    ("ppo", "token-mean"), ("ppo", "seq-mean-token-sum"), ("ppo", "seq-mean-token-mean"),
    ("ppo", "seq-mean-token-sum-norm"), ("gspo", "auto"), ("gmpo", "auto"), ("cispo", "token-mean"),
    ("sapo", "seq-mean-token-sum-norm"), ("gpg", "seq-mean-token-mean"),
]
RC_CASES = [  # [rollout_correction] (rollout_is, rollout_rs), with the PPO loss at token-mean and seq-mean-token-mean
    ("token", "none", "token-mean"), ("sequence", "geometric", "seq-mean-token-mean"),
]
RC = dict(rollout_is_threshold=1.2, rollout_rs_threshold=1.1, rollout_rs_threshold_lower=0.92)
DISTILL_CASES = [("k2", "token-mean"), ("k3", "seq-mean-token-mean")]  # distill.mode = kl_loss: (kl_type, mode)
ESTIMATORS = ["grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae", "remax",
              "grpo_passk", "opo", "gpg"]


def global_batch(B: int = 8, n: int = 2, seed: int = 0) -> dict:
    """The same batch on every rank: prompt-major groups of n, response lengths 1..7 (ragged widths)."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, 6, (B,), generator=g)
    rlen = torch.tensor([1, 7, 3, 5, 2, 6, 4, 7][:B])
    P, R = int(plen.max()), int(rlen.max())
    ar = torch.arange(R)[None]
    mask = (ar < rlen[:, None]).float()
    prompts = torch.randint(5, 300, (B, P), generator=g)
    responses = torch.randint(5, 300, (B, R), generator=g)
    rewards = torch.zeros(B, R)
    rewards[torch.arange(B), rlen - 1] = torch.randint(0, 3, (B,), generator=g).float()
    rewards = rewards + 0.1 * torch.randn(B, R, generator=g) * mask  # dense part: returns differ by token
    return {
        "prompts": prompts, "prompt_len": plen, "responses": responses, "response_len": rlen, "response_mask": mask,
        "advantages": torch.randn(B, R, generator=g) * mask,
        "old_log_probs": (-5.77 + 0.3 * torch.randn(B, R, generator=g)) * mask,
        "ref_log_probs": (-5.77 + 0.3 * torch.randn(B, R, generator=g)) * mask,
        "rollout_log_probs": None,  # filled below: old_log_probs plus a mismatch
        "token_level_rewards": rewards, "values": torch.randn(B, R, generator=g) * mask,
        "index": torch.arange(B // n).repeat_interleave(n), "baseline_rewards": torch.randn(B, generator=g),
        "teacher_log_probs": (-5.77 + 0.3 * torch.randn(B, R, generator=g)) * mask,  # distillation (drawn last)
    }


def with_rollout_log_probs(b: dict, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(b["old_log_probs"].shape, generator=g)
    b["rollout_log_probs"] = b["old_log_probs"] + 0.15 * noise * b["response_mask"]
    return b


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--micro", type=int, required=True)
    args = p.parse_args()
    from spmdrl.algos import ADV_ESTIMATORS, DISTILL_MODES, POLICY_LOSSES
    from spmdrl.algos.kl import controller_kl, kl_penalty
    from spmdrl.batch import Batch
    from spmdrl.config import Config
    from spmdrl.loop.correction import correct_rollout
    from spmdrl.dist.collectives import reduce_max, reduce_sum
    from spmdrl.dist.init import init_distributed
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines.fsdp import FSDPEngine
    from spmdrl.loop.update import ActorObjective, run_updates

    env, device = init_distributed("cpu")
    cfg = Config()
    layout = plan_layout(cfg.placement, env.world_size)
    mesh = RoleMeshes(layout, env.rank, "cpu")["actor"]
    dp_group = mesh.mesh.get_group("dp")
    full = with_rollout_log_probs(global_batch())
    B = len(full["index"])
    lo, hi = mesh.dp_rank * B // mesh.dp_size, (mesh.dp_rank + 1) * B // mesh.dp_size
    local = Batch({k: v[lo:hi] for k, v in full.items()})

    engine = FSDPEngine(args.model, mesh, device, trainable=True, optim=dict(lr=0.0, weight_decay=0.0, grad_clip=0.0))
    grads: dict = {}
    clip = engine.clip_grad_norm

    def capture():
        for name, prm in engine.hf.named_parameters():
            gr = prm.grad
            grads[name] = (gr.full_tensor() if isinstance(gr, DTensor) else gr).detach().clone()
        return clip()

    engine.clip_grad_norm = capture
    res = {"grads": {}, "metrics": {}, "adv": {}}
    for loss_name, mode in CASES:
        cfg.actor.policy_loss, cfg.actor.loss_agg_mode = loss_name, mode
        cfg.actor.entropy_coeff, cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef = 0.01, True, 0.1
        cfg.actor.kl_loss_type, cfg.data.max_response_length = "low_var_kl", 8
        body = ActorObjective(cfg, POLICY_LOSSES.get(loss_name), 1.0)
        m = run_updates(engine, local, epochs=1, mini_size=len(local), micro_size=args.micro, pad_id=0,
                        dp_size=mesh.dp_size, dp_group=dp_group, objective=body, prefix="actor")
        res["grads"][(loss_name, mode)] = dict(grads)
        res["metrics"][(loss_name, mode)] = m

    res["distill"] = {}  # the kl_loss mode's term on top of the PPO loss (entropy bonus and ref KL as above)
    for kl_type, mode in DISTILL_CASES:
        cfg.actor.policy_loss, cfg.actor.loss_agg_mode = "ppo", mode
        cfg.distill.mode, cfg.distill.kl_type, cfg.distill.coef = "kl_loss", kl_type, 0.3
        body = ActorObjective(cfg, POLICY_LOSSES.get("ppo"), 1.0, distill_fn=DISTILL_MODES.get("kl_loss"))
        m = run_updates(engine, local, epochs=1, mini_size=len(local), micro_size=args.micro, pad_id=0,
                        dp_size=mesh.dp_size, dp_group=dp_group, objective=body, prefix="actor")
        res["distill"][(kl_type, mode)] = {"grads": dict(grads), "metrics": m}

    def reduce(t):
        return reduce_sum(t, group=dp_group)

    res["rc"] = {}
    for is_level, rs_level, mode in RC_CASES:
        cfg.actor.policy_loss, cfg.actor.loss_agg_mode = "ppo", mode
        rc = cfg.rollout_correction
        rc.rollout_is, rc.rollout_rs = is_level, rs_level
        for k, v in RC.items():
            setattr(rc, k, v)
        batch, m_rc = correct_rollout(cfg, engine, local, None, reduce, lambda t: reduce_max(t, group=dp_group))
        body = ActorObjective(cfg, POLICY_LOSSES.get("ppo"), 1.0)
        m = run_updates(engine, batch, epochs=1, mini_size=len(batch), micro_size=args.micro, pad_id=0,
                        dp_size=mesh.dp_size, dp_group=dp_group, objective=body, prefix="actor")
        res["rc"][(is_level, rs_level, mode)] = {"grads": dict(grads), "metrics": {**m, **m_rc}}
    cfg.rollout_correction.rollout_is = cfg.rollout_correction.rollout_rs = "none"

    for name in ESTIMATORS:
        adv, ret = ADV_ESTIMATORS.get(name)(
            local["token_level_rewards"], local["response_mask"], index=local["index"], values=local["values"],
            baseline_rewards=local["baseline_rewards"], gamma=0.9, lam=0.8, reduce=reduce,
        )
        parts = [torch.zeros(B, adv.shape[1]) for _ in range(2)]
        for i, t in enumerate((adv, ret)):
            gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, t.contiguous())
            parts[i] = torch.cat(gathered)
        res["adv"][name] = tuple(parts)
    kl = kl_penalty(local["old_log_probs"], local["ref_log_probs"], "kl", response_mask=local["response_mask"])
    res["controller_kl"] = controller_kl(kl, local["response_mask"], reduce=reduce)
    if env.rank == 0:
        torch.save(res, os.path.join(args.out, f"layout_dp{env.world_size}_mb{args.micro}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
