"""Checks of the Megatron engine at one layout (--tp, --pp; dp = world / (tp * pp)), in one torchrun run, on a
tiny fp32 HF model (Qwen2 / Qwen3). Writes <out>/rank<r>.pt with, per rank:

  logprobs: {(packed, temperature): (logp [B, R], entropy [B, R])} of a fixed batch (every rank the whole batch);
  trunc: {(packed, top_k, top_p): (logp, entropy)} of the same batch at temperature 0.7 with the sampler's truncation;
  forward_mb / values_mb: {packed: {"got": [per micro-batch tensors], "schedules": megatron schedule calls,
      "equal_per_call": bitwise equal to one logprobs / values call per micro-batch}} of forward_micro_batches over
      the fixed batch in 3 micro-batches of different shapes (sequences [0], [1, 2], [3]), temperature 0.7;
  grads: {loss_agg_mode: {HF name: [(block, tensor)]}}: the gradient of one PPO actor update (spmdrl.loop.update,
      lr 0) over the global batch of tests/dist_scripts/objective_layout.py, dp-sharded, micro-batches of --micro,
      read just before the optimizer step as HF blocks (this rank's pieces);
  metrics: {mode: run_updates' logged values};
  blocks_ok: every weight_shards block equals source_blocks()[name][rank];
  resume_equal: after checkpoint at step 1 (spmdrl.checkpoint), step 2 of the running engine and step 2 of a fresh
      engine loaded from that checkpoint give bitwise equal parameters (AdamW, weight decay, grad clipping); the
      fresh engine parks and unparks all its state (offload_round_trip) between the load and its step, so this
      and step_metrics_equal (its step's metrics == the running engine's) also check that the round trip is exact;
  held_before / held_parked / held_after: bytes held by (params, optimizer state, grad buffers) around that round
      trip; offload_logprobs_equal / offload_state_equal: log-probs / parameters and AdamW moments before and
      after it are bitwise equal;
  values / critic_metrics / critic_grads: a critic (value head) engine's values of the fixed batch and one
      token-mean value-loss update (lr 0), gradients as HF blocks;
  nan_injection: the metrics of an update after inject_fault("nan") (SPMDRL_FAULT_INJECT) and of the next one, and
      whether the first left every weight bitwise unchanged;
and the directories <out>/critic_export (the critic as an HF token-classification model), <out>/export (export_hf of the untouched engine), <out>/ckpt (the checkpoint) and
<out>/export_step1 (export_hf right after step 1, to compare with `spmdrl export` of the checkpoint).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from objective_layout import global_batch  # noqa: E402

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TRUNC = [(-1, 0.9), (160, 1.0), (160, 0.9)]  # (top_k, top_p) of the sampler, at temperature 0.7
ALL_KINDS = ("params", "grads", "optimizer")


def watch_unpark(engine) -> set:
    """The kinds the engine's host stash unparks from now on (recorded while it still unparks them)."""
    seen, real = set(), engine._stash.unpark

    def unpark(kind):
        if engine._stash.parked(kind):
            seen.add(kind)
        real(kind)

    engine._stash.unpark = unpark
    return seen


def fixed_batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (n,), generator=g) for n in (3, 5, 2, 4)]
    resps = [torch.randint(5, 300, (n,), generator=g) for n in (4, 1, 6, 3)]
    return prompts, resps


def hf_blocks(engine, of):
    """{HF name: [(block, tensor)]} of this rank's pieces of `of(param)` (a param-shaped tensor)."""
    from spmdrl.engines.megatron.convert import merged_blocks

    out = {}
    for _, p, pieces in engine._local_params():
        src = of(p)
        if src is None:
            continue
        for name, block, pcs in merged_blocks(pieces):
            t = torch.empty(block[1], dtype=src.dtype)
            for pc in pcs:  # each piece where its HF block lies in the merged block
                at = tuple(slice(o - b, o - b + n) for o, n, b in zip(pc.block[0], pc.block[1], block[0]))
                t[at] = src[pc.rows[0]: pc.rows[1]].reshape(pc.block[1])
            out.setdefault(name, []).append((block, t.detach().clone()))
    return out


