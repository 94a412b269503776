"""The objective does not depend on the parallel layout.

A real FSDP2 actor update on a tiny fp32 Qwen2 runs under torchrun (gloo) twice: actor dp = 2 with two
micro-batches per rank, and dp = 1 with the whole mini-batch in one micro-batch. For every loss aggregation
mode (and the sequence-level / new policy losses) the gradients agree within 1e-6; for the PPO loss in every
mode both also match an independent float64 whole-batch computation (HF model in float64, the loss written out
here from its formula). Every advantage estimator gives the same advantages at dp = 1 and dp = 2, and the
batch-whitened ones match an independent float64 whole-batch computation."""
import os
import sys

import pytest
import torch

from launching import run

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist_scripts"))
from objective_layout import CASES, DISTILL_CASES, ESTIMATORS, RC, RC_CASES, global_batch, with_rollout_log_probs  # noqa: E402

pytestmark = pytest.mark.dist
SCRIPT = os.path.join(HERE, "dist_scripts", "objective_layout.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from spmdrl.tiny import build_tiny

    root = tmp_path_factory.mktemp("layout")
    model = build_tiny(str(root / "model"), seed=0)
    for nproc, micro in ((2, 2), (1, 8)):
        run([SCRIPT, "--model", model, "--out", str(root), "--micro", str(micro)], nproc=nproc)
    load = lambda name: torch.load(root / name, weights_only=False)  # noqa: E731
    return model, load("layout_dp2_mb2.pt"), load("layout_dp1_mb8.pt")


@pytest.mark.parametrize("case", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_gradient_and_logged_loss_independent_of_layout(runs, case):
    _, dp2, dp1 = runs
    g2, g1 = dp2["grads"][case], dp1["grads"][case]
    assert g1.keys() == g2.keys() and len(g1) > 10
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], atol=1e-6, rtol=1e-6, msg=lambda m: f"{case} {k}: {m}")
    assert max(float(g.abs().max()) for g in g1.values()) > 1e-2  # a real gradient, not zeros
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl", "actor/loss", "actor/clipfrac", "actor/ppo_kl"):
        # float32 metrics (the entropy is ~25 in seq-mean-token-sum): equal to float32 rounding
        assert dp2["metrics"][case][key] == pytest.approx(dp1["metrics"][case][key], abs=1e-6, rel=1e-6), key


