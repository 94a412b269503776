"""Model families: the weight sync into vLLM learnt from vLLM's own loaders, for every family spmdrl lists, checked
by running it.

- What each vLLM TP rank's loaders read (reshard/vllm_reads.py), at TP = 1 and 2, for tiny random instances of
  llama, qwen2, qwen3, mistral, gemma3, mixtral, qwen3_moe and qwen2_moe (shared experts), and two outside that
  list: phi3 (fused q/k/v and gate/up tensors, which vLLM's loaders split by views: the planned route) and falcon
  (whose loader regroups the fused query_key_value heads by copies: those take the whole-tensor route, the rest
  the planned one).
- The equivalence harness: in one 2-rank job, for each family, the FSDP2 actor takes a step and syncs into a real
  vLLM engine at TP = 2 through the planned route with rollout.verify_sync on (the engine's weights compared byte
  for byte with a whole-tensor load through vLLM's loaders, NaN outside the planned blocks); the bytes each rank
  receives equal the lower bound; vLLM's log-probs of its own samples match the actor's. For the mixtures of
  experts vLLM records its routes and the actor replays them: the trainer's own router chose every one of them.
- FSDP2 + DTensor TP = 2 for qwen3 and gemma3 through the same harness.
- GRPO through the Trainer, 2 ranks, rollout TP = 2, off-policy mini-batches, 2 steps, for the families that add
  something the harness does not cover (sliding windows and tied embeddings, experts, the whole-tensor route);
  `launch/model_families.sh` runs it for every family.
"""
import json
import os

import pytest

pytest.importorskip("vllm")

from launching import run  # noqa: E402
from spmdrl.tiny import ARCHS, build_tiny  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PLANNED = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "mixtral", "qwen3_moe", "qwen2_moe", "phi3"]
MOE = ("mixtral", "qwen3_moe", "qwen2_moe")


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: build_tiny(str(root / arch), seed=0, arch=arch, num_layers=2) for arch in ARCHS}


