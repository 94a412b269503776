"""Checks of the Megatron engine on a tiny fp32 mixture of experts at one layout (--tp, --ep; pp 1, dp = world / tp),
in one torchrun run. Writes <out>/<name>.rank<r>.pt per model (name = the model directory's name) with:

  logprobs: {packed: logp [B, R]} of SEQS (every rank the whole batch), no routes;
  grads: {HF name: [(block, tensor)]}: the gradient of one train_step (lr 0) of the objective below, read just before
      the optimizer step, as this rank's HF blocks; metrics: its metrics (grad_norm); moe_losses: [(aux, z)] of each
      of this rank's micro-batches, read inside the loss;
  blocks_ok: every weight_shards block equals source_blocks()[name][rank] (several blocks of one name allowed);
  replay (--replay, first model only): {case: {"logprobs": [B, R], "counts": moe_counts()}} for routes = the HF model's own routing
      (ROUTES, written by the test): "own" (router_replay on), then with every router weight's rows rolled by one
      expert (the trainer's own top-k disagrees): "perturbed_off" (replay off) and "perturbed_on" (replay on);
      perturbed_router: the rolled router weights as HF blocks;
  resume_equal / load_equal / moved (--resume, first model only): a step, a checkpoint (spmdrl.checkpoint), a fresh engine loaded from
      it: its parameters and AdamW moments equal the saved ones bitwise, and one more step on both engines gives
      bitwise equal parameters and metrics (resume_check);
  host (--resume, first model only): the same for a bfloat16 engine with the host optimizer (float32 masters), plus
      its first step's masters before, clipped gradients, masters and parameters after;
and <out>/<name>.export (export_hf of the untouched engine; at tp > 1 a rank holds two blocks of each gate_up_proj,
which the export's transport sends from both).

Objective of the train_step (dp ranks split SEQS in halves, --micro micro-batches each, padded layout):
    L = sum_{b, j} c_bj * logp_bj / C + sum over (rank, micro-batch) of (A * aux + Z * z) / (dp * M)
with c = COEF (fixed random), C = sum c, aux / z the micro-batch's router terms (engine.moe_losses); at --pp > 1
without them (the router losses run at pp = 1), so moe_losses is empty.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_engine import hf_blocks  # noqa: E402

A, Z = 0.5, 2.0  # router loss coefficients of the objective


def seqs():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 300, (n,), generator=g) for n in (3, 5, 2, 4, 6, 2, 3, 4)]
    resps = [torch.randint(5, 300, (n,), generator=g) for n in (4, 1, 6, 3, 2, 5, 3, 4)]
    coef = [torch.rand(len(r), generator=g) + 0.5 for r in resps]
    return prompts, resps, coef


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--replay", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("models", nargs="+")
    args = p.parse_args()
    from spmdrl.checkpoint.manager import CheckpointManager
    from spmdrl.dist.init import init_distributed
    from spmdrl.dist.layout import ROLES, RoleLayout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine, pack_sequences

    env, device = init_distributed("cpu")
    W = env.world_size
    layouts = {r: RoleLayout(r, tuple(range(W)), W // (args.tp * args.pp), args.pp, args.tp, 1, args.ep) for r in ROLES}
    losses = args.pp == 1  # the router losses run at pp = 1
    mesh = RoleMeshes(layouts, env.rank, "cpu")["actor"]
    prompts, resps, coef = seqs()
    C = float(sum(c.sum() for c in coef))
    per = len(prompts) // mesh.dp_size
    mine = list(range(mesh.dp_rank * per, (mesh.dp_rank + 1) * per))
    size = per // args.micro
    micros = [mine[i: i + size] for i in range(0, per, size)]

    for model in args.models:
        name = os.path.basename(model.rstrip("/"))
        res = {}

        def engine(lr=0.0, **kw):
            return build_train_engine("megatron", model, mesh, device, trainable=True,
                                      optim=dict(lr=lr, weight_decay=0.01 if lr else 0.0, grad_clip=0.5 if lr else 0.0),
                                      **kw)

        eng = engine(router_losses=losses)
        res["logprobs"] = {packed: eng.logprobs(pack_sequences(prompts, resps, 0, packed=packed))[0].clone()
                           for packed in (False, True)}
        eng.moe_counts()
        shards = {}
        for n, t, b in eng.weight_shards():
            shards.setdefault(n, []).append((b, tuple(t.shape)))
        want = {}
        for n, bs in eng.source_blocks().items():
            want[n] = [(b, tuple(b[1])) for r, b in bs if r == env.rank]
        res["blocks_ok"] = {n: sorted(v) for n, v in shards.items()} == {n: sorted(v) for n, v in want.items() if v}
        eng.export_hf(os.path.join(args.out, f"{name}.export"))

        # ---- one train_step: gradients in HF coordinates, the router loss terms --------------------------------
        items = [(ids, pack_sequences([prompts[i] for i in ids], [resps[i] for i in ids], 0)) for ids in micros]
        res["moe_losses"] = []

        def loss_fn(item, e):
            ids, tb = item
            lp, _ = e.logprobs(tb)
            c = torch.zeros_like(lp)
            for row, i in enumerate(ids):
                c[row, : len(coef[i])] = coef[i]
            loss = mesh.dp_size * (c * lp).sum() / C
            if losses:
                aux, z = e.moe_losses()
                res["moe_losses"].append((float(aux.detach()), float(z.detach())))
                loss = loss + (A * aux + Z * z) / len(items)
            return loss, {"loss": loss.detach()}

        grads, clip = {}, eng.clip_grad_norm

        def capture():
            grads.update(hf_blocks(eng, lambda prm: prm.grad))
            return clip()

        eng.clip_grad_norm = capture
        res["metrics"] = eng.train_step(items, loss_fn)
        res["grads"] = grads
        eng.moe_counts()  # the update's routing: not compared

        # ---- routing replay ----------------------------------------------------------------------------------
        if args.replay and model == args.models[0]:
            routes = torch.load(os.path.join(args.out, f"{name}.routes.pt"))
            tb = pack_sequences(prompts, resps, 0, routes=routes)
            rep = engine(router_replay=True)
            res["replay"] = {}
            res["replay"]["own"] = {"logprobs": rep.logprobs(tb)[0].clone(), "counts": rep.moe_counts()}
            off = eng  # replay off; its lr-0 step left the weights as loaded
            for e in (rep, off):
                with torch.no_grad():
                    for n, prm in e.stage.named_parameters():
                        if n.endswith("mlp.router.weight"):
                            prm.copy_(prm.roll(1, dims=0))
            res["perturbed_router"] = {n: bs for n, bs in hf_blocks(rep, lambda prm: prm.data).items()
                                       if n.endswith("mlp.gate.weight")}
            for case, e in (("perturbed_off", off), ("perturbed_on", rep)):
                res["replay"][case] = {"logprobs": e.logprobs(tb)[0].clone(), "counts": e.moe_counts()}

        # ---- checkpoint: bitwise resume; the host optimizer's step and resume -------------------------------
        if args.resume and model == args.models[0]:
            def objective(item, e):
                ids, tb = item
                lp, _ = e.logprobs(tb)
                loss = mesh.dp_size * lp.sum() / C
                return loss, {"loss": loss.detach()}

            res.update(resume_check(lambda **kw: engine(lr=1e-2, **kw), items, objective, args.out, name, {}))
            host = resume_check(lambda **kw: engine(lr=1e-2, **kw), items, objective, args.out, name + ".host",
                                dict(host_optimizer=True, dtype="bfloat16"))
            res["host"] = host
        torch.save(res, os.path.join(args.out, f"{name}.rank{env.rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def resume_check(make, items, objective, out, name, kw) -> dict:
    """A step, a checkpoint, a fresh engine loaded from it: its parameters and AdamW state (masters too, for a
    host optimizer) equal the saved ones bitwise ("load_equal"), and one more step on both engines gives bitwise
    equal state and metrics ("resume_equal"); "moved": how far the steps moved the weights. With a host
    optimizer also the first step's inputs and outputs as HF blocks: "masters_before", "grads" (after clipping),
    "masters_after", "params_after"."""
    from spmdrl.checkpoint.manager import CheckpointManager

    def state(e):
        st, key = e.optimizer.state, getattr(e.optimizer, "master", lambda prm: prm)
        kinds = [lambda prm: prm.data, lambda prm: st[key(prm)]["exp_avg"], lambda prm: st[key(prm)]["exp_avg_sq"]]
        if hasattr(e.optimizer, "master"):
            kinds.append(e.optimizer.master)
        return [hf_blocks(e, of) for of in kinds]

    def same(x, y):
        return all(torch.equal(u[1], v[1]) for a, b in zip(x, y) for n in a for u, v in zip(a[n], b[n]))

    res = {}
    a = make(**kw)
    before = hf_blocks(a, lambda prm: prm.data)
    if hasattr(a.optimizer, "master"):
        res["masters_before"] = hf_blocks(a, a.optimizer.master)
        clip = a.clip_grad_norm

        def capture():
            norm = clip()
            res["grads"] = hf_blocks(a, lambda prm: prm.main_grad)
            return norm

        a.clip_grad_norm = capture
        res["first_metrics"] = a.train_step(items, objective)
        a.clip_grad_norm = clip
        res["masters_after"] = hf_blocks(a, a.optimizer.master)
        res["params_after"] = hf_blocks(a, lambda prm: prm.data)
    else:
        a.train_step(items, objective)
    root = os.path.join(out, f"{name}.ckpt")
    path = CheckpointManager(root, keep_last=1).save(1, engines={"actor": a}, trainer_state={"step": 1},
                                                     config_toml="", hf_files=lambda d: a.hf_config().save_pretrained(d))
    saved = state(a)
    b = make(**kw)
    CheckpointManager(root, keep_last=1).load(path, engines={"actor": b}, config_toml="")
    res["load_equal"] = same(saved, state(b))
    ma, mb = a.train_step(items, objective), b.train_step(items, objective)
    ok = torch.tensor([float(same(state(a), state(b)) and ma == mb)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    res["resume_equal"] = bool(ok)
    res["moved"] = max(float((x[1].float() - y[1].float()).abs().max()) for n, bs in state(a)[0].items()
                       for x, y in zip(bs, before[n]))
    return res


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
