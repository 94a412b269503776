"""LoRA training on the FSDP2 engine with real PEFT (spmdrl/engines/lora.py): one 2-rank run of
dist_scripts/lora_engine.py shared by the tests (what is trained, the reference policy, bitwise resume through
CheckpointManager), then `spmdrl export` of its checkpoint loaded back by PEFT itself, and the config checks."""
import json
import os

import pytest
import torch

from launching import run
from spmdrl.tiny import build_tiny

HERE = os.path.dirname(os.path.abspath(__file__))
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = build_tiny(str(root / "model"), seed=0)
    out = root / "out"
    out.mkdir()
    run([os.path.join(HERE, "dist_scripts", "lora_engine.py"), "--model", model, "--out", str(out)], nproc=2, timeout=300)
    with open(out / "lora.json") as f:
        res = json.load(f)
    from spmdrl.engines import TokenBatch

    lp = torch.load(out / "lp.pt")
    lp["tb"] = TokenBatch(**lp["tb"])
    return {"model": model, "out": out, "res": res, "lp": lp}


def base_logprobs(model, tb):
    """Log-probs of the response tokens under an HF (or PEFT) model, float64 softmax."""
    with torch.no_grad():
        logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask, position_ids=tb.position_ids).logits
    lp = torch.log_softmax(logits.double(), -1)
    rows = torch.arange(tb.resp_ids.shape[0])[:, None]
    return lp[rows, tb.resp_pos].gather(-1, tb.resp_ids[..., None])[..., 0] * tb.resp_mask