def state_tensors(e) -> tuple[list, list, list]:
    """The engine's parameters, AdamW moments and DDP grad buffers."""
    from spmdrl.engines.megatron.offload import torch_optimizers

    moments = [v for o in torch_optimizers(e.optimizer) for st in o.state.values() for v in st.values() if v.dim() > 0]
    return list(e.stage.parameters()), moments, [b.grad_data for b in e.model.buffers]


def state_bytes(e) -> tuple[int, int, int]:
    """Bytes now held by the storages of state_tensors."""
    from spmdrl.engines.base import unique_storages

    return tuple(sum(st.nbytes() for st in unique_storages(ts)) for ts in state_tensors(e))


def offload_round_trip(e, tb, res):
    """The engine's park / unpark (what offload / onload run on CUDA), in the memory lifecycle's order: optimizer and
    grads out (for_sync), then everything (for_rollout, the kinds already out are skipped), then all back twice."""
    before = e.logprobs(tb, temperature=0.7, with_entropy=True)
    params, moments, _ = state_tensors(e)
    values = [t.detach().clone() for t in params + moments]
    res["held_before"] = state_bytes(e)
    e._park(("optimizer", "grads"))
    e._park(ALL_KINDS)
    res["held_parked"] = state_bytes(e)
    e._unpark(ALL_KINDS)
    e._unpark(ALL_KINDS)
    res["held_after"] = state_bytes(e)
    after = e.logprobs(tb, temperature=0.7, with_entropy=True)
    res["offload_logprobs_equal"] = all(torch.equal(x, y) for x, y in zip(before, after))
    res["offload_state_equal"] = all(torch.equal(x, y) for x, y in zip(values, params + moments))


SPLIT = [(0, 1), (1, 3), (3, 4)]  # micro-batches of the fixed batch for forward_micro_batches


