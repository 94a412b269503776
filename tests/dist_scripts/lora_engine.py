"""LoRA on the FSDP2 engine with real PEFT, on N ranks (dp = N): what is trained, the reference policy, bitwise
resume through CheckpointManager, and the exported adapter. Rank 0 writes <out>/lora.json (each check's
result, computed over all ranks where it is a per-rank fact)."""
import argparse
import json
import os

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from safetensors.torch import load_file

    from spmdrl.checkpoint import CheckpointManager
    from spmdrl.config import Config
    from spmdrl.dist.init import init_distributed
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine, pack_sequences
    from spmdrl.models.lora import LoraSettings, checkpoint_name, is_adapter

    env, device = init_distributed("cpu")
    torch.manual_seed(0)
    mesh = RoleMeshes(plan_layout(Config().placement, env.world_size), env.rank, "cpu")["actor"]
    settings = LoraSettings(rank=4, alpha=8, target_modules=[], seed=3)

    def engine():
        return build_train_engine("fsdp", args.model, mesh, device, trainable=True, lora=settings,
                                  optim=dict(lr=1e-2, weight_decay=0.01, grad_clip=1.0), total_steps=10)

    g = torch.Generator().manual_seed(1)  # the same batch on every rank
    prompts = [torch.randint(3, 60, (n,), generator=g) for n in (5, 9, 3, 7)]
    responses = [torch.randint(3, 60, (n,), generator=g) for n in (6, 2, 8, 4)]
    tb = pack_sequences(prompts, responses, pad_id=0)
    adv = torch.randn(tb.resp_ids.shape, generator=g)

    def loss_fn(mb, eng):
        lp, _ = eng.logprobs(mb)
        return -(lp * adv * mb.resp_mask).sum() / mb.resp_mask.sum(), {"n": 1.0}

    def logprobs(eng):
        eng.eval()
        with torch.no_grad():
            return eng.logprobs(tb)[0]

    def all_ranks(ok: bool) -> bool:
        t = torch.tensor([float(ok)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    res = {}
    base = build_train_engine("fsdp", args.model, mesh, device, trainable=False)  # the base model, no adapters
    want_ref = logprobs(base)
    a = engine()
    res["target_modules"] = a.lora.target_modules
    at_start = logprobs(a)
    res["start_is_base"] = all_ranks(torch.equal(at_start, want_ref))  # B = 0

    # ---- what is trained: gradients and optimizer state on adapters only -----------------------------------
    a.module.train()
    loss, _ = loss_fn(tb, a)
    loss.backward()
    with_grad = sorted(n for n, q in a.hf.named_parameters() if q.grad is not None)
    res["grads_only_adapters"] = all_ranks(bool(with_grad) and all(is_adapter(n) for n in with_grad))
    res["n_with_grad"] = len(with_grad)
    res["n_adapter_params"] = sum(is_adapter(n) for n, _ in a.hf.named_parameters())
    a.optimizer.zero_grad(set_to_none=True)
    res["frozen_dtypes"] = sorted({str(q.dtype) for n, q in a.hf.named_parameters() if not is_adapter(n)})
    for _ in range(2):
        a.train_step([tb], loss_fn)
    by_id = {id(q): n for n, q in a.hf.named_parameters()}
    state_names = [by_id[id(q)] for q in a.optimizer.state]
    res["optimizer_state_only_adapters"] = all_ranks(
        len(state_names) == res["n_adapter_params"] and all(is_adapter(n) for n in state_names))
    res["optimizer_params"] = sum(len(gr["params"]) for gr in a.optimizer.param_groups)

    # ---- the base is bitwise unchanged, and the adapters disabled are exactly the base model -----------------
    files = {}
    for f in sorted(os.listdir(args.model)):
        if f.endswith(".safetensors"):
            files.update(load_file(os.path.join(args.model, f)))
    base_changed = []
    for n, q in a.hf.named_parameters():
        if not is_adapter(n):
            full = q.full_tensor() if hasattr(q, "full_tensor") else q
            if not torch.equal(full.detach().cpu(), files[checkpoint_name(n)]):
                base_changed.append(n)
    res["base_changed"] = base_changed
    # the weights out (param_shapes, source_blocks, full_state_dict): the base model's under HF names, no adapters
    res["param_shapes_are_base"] = a.param_shapes() == base.param_shapes() and a.source_blocks() == base.source_blocks()
    mine, theirs = a.full_state_dict(), base.full_state_dict()
    res["weight_shards_are_base"] = all_ranks(list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine))
    trained = logprobs(a)
    res["trained_moved"] = float((trained - want_ref).abs().max())
    with a.adapters_disabled():
        ref = logprobs(a)
        res["grad_flags_kept"] = all(q.requires_grad == is_adapter(n) for n, q in a.hf.named_parameters())
    res["ref_equals_base"] = all_ranks(torch.equal(ref, want_ref))
    res["enabled_again"] = all_ranks(torch.equal(logprobs(a), trained))

    # ---- checkpoint: adapters + optimizer state only; resume is bitwise ---------------------------------------
    root = os.path.join(args.out, "ckpt")
    path = CheckpointManager(root, keep_last=1).save(2, engines={"actor": a}, trainer_state={"step": 2}, config_toml="",
                                                     hf_files=lambda d: a.hf_config().save_pretrained(d))
    tensors, _ = a.checkpoint_state()
    res["saved_model_keys_adapters"] = all(is_adapter(k) for k in tensors["model"])
    res["saved_optim_keys_adapters"] = all(is_adapter(k) for k in tensors["optim"])
    with open(os.path.join(path, "manifest.json")) as f:
        res["manifest_adapter"] = json.load(f)["engines"]["actor"].get("adapter")
    res["adapter_tensors"] = {n: list(t.shape) for n, t in a.adapter_tensors()}
    exported = {n: t for n, t in a.adapter_tensors()}
    a.export_hf(os.path.join(args.out, "engine_export"))  # the engine's own export: a PEFT adapter directory
    a.train_step([tb], loss_fn)
    want_next = logprobs(a)
    b = engine()
    CheckpointManager(root, keep_last=1).load(path, engines={"actor": b}, config_toml="")
    res["loaded_adapters_equal"] = all_ranks(all(torch.equal(exported[n], t) for n, t in b.adapter_tensors()))
    b.train_step([tb], loss_fn)
    res["resume_bitwise"] = all_ranks(torch.equal(logprobs(b), want_next)
                                      and all(torch.equal(x, y) for (_, x), (_, y) in zip(a.adapter_tensors(), b.adapter_tensors())))
    # ---- the Learner's reference log-probs: the actor with its adapters disabled (no ref engine) ---------------
    from spmdrl.algos.kl import FixedKLController
    from spmdrl.batch import Batch
    from spmdrl.loop.learner import Learner

    def padded(seqs):
        out = torch.zeros(len(seqs), max(len(x) for x in seqs), dtype=torch.long)
        for i, x in enumerate(seqs):
            out[i, : len(x)] = x
        return out

    batch = Batch({"prompts": padded(prompts), "responses": padded(responses),
                   "prompt_len": torch.tensor([len(x) for x in prompts]),
                   "response_len": torch.tensor([len(x) for x in responses])})
    meshes = RoleMeshes(plan_layout(Config().placement, env.world_size), env.rank, "cpu")
    learner = Learner(Config(), meshes, b, None, None, FixedKLController(0.0), pad_id=0)
    res["learner_ref_is_base"] = all_ranks(torch.equal(learner.ref_logprobs(batch), want_ref))
    res["learner_actor_is_adapted"] = all_ranks(torch.equal(learner.logprobs(b, batch), logprobs(b)))

    # ---- a LoRA critic: adapters and its value head train, nothing else ---------------------------------------
    critic = build_train_engine("fsdp", args.model, mesh, device, trainable=True, value_head=True, lora=settings,
                                optim=dict(lr=1e-2), total_steps=10)
    critic.module.train()
    (critic.values(tb) ** 2).sum().backward()
    with_grad = sorted(n for n, q in critic.hf.named_parameters() if q.grad is not None)
    res["critic_trained"] = sorted({n if not is_adapter(n) else "adapter" for n in with_grad})
    res["critic_optimizer_params"] = sum(len(gr["params"]) for gr in critic.optimizer.param_groups)
    res["critic_manifest"] = len(critic.param_manifest())
    # ---- gradient checkpointing: the same updates ------------------------------------------------------------
    ck = build_train_engine("fsdp", args.model, mesh, device, trainable=True, lora=settings, gradient_checkpointing=True,
                            optim=dict(lr=1e-2, weight_decay=0.01, grad_clip=1.0), total_steps=10)
    for _ in range(2):
        ck.train_step([tb], loss_fn)
    res["checkpointing_same"] = all_ranks(torch.equal(logprobs(ck), trained))

    # ---- bfloat16 compute (what CUDA gets): base stored in bf16, adapters float32 masters, FSDP2 mixed precision
    bf = build_train_engine("fsdp", args.model, mesh, device, trainable=True, lora=settings, dtype="bfloat16",
                            optim=dict(lr=1e-2), total_steps=10)
    res["bf16_dtypes"] = sorted({("adapter" if is_adapter(n) else "base", str(q.dtype)) for n, q in bf.hf.named_parameters()})
    bf.train_step([tb], loss_fn)
    bf_base = build_train_engine("fsdp", args.model, mesh, device, trainable=False, dtype="bfloat16")
    with bf.adapters_disabled():
        res["bf16_ref_equals_base"] = all_ranks(torch.equal(logprobs(bf), logprobs(bf_base)))
    res["bf16_moved"] = float((logprobs(bf) - logprobs(bf_base)).abs().max())

    # ---- tensor parallelism (tp = 2, dp = 1): the same two updates as dp = 2, up to reduction order -----------------
    if env.world_size == 2:
        placement = Config().placement
        placement.actor_tp = 2
        tp_mesh = RoleMeshes(plan_layout(placement, 2), env.rank, "cpu")["actor"]
        tp = build_train_engine("fsdp", args.model, tp_mesh, device, trainable=True, lora=settings,
                                optim=dict(lr=1e-2, weight_decay=0.01, grad_clip=1.0), total_steps=10)
        res["tp_start_equal"] = float((logprobs(tp) - want_ref).abs().max())
        for _ in range(2):
            tp.train_step([tb], loss_fn)
        res["tp_vs_dp"] = float((logprobs(tp) - trained).abs().max())
        tp_base = build_train_engine("fsdp", args.model, tp_mesh, device, trainable=False)
        with tp.adapters_disabled():
            res["tp_ref_equals_base"] = all_ranks(torch.equal(logprobs(tp), logprobs(tp_base)))
        res["tp_adapter_shapes"] = {n: list(t.shape) for n, t in tp.adapter_tensors()}
        res["tp_placements"] = {n.split(".", 3)[-1]: str(getattr(q, "placements", None)) for n, q in tp.hf.named_parameters()
                                if n.startswith("model.layers.0.") and is_adapter(n)}

    if env.rank == 0:
        torch.save({"tb": dict(vars(tb)), "at_save": trained, "base": want_ref}, os.path.join(args.out, "lp.pt"))
        res["adapter_config"] = a.adapter_config()
        res["checkpoint"] = path
        with open(os.path.join(args.out, "lora.json"), "w") as f:
            json.dump(res, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
