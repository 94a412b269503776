"""The rollout/trainer mismatch end to end: a real GRPO run (in-process vLLM, FSDP2 actor, one plain process,
colocated, on-policy: one mini-batch, so the correction computes pi_old itself) sampling at temperature 0.7 with
top_p 0.9 and [rollout_correction] on. (The old-log-prob pass of off-policy runs feeds the same function:
tests/test_objective_layout.py.)

- `rollout/logprob_diff_max` compares vLLM's processed log-probs with the actor's log-probs under the same
  temperature and truncation: below 1e-5 in fp32 at every step (step 2 samples with weights synced after step 1).
- The correction sees pi_old (untruncated) / pi_rollout (truncated): for a token inside the nucleus that ratio is
  the probability mass the nucleus kept, so every token ratio lies in [top_p, 1] and truncation shows up as a
  mean ratio below 1, and sequence rejection drops some responses.
To run the same check on another placement, pass extra overrides to `mismatch_run`."""
import os

import pytest

pytest.importorskip("vllm")

from launching import run  # noqa: E402
from spmdrl.data.synthetic import make_arith  # noqa: E402
from spmdrl.metrics import read_jsonl  # noqa: E402
from spmdrl.tiny import build_tiny  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))


def mismatch_run(root, nproc=None, **extra) -> list[dict]:
    model = build_tiny(str(root / "model"), seed=0)
    data = make_arith(str(root / "data"), n_train=32, n_val=4, seed=0)
    out = root / "run"
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.max_prompt_length": 32,
        "data.max_response_length": 8, "data.train_batch_size": 2, "rollout.n": 4, "rollout.kv_cache_gb": 0.1,
        "rollout.temperature": 0.7, "rollout.top_p": 0.9, "actor.lr": 1e-3, "actor.micro_batch_size": 4,
        "actor.ppo_mini_batch_size": 2,  # on-policy: pi_old is computed by the correction
        "trainer.total_steps": 2, "trainer.device": "cpu", "trainer.output_dir": str(out), "logging.progress": "false",
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
        "rollout_correction.rollout_is": "token", "rollout_correction.rollout_is_threshold": 2.0,
        "rollout_correction.rollout_rs": "sequence", "rollout_correction.rollout_rs_threshold": 2.0,
        "rollout_correction.rollout_rs_threshold_lower": 0.6,
    }
    o.update(extra)
    run(["spmdrl.train", *[f"{k}={v}" for k, v in o.items()]], nproc=nproc, module=True)
    return read_jsonl(str(out / "metrics.jsonl"))


def check_mismatch(rows: list[dict]) -> None:
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/logprob_diff_max"] < 1e-5, r["rollout/logprob_diff_max"]
        assert 0.9 - 1e-5 <= r["rollout_corr/rollout_is_min"] <= r["rollout_corr/rollout_is_mean"] < 1.0
        assert r["rollout_corr/rollout_is_max"] <= 1.0 + 1e-5
        assert r["rollout_corr/rollout_is_truncated_fraction"] == 0.0  # no ratio reaches the cap 2
        assert r["rollout_corr/kl"] > 0 and r["rollout_corr/k3_kl"] > 0
        assert r["rollout_corr/rollout_ppl"] < r["rollout_corr/training_ppl"]  # the rollout policy is sharper
        assert r["rollout_corr/rollout_is_weight_mean"] == pytest.approx(r["rollout_corr/rollout_is_mean"], rel=1e-6)
        assert r["actor/grad_norm"] > 0
    masked = [r["rollout_corr/rollout_rs_seq_masked_fraction"] for r in steps]
    assert any(0 < m < 1 for m in masked), masked  # long responses (product of ratios < 0.6) are rejected


def test_processed_logprobs_and_rollout_correction_colocated(tmp_path):
    check_mismatch(mismatch_run(tmp_path))
