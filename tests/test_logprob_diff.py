"""`rollout/logprob_diff_mean|max` as a 2-rank step logs it: the token mean over the global batch and the true
maximum over both ranks (not the mean of the ranks' maxima), off-policy and on-policy, against an independent
float64 computation over the whole global batch (tests/dist_scripts/logprob_diff.py)."""
import os
import sys

import pytest
import torch

from launching import run

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist_scripts"))
from objective_layout import global_batch  # noqa: E402

pytestmark = pytest.mark.dist


def _actor_logprobs64(model_path: str) -> torch.Tensor:
    """The tiny model's log-probs of the global batch's sampled tokens, float64, one sample at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float64)
    b = global_batch()
    B, R = b["responses"].shape
    out = torch.zeros(B, R, dtype=torch.float64)
    with torch.no_grad():
        for i in range(B):
            p, r = int(b["prompt_len"][i]), int(b["response_len"][i])
            ids = torch.cat([b["prompts"][i, :p], b["responses"][i, :r]])[None]
            lsm = torch.log_softmax(model(input_ids=ids).logits[0, p - 1: p - 1 + r], -1)
            out[i, :r] = lsm.gather(-1, b["responses"][i, :r, None]).squeeze(-1)
    return out


def test_logged_logprob_diff_is_the_global_mean_and_max(tmp_path):
    from spmdrl.tiny import build_tiny

    model = build_tiny(str(tmp_path / "model"), seed=0)
    run([os.path.join(HERE, "dist_scripts", "logprob_diff.py"), "--model", model, "--out", str(tmp_path)], nproc=2)
    res = torch.load(tmp_path / "logprob_diff.pt", weights_only=False)
    b = global_batch()
    mask = b["response_mask"].double() != 0
    actor = {"off_policy": b["old_log_probs"].double(), "on_policy": _actor_logprobs64(model)}
    for case, got in res.items():
        diff = (actor[case] - got["rollout_log_probs"].double()).abs()[mask]
        want_mean, want_max = float(diff.sum() / diff.numel()), float(diff.max())
        r0, r1 = got["rank_max"]
        assert abs(r0 - 0.3) < 1e-3 and abs(r1 - 0.9) < 1e-3, (case, got["rank_max"])  # the ranks' maxima differ
        logged = got["logged"]
        # on-policy the actor's side is the fp32 update's own log-probs: equal to float32 rounding
        tol = 0.0 if case == "off_policy" else 1e-5
        assert logged["rollout/logprob_diff_max"] == pytest.approx(want_max, abs=tol, rel=0), case
        assert logged["rollout/logprob_diff_mean"] == pytest.approx(want_mean, abs=max(tol, 1e-12), rel=0), case
