"""Sharded loading (spmdrl/engines/loading.py) with real processes: each rank's memory grows by its shard
(as `spmdrl plan` computes it), not by the model, and the loaded model scores exactly like transformers'."""
import json
import os

import pytest
import torch

from launching import run
from spmdrl.tiny import build_tiny

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))


def write_random_checkpoint(out: str) -> int:
    """A ~309M-parameter Qwen2 checkpoint in bfloat16 with random weights (no tokenizer: the engine needs none)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from spmdrl.models.model import model_param_shapes

    cfg = Qwen2Config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=512)
    os.makedirs(out, exist_ok=True)
    cfg.save_pretrained(out)
    g = torch.Generator().manual_seed(0)
    sd = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in model_param_shapes(cfg)}
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in sd.values())


def test_sharded_load_two_ranks(tmp_path):
    n_params = write_random_checkpoint(str(tmp_path / "big"))
    assert 2.5e8 < n_params < 4e8
    tiny = build_tiny(str(tmp_path / "tiny"), seed=0)
    run([os.path.join(HERE, "dist_scripts", "sharded_load.py"), "--big", str(tmp_path / "big"), "--tiny", tiny,
         "--out", str(tmp_path)], nproc=2, timeout=900)
    for r in range(2):
        res = json.load(open(tmp_path / f"load_rank{r}.json"))
        print(f"rank {r}: RSS growth {res['rss_growth'] / 2**20:.0f} MiB, planned {res['planned'] / 2**20:.0f} MiB, "
              f"shard held {res['held'] / 2**20:.0f} MiB, full fp32 model {res['full_fp32'] / 2**20:.0f} MiB")
        assert res["held"] == pytest.approx(res["full_fp32"] / 2, rel=0.01)  # this rank's half, float32
        assert res["rss_growth"] <= res["planned"] * 1.05 + (64 << 20)  # within the plan (64 MiB allocator slack)
        assert res["rss_growth"] < 0.6 * res["full_fp32"]  # never the whole model
        for layout, diff in res["logprob_diff"].items():
            assert diff < 1e-5, (layout, diff)