@pytest.mark.parametrize("tp", [1, 2])
def test_reads_learnt_from_vllm_loaders_per_family(family_models, tp):
    from spmdrl.models.model import load_hf_config, model_param_shapes
    from spmdrl.dist.blocks import full_block, numel
    from spmdrl.reshard.vllm_reads import probe_vllm_reads

    for arch, path in family_models.items():
        cfg = load_hf_config(path)
        params = model_param_shapes(cfg)
        reads = probe_vllm_reads(cfg, params, tp)
        if arch == "falcon":  # vLLM's Falcon loader regroups the fused q/k/v heads by copies: they go whole
            assert set(reads.whole) == {n for n, _ in params if "query_key_value" in n}, reads.whole
        else:
            assert reads.whole == {}, (arch, reads.whole)
        for name, shape in params:
            if name in reads.whole:
                continue
            per_rank = reads.reads[name]
            if tp == 1:  # one rank loads every element it reads at all
                assert per_rank[0] in ([full_block(shape)], []), (arch, name, per_rank)
                continue
            sizes = [sum(numel(b) for b in blocks) for blocks in per_rank]
            total = numel(full_block(shape))
            # a TP-split tensor: disjoint halves; a replicated one (norms, kv heads below tp, routers): whole twice
            assert sizes in ([total // 2, total // 2], [total, total]) or name.endswith(("embed_tokens.weight",
                                                                                      "lm_head.weight")), (arch, name, sizes)
        if arch in ("mixtral", "qwen3_moe") and tp == 2:
            gate_up = next(n for n, _ in params if n.endswith("experts.gate_up_proj"))
            shape = dict(params)[gate_up]
            half = shape[1] // 2
            # every expert's gate rows and up rows of this rank's half of the FFN width: two blocks per rank
            assert reads.reads[gate_up][1] == [((0, half // 2, 0), (shape[0], half // 2, shape[2])),
                                               ((0, half + half // 2, 0), (shape[0], half // 2, shape[2]))]


@pytest.mark.dist
def test_planned_sync_equals_whole_tensor_load_in_vllm_per_family(family_models, tmp_path):
    order = PLANNED + ["falcon"]
    run([os.path.join(HERE, "dist_scripts", "model_families.py"), "--out", str(tmp_path), "--rollout-tp", "2",
         *[family_models[a] for a in order]], nproc=2, timeout=1200)
    for arch in order:
        res = [json.load(open(tmp_path / f"{arch}.rank{r}.json")) for r in range(2)]
        for r in res:
            m = r["metrics"]
            assert r["n_tokens"] > 0 and r["logprob_max_diff"] < 1e-5, (arch, r)
            assert r["plan_recv"] == r["plan_lower_bound"], (arch, r)
            assert m["weight_sync/bytes_recv_max"] == max(x["plan_recv"] for x in res), (arch, m)
            assert m["weight_sync/bytes_recv_max"] == m["weight_sync/bytes_lower_bound"], (arch, m)
            assert bool(r["whole"]) == (arch == "falcon"), (arch, r["whole"])
            c = r["route_counts"]  # the actor replayed vLLM's routes; its own router chose the same experts
            assert (c["agree_own"] == c["agree_used"] == c["routed"] == c["expected"] > 0) if arch in MOE else not c, \
                (arch, c)


@pytest.mark.dist
def test_dtensor_tp_actor_per_family(family_models, tmp_path):
    """FSDP2 + DTensor TP = 2 for the families with q/k norms (qwen3) and sliding windows (gemma3): each TP rank
    holds whole heads and applies the per-head norms to its own; after a step and a sync into vLLM at TP = 2
    (verified against a whole-tensor load) vLLM's log-probs are the actor's, and nothing crosses ranks (the
    actor's TP shards are vLLM's, norms and embeddings are whole on both ranks)."""
    archs = ["qwen3", "gemma3"]
    run([os.path.join(HERE, "dist_scripts", "model_families.py"), "--out", str(tmp_path), "--rollout-tp", "2",
         "--actor-tp", "2", *[family_models[a] for a in archs]], nproc=2, timeout=900)
    for arch in archs:
        for r in (json.load(open(tmp_path / f"{arch}.rank{k}.json")) for k in range(2)):
            assert r["logprob_max_diff"] < 1e-5 and r["plan_recv"] == r["plan_lower_bound"] == 0, (arch, r)


def family_overrides(root, arch, model, **extra) -> tuple:
    """A 2-step GRPO run of `arch`: its output directory and overrides."""
    from spmdrl.data.synthetic import make_arith

    data = make_arith(str(root / "data"), n_train=32, n_val=4, seed=0)
    out = root / f"run_{arch}"
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.max_prompt_length": 32,
        "data.max_response_length": 8, "data.train_batch_size": 4, "rollout.n": 4, "rollout.kv_cache_gb": 0.05,
        "actor.lr": 1e-3, "actor.micro_batch_size": 4, "actor.ppo_mini_batch_size": 2,  # 2 mini-batches: off-policy
        "trainer.total_steps": 2, "trainer.device": "cpu", "trainer.output_dir": str(out), "logging.progress": "false",
        "placement.rollout_tp": 2, "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
    }
    o.update(extra)
    return out, [f"{k}={v}" for k, v in o.items()]


def family_extra(arch: str) -> dict:
    """qwen3_moe runs with routing replay and the router's losses; the Megatron case on 4 ranks: tp 2 x dp 2, the
    experts split over the 2 data-parallel replicas (all-to-all dispatch) and each expert's FFN width over tp."""
    extra = {"actor.router_replay": "rollout", "actor.moe_aux_loss_coef": 0.01, "actor.moe_z_loss_coef": 0.001} \
        if arch.startswith("qwen3_moe") else {}
    if arch.endswith("megatron-ep2-tp2"):
        extra.update({"trainer.backend": "megatron", "placement.actor_tp": 2, "placement.actor_ep": 2,
                      "placement.ref_tp": 2, "placement.ref_ep": 2})
    return extra


TWO_RANK_FAMILIES = ["gemma3", "qwen3_moe", "falcon"]


@pytest.fixture(scope="module")
def family_runs(family_models, tmp_path_factory):
    """The 2-rank families' runs, one after another in one launch (tests/dist_scripts/train_runs.py)."""
    root = tmp_path_factory.mktemp("family_runs")
    runs = {a: family_overrides(root, a, family_models[a], **family_extra(a)) for a in TWO_RANK_FAMILIES}
    (root / "runs.json").write_text(json.dumps([{"overrides": o} for _, o in runs.values()]))
    proc = run([os.path.join(HERE, "dist_scripts", "train_runs.py"), str(root / "runs.json")], nproc=2, timeout=900)
    return {a: (out, proc.stdout[-3000:] + proc.stderr[-6000:]) for a, (out, _) in runs.items()}


@pytest.mark.dist
@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe", "qwen3_moe-megatron-ep2-tp2", "falcon"])
def test_grpo_per_family_matches_vllm_after_a_sync(family_models, family_runs, tmp_path, arch):
    """Step 2 samples with the weights synced after step 1's two optimizer steps: vLLM's log-probs of its samples
    are the actor's within 1e-5. Planned families receive the lower bound; falcon's logged bytes (the whole-tensor
    route) are what `spmdrl plan` predicts for the same config. qwen3_moe runs with routing replay: the actor's
    forwards route every token vLLM computed as vLLM did (route agreement 1.0), its own router agrees as well
    (the same weights in float32), and every layer reports its expert load; its objective carries the router's
    load-balancing and z-loss terms; the same on the Megatron backend at tp 2 x ep 2 on 4 ranks."""
    from spmdrl.metrics import read_jsonl

    extra = family_extra(arch)
    if arch in family_runs:
        out, log = family_runs[arch]
        assert (out / "rc").read_text() == "0", log
    else:
        out, overrides = family_overrides(tmp_path, arch, family_models[arch.split("-")[0]], **extra)
        run(["spmdrl.train", *overrides], nproc=4, module=True)
    rows = [r for r in read_jsonl(str(out / "metrics.jsonl")) if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-5, (arch, r["rollout/logprob_diff_max"])
        assert r["actor/grad_norm"] > 0
        assert r["weight_sync/bytes_recv_max"] == r["weight_sync/bytes_lower_bound"]
        if extra:
            assert r["moe/route_agreement"] == r["moe/router_agreement"] == 1.0, r
            assert all(r[f"moe/expert_load_max_over_mean/layer_{i}"] >= 1.0 for i in range(2)), r
            assert r["actor/moe_aux_loss"] > 0 and r["actor/moe_z_loss"] > 0, r
    if arch == "falcon":
        from spmdrl.config import load_config
        from spmdrl.plan.estimate import build_plan

        cfg = load_config(None, [f"model.path={family_models[arch]}", "placement.rollout_tp=2", "rollout.engine=vllm",
                                 "trainer.device=cpu", "model.dtype=float32", "rollout.dtype=float32"])
        plan = build_plan(cfg, 2)
        assert plan["weight_sync"]["bytes_recv_max"] == rows[-1]["weight_sync/bytes_recv_max"]
        assert {r["route"] for r in plan["weight_sync"]["routes"]} == {"planned", "whole"}
