"""GRPO through the Trainer with the actor (and ref) sequence-parallel over 2 ranks (actor sp = 2, dp = 1) on long
responses (up to 512 tokens), against the same run at sp = 1 (actor dp = 2), one mini-batch of one micro-batch per rank in both:
in-process vLLM (rollout dp = 2, so both runs sample the same tokens), the batch moved to the actor layout, the
weights synced back from FSDP2 shards over the sp ranks."""
import os

import pytest

pytest.importorskip("vllm")

from launching import run  # noqa: E402
from spmdrl.data.synthetic import make_arith  # noqa: E402
from spmdrl.metrics import read_jsonl  # noqa: E402
from spmdrl.tiny import build_tiny  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))
# per-rank statistics averaged over the ranks (a dp = 2 run averages two ranks' values), times and memory
LAYOUT_DEPENDENT = ("timing/", "perf/", "memory/", "weight_sync/", "train/reward_std", "train/advantage_mean")


def _train(model, data, out, sp):
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.val_files": "[]",
        "data.max_prompt_length": 32, "data.max_response_length": 512, "data.train_batch_size": 2,
        "rollout.n": 2, "rollout.kv_cache_gb": 0.1, "actor.lr": 1e-3, "actor.micro_batch_size": 4 // (3 - sp),
        "actor.ppo_mini_batch_size": 2, "actor.use_kl_loss": "true", "trainer.total_steps": 2,
        "trainer.device": "cpu", "trainer.output_dir": str(out), "logging.progress": "false",
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
        "placement.actor_sp": sp, "placement.ref_sp": sp,
    }
    run([os.path.join(HERE, "dist_scripts", "grpo_step.py"), "--out", str(out), *[f"{k}={v}" for k, v in o.items()]],
        nproc=2)
    return read_jsonl(str(out / "metrics.jsonl"))


def test_grpo_actor_sp2_equals_sp1_on_long_responses(tmp_path):
    model = build_tiny(str(tmp_path / "model"), seed=0, max_position_embeddings=1024)
    data = make_arith(str(tmp_path / "data"), n_train=16, n_val=4, seed=0)
    base, sp = _train(model, data, tmp_path / "sp1", 1), _train(model, data, tmp_path / "sp2", 2)
    assert [r["step"] for r in sp] == [1, 2]
    assert sp[0]["train/response_length_mean"] > 128  # long responses: sequences span both sp ranks' halves
    keys = [k for k in base[0] if not any(w in k for w in LAYOUT_DEPENDENT)]
    assert "actor/pg_loss" in keys and "actor/grad_norm" in keys and "actor/kl" in keys
    diff = {k: abs(sp[0][k] - base[0][k]) for k in keys if abs(sp[0][k] - base[0][k]) > 1e-5 * (1 + abs(base[0][k]))}
    assert not diff, diff
    assert sp[1]["rollout/logprob_diff_mean"] < 1e-5  # vLLM samples with the weights the sp actor trained