@pytest.mark.dist
def test_only_adapters_get_gradients_and_optimizer_state(lora_run):
    r = lora_run["res"]
    # every linear layer of the 4 decoder blocks: 7 modules x (A, B) x 4 layers
    assert r["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert r["n_adapter_params"] == 56
    assert r["grads_only_adapters"] and r["n_with_grad"] == 56
    assert r["optimizer_state_only_adapters"] and r["optimizer_params"] == 56
    assert r["frozen_dtypes"] == ["torch.float32"]  # the compute dtype on CPU


@pytest.mark.dist
def test_base_unchanged_and_disabled_adapters_are_the_base_model(lora_run):
    r = lora_run["res"]
    assert r["start_is_base"]  # B = 0 at init: the adapted model starts as the base model, bitwise
    assert r["base_changed"] == []  # every frozen weight bitwise equal to the model file after 2 updates
    assert r["trained_moved"] > 1e-2  # the adapters did change the policy ...
    assert r["ref_equals_base"]  # ... and disabled they give exactly a plain engine's log-probs of the base model
    assert r["grad_flags_kept"] and r["enabled_again"]
    assert r["param_shapes_are_base"] and r["weight_shards_are_base"]  # what a full-weight sync or export reads
    # the base engine's log-probs are the HF model's (independent reference: transformers, unsharded)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(lora_run["model"], dtype=torch.float32).eval()
    lp = lora_run["lp"]
    assert float((base_logprobs(hf, lp["tb"]) - lp["base"].double()).abs().max()) < 1e-5


@pytest.mark.dist
def test_gradient_checkpointing_and_bfloat16(lora_run):
    r = lora_run["res"]
    assert r["checkpointing_same"]  # model.gradient_checkpointing: the same two updates, bitwise
    # model.dtype = bfloat16 (CUDA's default): the frozen base is stored in bf16, the adapters stay float32 masters
    assert r["bf16_dtypes"] == [["adapter", "torch.float32"], ["base", "torch.bfloat16"]]
    assert r["bf16_ref_equals_base"] and r["bf16_moved"] > 0


@pytest.mark.dist
def test_tensor_parallel_lora_matches_data_parallel(lora_run):
    """tp = 2: column-parallel layers get a column-parallel B, row-parallel layers a row-parallel A; the same two
    updates as dp = 2 up to reduction order, and the adapters disabled are exactly a tp = 2 base engine."""
    r = lora_run["res"]
    pl = r["tp_placements"]
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert pl[f"{name}.lora_B.default.weight"].endswith("Shard(dim=0))") and pl[f"{name}.lora_B.default.weight"].count("Shard") == 2
        assert pl[f"{name}.lora_A.default.weight"] == "(Shard(dim=0),)"  # FSDP only: A sees the whole input
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert pl[f"{name}.lora_A.default.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert pl[f"{name}.lora_B.default.weight"] == "(Shard(dim=0),)"
    assert r["tp_start_equal"] < 1e-5 and r["tp_vs_dp"] < 1e-5
    assert r["tp_ref_equals_base"]
    assert r["tp_adapter_shapes"] == r["adapter_tensors"]  # gathered whole over tp as over dp


@pytest.mark.dist
def test_learner_ref_is_the_actor_with_adapters_disabled(lora_run):
    r = lora_run["res"]
    assert r["learner_ref_is_base"]  # Learner.ref_logprobs with no ref engine: exactly the base model
    assert r["learner_actor_is_adapted"]


@pytest.mark.dist
def test_lora_critic_trains_adapters_and_its_value_head(lora_run):
    r = lora_run["res"]
    assert r["critic_trained"] == ["adapter", "score.bias", "score.weight"]  # Qwen2's token-classification head
    assert r["critic_optimizer_params"] == 56 + 2 and r["critic_manifest"] == 56 + 2


@pytest.mark.dist
def test_checkpoint_holds_adapters_only_and_resume_is_bitwise(lora_run):
    r = lora_run["res"]
    assert r["saved_model_keys_adapters"] and r["saved_optim_keys_adapters"]
    with open(os.path.join(r["checkpoint"], "manifest.json")) as f:
        actor = json.load(f)["engines"]["actor"]
    assert len(actor["params"]) == 56 and all(".lora_" in n for n, _, _ in actor["params"])
    assert actor["adapter"]["base_model_name_or_path"] == lora_run["model"]
    assert actor["adapter"]["peft_type"] == "LORA" and actor["adapter"]["r"] == 4
    from spmdrl.checkpoint.dcp import safe_reader

    keys = safe_reader(os.path.join(r["checkpoint"], "state", "actor")).read_metadata().state_dict_metadata
    tensors = [k for k in keys if k.startswith("actor.model.")]
    moments = [k for k in keys if k.startswith("actor.optim.") and k.endswith(("exp_avg", "exp_avg_sq"))]
    assert len(tensors) == 56 and all(".lora_" in k for k in tensors)  # never a base weight
    assert len(moments) == 2 * 56 and all(".lora_" in k for k in moments)
    assert r["loaded_adapters_equal"] and r["resume_bitwise"]


@pytest.mark.dist
def test_lora_checkpoint_refused_by_a_full_model_run(lora_run):
    from module_engine import ModuleEngine

    from spmdrl.checkpoint.verify import check_compatible, read_manifest
    from spmdrl.errors import CheckpointError

    path = lora_run["res"]["checkpoint"]
    full = ModuleEngine(module=torch.nn.Linear(2, 2), optimizer=None)
    with pytest.raises(CheckpointError, match="holds LoRA adapters for actor, this run trains the whole model; set "
                                              "lora.enable = true"):
        check_compatible(path, read_manifest(path), {"actor": full}, None)


@pytest.mark.dist
def test_names_and_config_are_what_peft_saves(lora_run, tmp_path):
    """adapter_tensors' names and shapes and adapter_config() against PEFT's own save_pretrained of the same
    adapters on the HF model."""
    from peft import get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from spmdrl.models.lora import LoraSettings, peft_config

    r = lora_run["res"]
    hf = AutoModelForCausalLM.from_pretrained(lora_run["model"], dtype=torch.float32)
    settings = LoraSettings(rank=4, alpha=8, target_modules=r["target_modules"])
    get_peft_model(hf, peft_config(settings, lora_run["model"])).save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as f:
        theirs = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert theirs == r["adapter_tensors"]
    with open(tmp_path / "adapter_config.json") as f:
        theirs = json.load(f)
    theirs["target_modules"] = sorted(theirs["target_modules"])  # PEFT writes a set in hash order; ours is sorted
    assert theirs == r["adapter_config"]


@pytest.mark.dist
def test_export_adapter_loads_in_peft_and_merged_model_reproduces_the_actor(lora_run, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from spmdrl.export import export_hf

    r, lp = lora_run["res"], lora_run["lp"]
    adapter = export_hf(r["checkpoint"], str(tmp_path / "adapter"))
    assert sorted(os.listdir(adapter))[:2] == ["adapter_config.json", "adapter_model.safetensors"]
    assert {k: list(v.shape) for k, v in load_file(os.path.join(adapter, "adapter_model.safetensors")).items()} == r["adapter_tensors"]
    base = AutoModelForCausalLM.from_pretrained(lora_run["model"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    got = base_logprobs(model, lp["tb"])
    assert float((got - lp["at_save"].double()).abs().max()) < 1e-5  # the actor's log-probs at the checkpoint
    assert float((got - lp["base"].double()).abs().max()) > 1e-2
    engine_export = load_file(os.path.join(lora_run["out"], "engine_export", "adapter_model.safetensors"))
    assert all(torch.equal(engine_export[k], v) for k, v in load_file(os.path.join(adapter, "adapter_model.safetensors")).items())
    merged = export_hf(r["checkpoint"], str(tmp_path / "merged"), merged=True)
    full = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert not any(".lora_" in n for n, _ in full.named_parameters())
    assert float((base_logprobs(full, lp["tb"]) - lp["at_save"].double()).abs().max()) < 1e-5


@pytest.mark.dist
def test_exported_adapter_serves_in_vllm_with_the_actors_logprobs(lora_run, tmp_path):
    """`spmdrl export` of the checkpoint, loaded by vLLM through its public LoRARequest (a fresh process with no
    spmdrl sync involved): vLLM's log-probs of the saved sequences equal the actor's at the checkpoint."""
    pytest.importorskip("vllm")
    from spmdrl.export import export_hf

    adapter = export_hf(lora_run["res"]["checkpoint"], str(tmp_path / "adapter"))
    out = tmp_path / "vllm.json"
    run([os.path.join(HERE, "dist_scripts", "vllm_export_adapter.py"), "--model", lora_run["model"], "--adapter", adapter,
         "--lp", str(lora_run["out"] / "lp.pt"), "--out", str(out)], nproc=None, timeout=300)
    with open(out) as f:
        got = json.load(f)["logprobs"]
    lp = lora_run["lp"]
    want, base = lp["at_save"].double(), lp["base"].double()
    assert [len(g) for g in got] == lp["tb"].resp_mask.sum(1).long().tolist()
    diff = max(abs(g - float(want[b, j])) for b, row in enumerate(got) for j, g in enumerate(row))
    off_base = max(abs(g - float(base[b, j])) for b, row in enumerate(got) for j, g in enumerate(row))
    assert diff < 1e-5, diff
    assert off_base > 1e-2  # vLLM applied the adapter: the base model's log-probs are far off


# ---------------------------------------------------------------------------------------------- the Trainer


@pytest.mark.dist
def test_trainer_lora_grpo_with_lora_critic_resumes_bitwise(lora_run, tmp_path):
    """The real Trainer on 2 ranks: GRPO with a KL loss and a LoRA critic, no ref engine (the KL's reference is the
    actor with its adapters disabled); checkpoints at steps 1 and 2 hold actor and critic adapters; a run resumed
    from step 1 logs step 2 exactly as the uninterrupted run."""
    pytest.importorskip("vllm")
    from spmdrl.data.synthetic import make_arith
    from spmdrl.metrics import read_jsonl

    data = make_arith(str(tmp_path / "data"), n_train=32, n_val=8, seed=0)
    common = {
        "model.path": lora_run["model"], "data.train_files": f'["{data["train"]}"]', "data.max_prompt_length": 32,
        "data.max_response_length": 8, "data.train_batch_size": 4, "rollout.n": 4, "rollout.kv_cache_gb": 0.1,
        "actor.lr": 1e-3, "actor.micro_batch_size": 4, "actor.ppo_mini_batch_size": 2, "actor.use_kl_loss": "true",
        "critic.enable": "true", "critic.micro_batch_size": 4, "algorithm.adv_estimator": "gae", "lora.enable": "true",
        "lora.critic": "true", "lora.rank": 4, "trainer.total_steps": 2, "trainer.device": "cpu",
        "trainer.dist_timeout_s": 60, "logging.progress": "false", "logging.tensorboard": "false",
        "checkpoint.save_freq": 1, "checkpoint.keep_last": 0,
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
    }

    def train(out, resume):
        args = [f"{k}={v}" for k, v in {**common, "trainer.output_dir": str(out), "checkpoint.resume": resume}.items()]
        run(["spmdrl.train", *args], nproc=2, module=True, timeout=400)

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, "off")
    with open(straight / "checkpoints" / "step_00000002" / "manifest.json") as f:
        engines = json.load(f)["engines"]
    assert sorted(engines) == ["actor", "critic"]  # no ref model
    assert all(".lora_" in n for n, _, _ in engines["actor"]["params"])
    assert {n for n, _, _ in engines["critic"]["params"] if ".lora_" not in n} == {"hf.score.weight", "hf.score.bias"}
    train(resumed, str(straight / "checkpoints" / "step_00000001"))
    want = [r for r in read_jsonl(str(straight / "metrics.jsonl")) if r["step"] == 2][0]
    got = [r for r in read_jsonl(str(resumed / "metrics.jsonl")) if r["step"] == 2][0]
    keys = [k for k in want if not k.startswith(("timing/", "perf/", "memory/"))]
    assert want["actor/kl"] > 0 and "actor/pg_loss" in keys and "critic/vf_loss" in keys
    # step 2 samples with the adapter trained in step 1 (rollout.lora_sync auto: merged into the base on CPU):
    # vLLM's log-probs of its samples equal the actor's
    assert want["rollout/logprob_diff_mean"] < 1e-5 and want["weight_sync/bytes_recv_max"] > 0
    assert {k: got.get(k) for k in keys} == {k: want[k] for k in keys}


@pytest.mark.dist
def test_trainer_adapter_sync_colocated_and_split_with_versioned_adapters(lora_run, tmp_path, monkeypatch):
    """rollout.lora_sync = 'adapter' through the real Trainer. Colocated (2 ranks, vLLM dp=2): step 2 samples with
    the adapter trained in step 1 (vLLM's log-probs equal the actor's) and each sync moves the adapter's bytes.
    Split with max_staleness 1 (rank 0 serves, rank 1 trains): batch 3 was generated by adapter version 1, and its
    vLLM log-probs are those of the step-1 checkpoint's exported adapter under PEFT in float64, not step 3's."""
    pytest.importorskip("vllm")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from spmdrl.data.synthetic import make_arith
    from spmdrl.export import export_hf
    from spmdrl.metrics import read_jsonl

    data = make_arith(str(tmp_path / "data"), n_train=32, n_val=8, seed=0)
    dump = tmp_path / "dump"
    dump.mkdir()
    monkeypatch.setenv("SPMDRL_TEST_DUMP", str(dump))
    common = {
        "model.path": lora_run["model"], "data.train_files": f'["{data["train"]}"]', "data.max_prompt_length": 32,
        "data.max_response_length": 8, "data.train_batch_size": 4, "rollout.n": 4, "rollout.kv_cache_gb": 0.1,
        "actor.lr": 1e-2, "actor.micro_batch_size": 4, "actor.ppo_mini_batch_size": 2, "lora.enable": "true",
        "lora.rank": 4, "rollout.lora_sync": "adapter", "trainer.device": "cpu", "trainer.dist_timeout_s": 120,
        "logging.progress": "false", "logging.tensorboard": "false", "checkpoint.keep_last": 0,
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
        "hooks.files": f'["{os.path.join(HERE, "dist_scripts", "version_hook.py")}"]',
    }
    # rank 4 on every linear layer of the tiny model, float32: (r*in + out*r) per layer
    adapter_bytes = 4 * 4 * 4 * sum(i + o for i, o in [(128, 128), (128, 64), (128, 64), (128, 128), (128, 384),
                                                       (128, 384), (384, 128)])

    def train(out, **extra):
        args = [f"{k}={v}" for k, v in {**common, "trainer.output_dir": str(out), **extra}.items()]
        run(["spmdrl.train", *args], nproc=2, module=True, timeout=400)
        return {r["step"]: r for r in read_jsonl(str(out / "metrics.jsonl"), last_per_step=True)}

    rows = train(tmp_path / "colocated", **{"trainer.total_steps": 2, "checkpoint.save_freq": -1})
    assert rows[2]["rollout/logprob_diff_max"] < 1e-5 and rows[2]["actor/grad_norm"] > 0
    # each of the 2 actor ranks holds half of every adapter tensor (FSDP2) and gathers the other half
    assert rows[2]["weight_sync/bytes_recv_max"] == rows[2]["weight_sync/bytes_lower_bound"] == adapter_bytes // 2

    for f in dump.iterdir():
        f.unlink()
    split = tmp_path / "split"
    rows = train(split, **{"trainer.total_steps": 3, "checkpoint.save_freq": 1, "placement.mode": "split",
                           "placement.rollout_ranks": "[0]", "trainer.max_staleness": 1})
    versions = {r["step"]: r for r in map(json.loads, open(dump / "versions_rank1.jsonl"))}
    assert {s: set(v["versions"]) for s, v in versions.items()} == {1: {0}, 2: {0}, 3: {1}}
    assert [rows[s]["train/weight_version_lag"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    synced = [r for r in rows.values() if "weight_sync/bytes_recv_max" in r]
    assert synced and all(r["weight_sync/bytes_recv_max"] == r["weight_sync/bytes_lower_bound"] == adapter_bytes
                          for r in synced)
    batch = versions[3]["all"]
    worst = {}
    for step in (1, 3):
        adapter = export_hf(str(split / "checkpoints" / f"step_{step:08d}"), str(tmp_path / f"adapter{step}"))
        base = AutoModelForCausalLM.from_pretrained(lora_run["model"], dtype=torch.float64)
        model = PeftModel.from_pretrained(base, adapter).eval()
        worst[step] = 0.0
        for i, resp in enumerate(batch["responses"]):
            p, r = batch["prompts"][i][: batch["prompt_len"][i]], resp[: batch["response_len"][i]]
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1: -1], -1)
            want = lp.gather(-1, torch.tensor(r)[:, None])[:, 0]
            got = torch.tensor(batch["rollout_log_probs"][i][: len(r)], dtype=torch.float64)
            worst[step] = max(worst[step], float((want - got).abs().max()))
    assert worst[1] < 1e-5 and worst[3] > 1e-3, worst


# ---------------------------------------------------------------------------------------------- config


def validate_error(*overrides) -> str:
    from spmdrl.config import load_config, validate
    from spmdrl.errors import ConfigError

    cfg = load_config(None, ["model.path=/models/tiny", "data.train_files=[\"train.parquet\"]", *overrides])
    with pytest.raises(ConfigError) as info:
        validate(cfg, 2)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_lora_config_is_refused_where_it_cannot_run():
    assert "megatron-core 0.16.1 has none" in validate_error("lora.enable=true", "trainer.backend=megatron")
    assert "trainer.backend = 'fsdp'" in validate_error("lora.enable=true", "trainer.backend=megatron")
    assert "set lora.dropout = 0 or tp = 1" in validate_error("lora.enable=true", "lora.dropout=0.1", "placement.actor_tp=2",
                                                              "rollout.engine=hf")
    assert "lora.critic = true needs lora.enable" in validate_error("lora.critic=true")
    assert "no ref model is built" in validate_error("lora.enable=true", "ref.offload=true")
    assert "lora.rank must be > 0" in validate_error("lora.enable=true", "lora.rank=0")
    assert "lora.init = 'pissa'" in validate_error("lora.enable=true", "lora.init=pissa")


def test_unknown_target_module_is_refused_at_validation(tmp_path):
    model = build_tiny(str(tmp_path / "model"), seed=0)
    msg = validate_error(f"model.path={model}", "lora.enable=true", 'lora.target_modules=["q_proj", "qkv_proj"]')
    assert msg.startswith("lora.target_modules: ['qkv_proj'] name no linear layer") and "a qwen2 model" in msg


def test_lora_run_builds_no_ref():
    from spmdrl.config import load_config, validate
    from spmdrl.config.derived import builds_ref, uses_ref

    cfg = load_config(None, ["model.path=/models/tiny", "data.train_files=[\"train.parquet\"]", "lora.enable=true",
                             "actor.use_kl_loss=true"])
    validate(cfg, 2)
    assert uses_ref(cfg) and not builds_ref(cfg)


def test_plan_counts_frozen_base_and_adapter_state():
    """`spmdrl plan` for GRPO on Qwen2.5-7B (bundled config, 8 ranks) with a KL loss: with LoRA no ref role, and
    the actor's gradients and AdamW state are the adapters' only. By hand: rank 16 on the 7 linear layers of 28
    blocks, r (in + out) each, is 28 x 16 x 90112 = 40,370,176 parameters."""
    from spmdrl.config import load_config
    from spmdrl.plan import build_plan

    gib = 1 << 30
    full = build_plan(load_config(os.path.join(HERE, "..", "configs", "grpo.toml"), ["actor.use_kl_loss=true"]), 8)
    lora = build_plan(load_config(os.path.join(HERE, "..", "configs", "grpo.toml"),
                                  ["actor.use_kl_loss=true", "lora.enable=true", "lora.rank=16"]), 8)
    assert "ref" in full["roles"] and "ref" not in lora["roles"] and "ref_forward" not in lora["memory"]
    adapters = 28 * 16 * 90112
    gpu, gpu_full = lora["memory"]["train_actor"]["gpu"], full["memory"]["train_actor"]["gpu"]
    assert abs(gpu["actor_optimizer"] - adapters * 8 / 8 / gib) < 2e-3
    assert abs(gpu["actor_grads"] - adapters * 4 / 8 / gib) < 2e-3
    # the frozen base in bf16 (half the full run's float32 masters) plus the float32 adapters
    assert abs(gpu["actor_params"] - (gpu_full["actor_params"] / 2 + adapters * 4 / 8 / gib)) < 2e-3