def _reference(model_path: str, mode: str, weights=None, keep=None, distill_kl: str | None = None):
    """Float64, whole global batch, one sample at a time; PPO + entropy bonus + k3 KL, aggregated by `mode`;
    optionally the PPO term weighted per token by `weights` and the mask replaced by `keep`; with distill_kl
    (k2 | k3) plus 0.3 x that estimate of KL(actor || teacher) (on-policy distillation's kl_loss mode)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float64)
    b = global_batch()
    B, R = b["responses"].shape
    logp = torch.zeros(B, R, dtype=torch.float64)
    ent = torch.zeros(B, R, dtype=torch.float64)
    rows_lp, rows_ent = [], []
    for i in range(B):
        p, r = int(b["prompt_len"][i]), int(b["response_len"][i])
        ids = torch.cat([b["prompts"][i, :p], b["responses"][i, :r]])[None]
        logits = model(input_ids=ids).logits[0, p - 1: p - 1 + r]
        lsm = torch.log_softmax(logits, -1)
        rows_lp.append(lsm.gather(-1, b["responses"][i, :r, None]).squeeze(-1))
        rows_ent.append(-(lsm.exp() * lsm).sum(-1))
    mask = b["response_mask"].double() if keep is None else keep
    logp = torch.stack([torch.nn.functional.pad(x, (0, R - len(x))) for x in rows_lp])
    ent = torch.stack([torch.nn.functional.pad(x, (0, R - len(x))) for x in rows_ent])
    A, old, ref = b["advantages"].double(), b["old_log_probs"].double(), b["ref_log_probs"].double()
    ratio = torch.exp(logp - old)
    l1 = torch.maximum(-A * ratio, -A * ratio.clamp(0.8, 1.2))
    pg = torch.where(A < 0, torch.minimum(l1, -3.0 * A), l1)
    if weights is not None:
        pg = pg * weights
    d = ref - logp
    kl = torch.exp(d) - d - 1

    def agg(x):
        x = x * mask
        if mode == "token-mean":
            return x.sum() / mask.sum()
        rows = mask.sum(-1) > 0  # N counts the non-empty responses (rejection can empty one)
        if mode == "seq-mean-token-sum":
            return x.sum(-1)[rows].mean()
        if mode == "seq-mean-token-mean":
            return (x.sum(-1)[rows] / mask.sum(-1)[rows]).mean()
        return (x.sum(-1)[rows] / 8.0).mean()  # seq-mean-token-sum-norm, norm = data.max_response_length = 8

    terms = {"actor/pg_loss": agg(pg), "actor/entropy": agg(ent), "actor/kl": agg(kl)}
    loss = terms["actor/pg_loss"] - 0.01 * terms["actor/entropy"] + 0.1 * terms["actor/kl"]
    if distill_kl is not None:
        dt = b["teacher_log_probs"].double() - logp
        terms["actor/distill_kl_loss"] = agg(0.5 * dt**2 if distill_kl == "k2" else torch.exp(dt) - dt - 1)
        loss = loss + 0.3 * terms["actor/distill_kl_loss"]
    loss.backward()
    terms["actor/loss"] = loss
    return {k: float(v.detach()) for k, v in terms.items()}, {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_matches_float64_whole_batch(runs, mode):
    model, dp2, dp1 = runs
    values, grads = _reference(model, mode)
    for res in (dp2, dp1):
        got = res["grads"][("ppo", mode)]
        for k, g in grads.items():
            torch.testing.assert_close(got[k].double(), g, atol=2e-6, rtol=1e-5, msg=lambda m: f"{mode} {k}: {m}")
        for key, v in values.items():
            assert res["metrics"][("ppo", mode)][key] == pytest.approx(v, abs=1e-6, rel=1e-6), (mode, key)


@pytest.mark.parametrize("kl_type,mode", DISTILL_CASES)
def test_distill_kl_loss_matches_float64_whole_batch(runs, kl_type, mode):
    """distill.mode = kl_loss: the KL to the teacher in the loss, the same gradient at dp 1 and 2, both equal to a
    float64 whole-batch reference from the full log-softmax."""
    model, dp2, dp1 = runs
    values, grads = _reference(model, mode, distill_kl=kl_type)
    for res in (dp2, dp1):
        got = res["distill"][(kl_type, mode)]
        for k, g in grads.items():
            torch.testing.assert_close(got["grads"][k].double(), g, atol=2e-6, rtol=1e-5, msg=lambda m: f"{kl_type} {k}: {m}")
        for key, v in values.items():
            assert got["metrics"][key] == pytest.approx(v, abs=1e-6, rel=1e-6), (kl_type, key)


def _correction64(is_level, rs_level):
    """Importance weights and kept-token mask of [rollout_correction], written out per response in float64."""
    import math

    b = with_rollout_log_probs(global_batch())
    B, R = b["responses"].shape
    w, keep = torch.zeros(B, R, dtype=torch.float64), torch.zeros(B, R, dtype=torch.float64)
    for i in range(B):
        n = int(b["response_len"][i])
        lr = [float(b["old_log_probs"][i, t]) - float(b["rollout_log_probs"][i, t]) for t in range(n)]
        if is_level == "token":
            w[i, :n] = torch.tensor([min(math.exp(x), RC["rollout_is_threshold"]) for x in lr], dtype=torch.float64)
        else:
            w[i, :n] = min(math.exp(sum(lr)), RC["rollout_is_threshold"])
        geo = math.exp(sum(lr) / n)
        ok = rs_level == "none" or RC["rollout_rs_threshold_lower"] <= geo <= RC["rollout_rs_threshold"]
        keep[i, :n] = float(ok)
    return w, keep


@pytest.mark.parametrize("case", RC_CASES, ids=[f"{a}-{b}" for a, b, _ in RC_CASES])
def test_rollout_correction_independent_of_layout_and_matches_float64(runs, case):
    """[rollout_correction]'s weights reach the loss and its rejection leaves the normalisation: the gradient at
    dp = 2 (two micro-batches per rank) equals dp = 1 and a float64 whole-batch PPO with the weights and mask
    written out here; the correction metrics are global (the same at both layouts)."""
    model, dp2, dp1 = runs
    is_level, rs_level, mode = case
    w, keep = _correction64(is_level, rs_level)
    if rs_level != "none":
        assert 0 < int((keep == 0).any(-1).sum()) < len(keep)  # some responses rejected, not all
    assert ((w > 0) & (w < RC["rollout_is_threshold"])).any() and (w == RC["rollout_is_threshold"]).any()
    values, grads = _reference(model, mode, weights=w, keep=keep)
    plain, _ = _reference(model, mode)
    assert abs(values["actor/pg_loss"] - plain["actor/pg_loss"]) > 1e-4  # the correction changes the objective
    for res in (dp2, dp1):
        got = res["rc"][case]
        for k, g in grads.items():
            torch.testing.assert_close(got["grads"][k].double(), g, atol=2e-6, rtol=1e-5,
                                       msg=lambda m: f"{case} {k}: {m}")
        for key, v in values.items():
            assert got["metrics"][key] == pytest.approx(v, abs=1e-6, rel=1e-6), (case, key)
    m2, m1 = dp2["rc"][case]["metrics"], dp1["rc"][case]["metrics"]
    rc_keys = [k for k in m1 if k.startswith("rollout_corr/")]
    assert m1["rollout_corr/rollout_is_truncated_fraction"] > 0
    for k in rc_keys:
        assert m2[k] == pytest.approx(m1[k], rel=1e-9, abs=1e-12), k


def _whiten64(x, mask):
    v = x[mask]
    return torch.where(mask, (x - v.mean()) / torch.sqrt(v.var(unbiased=True) + 1e-8), torch.zeros_like(x))


def _returns64(r, mask, gamma):
    out = torch.zeros_like(r)
    for i in range(r.shape[0]):
        run_ = 0.0
        for t in reversed(range(r.shape[1])):
            if mask[i, t]:
                run_ = r[i, t] + gamma * run_
                out[i, t] = run_
    return out


@pytest.mark.parametrize("name", ESTIMATORS)
def test_advantages_independent_of_layout(runs, name):
    _, dp2, dp1 = runs
    for a, b in zip(dp2["adv"][name], dp1["adv"][name]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    b = global_batch()
    mask = b["response_mask"] != 0
    r = b["token_level_rewards"].double()
    s = (r * mask).sum(-1)
    if name == "reinforce_plus_plus":  # independent float64 whole-batch reference (gamma 0.9 in the script)
        want = _whiten64(_returns64(r, mask, 0.9), mask)
    elif name == "reinforce_plus_plus_baseline":
        mean = torch.stack([s[b["index"] == g].mean() for g in b["index"]])
        want = _whiten64((s - mean)[:, None].expand_as(r).clone(), mask)
    elif name == "gae":
        v, out = b["values"].double(), torch.zeros_like(r)
        for i in range(len(r)):
            T = int(mask[i].sum())
            last = 0.0
            for t in reversed(range(T)):
                nv = v[i, t + 1] if t + 1 < T else 0.0
                last = r[i, t] + 0.9 * nv - v[i, t] + 0.9 * 0.8 * last
                out[i, t] = last
        want = _whiten64(out, mask)
    elif name == "gpg":
        mean = torch.stack([s[b["index"] == g].mean() for g in b["index"]])
        alpha = len(s) / max(int((s != 0).sum()), 1)
        want = (alpha * (s - mean))[:, None] * mask
    else:
        return
    torch.testing.assert_close(dp2["adv"][name][0].double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dp1["adv"][name][0].double(), want, atol=1e-6, rtol=1e-6)


def test_adaptive_kl_controller_input_is_global_mean_of_sequence_means(runs):
    _, dp2, dp1 = runs
    b = global_batch()
    mask = b["response_mask"].double()
    kl = (b["old_log_probs"] - b["ref_log_probs"]).double() * mask
    want = float(((kl.sum(-1) / mask.sum(-1))).mean())  # every response counts once
    token_mean = float(kl.sum() / mask.sum())
    assert abs(want - token_mean) > 1e-3  # the two conventions differ on this batch
    assert dp2["controller_kl"] == pytest.approx(want, abs=1e-9)
    assert dp1["controller_kl"] == pytest.approx(want, abs=1e-9)


def test_take_global_rows_moves_rows_between_ranks(tmp_path):
    """Dynamic sampling's rebalance: ranks holding different numbers of kept samples end with equal slices of
    the rank-ordered concatenation (real gloo all-gathers, ragged widths padded)."""
    from take_rows import local_rows

    run([os.path.join(HERE, "dist_scripts", "take_rows.py"), str(tmp_path)], nproc=2)
    parts = [local_rows(r) for r in range(2)]
    width = max(p["tok"].shape[1] for p in parts)
    whole = {
        "uid": torch.cat([p["uid"] for p in parts]), "f": torch.cat([p["f"] for p in parts]),
        "tok": torch.cat([torch.nn.functional.pad(p["tok"], (0, width - p["tok"].shape[1])) for p in parts]),
    }
    for r in range(2):
        got = torch.load(tmp_path / f"rows_rank{r}.pt", weights_only=True)
        for k, v in whole.items():
            assert torch.equal(got[k], v[3 * r: 3 * r + 3]), (r, k)