def forward_mb(engine, prompts, resps, head, **kw):
    """forward_micro_batches over SPLIT (one call), its megatron schedule count, and whether it equals one
    logprobs / values call per micro-batch bitwise."""
    import megatron.core.pipeline_parallel as mpp

    from spmdrl.engines import pack_sequences

    out = {}
    for packed in (False, True):
        tbs = [pack_sequences(prompts[a:b], resps[a:b], 0, packed=packed) for a, b in SPLIT]
        calls, real = [0], mpp.get_forward_backward_func

        def counting(*a, **k):
            calls[0] += 1
            return real(*a, **k)

        mpp.get_forward_backward_func = counting
        try:
            got = engine.forward_micro_batches(tbs, head, **kw)
        finally:
            mpp.get_forward_backward_func = real
        per = [engine.logprobs(tb, **kw)[0] if head == "logprobs" else engine.values(tb) for tb in tbs]
        out[packed] = {"got": [g.clone() for g in got], "schedules": calls[0],
                       "equal_per_call": all(torch.equal(g, q) for g, q in zip(got, per))}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--skip-resume", action="store_true")
    p.add_argument("--recompute", nargs="?", const="full", default="",
                   help="trainable engines with model.gradient_checkpointing and this checkpoint_policy (full | selective)")
    p.add_argument("--attention", default="sdpa", help="sdpa | local (megatron's DotProductAttention)")
    args = p.parse_args()
    from spmdrl.algos import POLICY_LOSSES
    from spmdrl.batch import Batch
    from spmdrl.checkpoint.manager import CheckpointManager
    from spmdrl.config import Config
    from spmdrl.dist.init import init_distributed
    from spmdrl.dist.layout import ROLES, RoleLayout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine, pack_sequences
    from spmdrl.loop.update import ActorObjective, CriticObjective, run_updates

    env, device = init_distributed("cpu")
    W = env.world_size
    dp = W // (args.tp * args.pp)
    layouts = {r: RoleLayout(r, tuple(range(W)), dp, args.pp, args.tp) for r in ROLES}
    mesh = RoleMeshes(layouts, env.rank, "cpu")["actor"]
    res = {}

    def engine(lr=0.0, weight_decay=0.0, grad_clip=0.0):
        return build_train_engine("megatron", args.model, mesh, device, trainable=True,
                                  gradient_checkpointing=bool(args.recompute), checkpoint_policy=args.recompute or "full", attention=args.attention, optim=dict(lr=lr, weight_decay=weight_decay, grad_clip=grad_clip))

    eng = engine()
    # the configuration a GPU gets (sequence parallelism with tp > 1, the spec's norms): checked by the test
    res["config"] = {"sequence_parallel": eng.tcfg.sequence_parallel,
                     "norms": sorted({(type(m).__name__, bool(getattr(m.weight, "sequence_parallel", False)))
                                      for n, m in eng.stage.named_modules()
                                      if n.endswith("layernorm") and hasattr(m, "weight")}),
                     "recompute": eng.tcfg.recompute_granularity,
                     "core_attention_checkpointed": sorted({m.checkpoint_core_attention for m in eng.stage.modules()
                                                            if hasattr(m, "checkpoint_core_attention")}),
                     # Qwen3's q / k norms (without qk_layernorm those names are weightless IdentityOps)
                     "qk_norms": sum(n.endswith(("q_layernorm", "k_layernorm")) and hasattr(m, "weight")
                                     for n, m in eng.stage.named_modules())}
    prompts, resps = fixed_batch()
    res["logprobs"] = {}
    for packed in (False, True):
        tb = pack_sequences(prompts, resps, 0, packed=packed)
        for temp in (1.0, 0.7):
            lp, ent = eng.logprobs(tb, temperature=temp, with_entropy=True, chunk_size=3)
            res["logprobs"][(packed, temp)] = (lp.clone(), ent.clone())

    res["trunc"] = {}  # log-probs / entropy of the sampler's truncated distribution (vocabulary gathered over tp)
    for packed in (False, True):
        tb = pack_sequences(prompts, resps, 0, packed=packed)
        for k, top_p in TRUNC:
            lp, ent = eng.logprobs(tb, temperature=0.7, with_entropy=True, chunk_size=3, top_k=k, top_p=top_p)
            res["trunc"][(packed, k, top_p)] = (lp.clone(), ent.clone())

    res["forward_mb"] = forward_mb(eng, prompts, resps, "logprobs", temperature=0.7, chunk_size=3)

    shards = {n: (t, b) for n, t, b in eng.weight_shards()}
    mine = {n: dict(bs)[env.rank] for n, bs in eng.source_blocks().items() if env.rank in dict(bs)}
    res["blocks_ok"] = set(shards) == set(mine) and all(
        shards[n][1] == mine[n] and tuple(shards[n][0].shape) == tuple(mine[n][1]) for n in shards)
    eng.export_hf(os.path.join(args.out, "export"))

    # ---- one PPO update per aggregation mode: gradients as HF blocks --------------------------------------
    cfg = Config()
    full = {k: v for k, v in global_batch().items() if v is not None}  # rollout_log_probs: None (no correction)
    B = len(full["index"])
    per = B // mesh.dp_size
    local = Batch({k: v[mesh.dp_rank * per: (mesh.dp_rank + 1) * per] for k, v in full.items() if v is not None})
    grads, clip = {}, eng.clip_grad_norm

    def capture():
        grads.update(hf_blocks(eng, lambda prm: prm.grad))
        return clip()

    eng.clip_grad_norm = capture
    res["grads"], res["metrics"] = {}, {}
    for mode in MODES:
        cfg.actor.policy_loss, cfg.actor.loss_agg_mode = "ppo", mode
        cfg.actor.entropy_coeff, cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef = 0.01, True, 0.1
        cfg.actor.kl_loss_type, cfg.data.max_response_length = "low_var_kl", 8
        body = ActorObjective(cfg, POLICY_LOSSES.get("ppo"), 1.0)
        grads.clear()
        m = run_updates(eng, local, epochs=1, mini_size=len(local), micro_size=args.micro, pad_id=0,
                        dp_size=mesh.dp_size, dp_group=mesh.group("dp"), objective=body, prefix="actor")
        res["grads"][mode] = dict(grads)
        res["metrics"][mode] = m

    # ---- a critic (value head on the last stage): values, export, one value-loss update --------------------
    critic = build_train_engine("megatron", args.model, mesh, device, trainable=True, value_head=True,
                                gradient_checkpointing=bool(args.recompute), checkpoint_policy=args.recompute or "full", attention=args.attention,
                                optim=dict(lr=0.0, weight_decay=0.0, grad_clip=0.0))
    res["values"] = {packed: critic.values(pack_sequences(prompts, resps, 0, packed=packed)).clone()
                     for packed in (False, True)}
    res["values_mb"] = forward_mb(critic, prompts, resps, "values")
    critic.export_hf(os.path.join(args.out, "critic_export"))
    cgrads, cclip = {}, critic.clip_grad_norm

    def ccapture():
        cgrads.update(hf_blocks(critic, lambda prm: prm.grad))
        return cclip()

    critic.clip_grad_norm = ccapture
    cfg.critic.cliprange_value, cfg.critic.loss_agg_mode = 0.5, "token-mean"
    returns = (full["values"] + full["advantages"])[mesh.dp_rank * per: (mesh.dp_rank + 1) * per]
    res["critic_metrics"] = run_updates(critic, Batch({**local.tensors, "returns": returns}), epochs=1,
                                        mini_size=len(local), micro_size=args.micro, pad_id=0, dp_size=mesh.dp_size,
                                        dp_group=mesh.group("dp"), objective=CriticObjective(cfg), prefix="critic")
    res["critic_grads"] = {"token-mean": dict(cgrads)}

    # ---- checkpoint + bitwise resume ------------------------------------------------------------------------
    if not args.skip_resume:
        cfg.actor.loss_agg_mode = "token-mean"
        body = ActorObjective(cfg, POLICY_LOSSES.get("ppo"), 1.0)

        def step(e):
            return run_updates(e, local, epochs=1, mini_size=len(local), micro_size=args.micro, pad_id=0,
                               dp_size=mesh.dp_size, dp_group=mesh.group("dp"), objective=body, prefix="actor")

        a = engine(lr=1e-2, weight_decay=0.01, grad_clip=0.5)
        step(a)
        root = os.path.join(args.out, "ckpt")
        mgr = CheckpointManager(root, keep_last=1)
        # save and load with every kind parked, as a GPU run's memory lifecycle leaves them: the manager brings
        # back params and optimizer state only (never the gradients) and parks them again
        a._park(ALL_KINDS)
        unparked = watch_unpark(a)
        path = mgr.save(1, engines={"actor": a}, trainer_state={"step": 1}, config_toml="",
                        hf_files=lambda d: a.hf_config().save_pretrained(d))
        res["ckpt_save"] = {"unparked": sorted(unparked), "parked_after": [k for k in ALL_KINDS if a._stash.parked(k)]}
        a._unpark(ALL_KINDS)
        a.export_hf(os.path.join(args.out, "export_step1"))
        at_save = hf_blocks(a, lambda prm: prm.data)
        want_metrics = step(a)
        want = hf_blocks(a, lambda prm: prm.data)
        b = engine(lr=1e-2, weight_decay=0.01, grad_clip=0.5)
        b._park(ALL_KINDS)
        unparked = watch_unpark(b)
        CheckpointManager(root, keep_last=1).load(path, engines={"actor": b}, config_toml="")
        res["ckpt_load"] = {"unparked": sorted(unparked), "parked_after": [k for k in ALL_KINDS if b._stash.parked(k)]}
        b._unpark(ALL_KINDS)
        loaded = hf_blocks(b, lambda prm: prm.data)
        res["load_differs"] = sorted({n for n in at_save for x, y in zip(at_save[n], loaded[n]) if not torch.equal(x[1], y[1])})
        offload_round_trip(b, pack_sequences(prompts, resps, 0), res)  # then the next step must still equal a's
        res["step_metrics_equal"] = step(b) == want_metrics
        got = hf_blocks(b, lambda prm: prm.data)
        res["resume_differs"] = sorted({n for n in want for x, y in zip(want[n], got[n]) if not torch.equal(x[1], y[1])})
        ok = torch.tensor([float(not res["resume_differs"])])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        res["resume_equal"] = bool(ok)
        res["moved"] = max(float((x[1] - y[1]).abs().max()) for n in want
                           for x, y in zip(want[n], hf_blocks(eng, lambda prm: prm.data)[n]))

        # ---- SPMDRL_FAULT_INJECT=nan through the engine protocol: the next update is skipped, the one after runs
        from spmdrl.faults import inject_fault

        before = hf_blocks(a, lambda prm: prm.data)
        inject_fault("nan", env.rank, 3, a)
        poisoned = step(a)
        now = hf_blocks(a, lambda prm: prm.data)
        kept = all(torch.equal(x[1], y[1]) for n in before for x, y in zip(before[n], now[n]))
        clean = step(a)
        res["nan_injection"] = {"poisoned": poisoned, "kept": kept, "clean": clean}
    torch.save(res, os.path.join(args.out, f"rank{env.rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
