"""Rollout correction (spmdrl/algos/rollout_correction.py) against references written out here in float64, one
response at a time; the weights inside the policy losses; the actor-side truncation (truncate_logits) against
a float64 nucleus written the other way round; config validation."""
import math

import pytest
import torch

from spmdrl.algos import POLICY_LOSSES
from spmdrl.algos.rollout_correction import rollout_correction
from spmdrl.algos.token_stats import logprobs_from_hidden, truncate_logits
from spmdrl.config import Config, validate
from spmdrl.errors import ConfigError

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def batch(seed=0, B=6, T=7, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([7, 3, 0, 5, 1, 6][:B])
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    old = -2.0 + 0.5 * torch.randn(B, T, generator=g)
    roll = old + spread * torch.randn(B, T, generator=g)
    roll[~mask.bool()] = float("nan")  # padding never reaches anything
    return old, roll, mask


def reference(old, roll, mask, is_level, C, rs_level, U, L, veto):
    """Per response, in float64 with Python math."""
    B = old.shape[0]
    w = torch.zeros(B, old.shape[1], dtype=torch.float64)
    keep = torch.zeros_like(w)
    units, trunc, dropped, seq_dropped, vetoed, tokens = [], 0, 0, 0, 0, 0
    for i in range(B):
        n = int(mask[i].sum())
        if n == 0:
            continue
        lr = [float(old[i, t]) - float(roll[i, t]) for t in range(n)]
        tokens += n
        if is_level == "token":
            for t in range(n):
                units.append(math.exp(lr[t]))
                trunc += math.exp(lr[t]) > C
                w[i, t] = min(math.exp(lr[t]), C)
        elif is_level == "sequence":
            prod = math.exp(sum(lr))
            units.append(prod)
            trunc += prod > C
            w[i, :n] = min(prod, C)
        k = [True] * n
        if rs_level == "token":
            k = [L <= math.exp(x) <= U for x in lr]
        elif rs_level == "sequence":
            k = [L <= math.exp(sum(lr)) <= U] * n
        elif rs_level == "geometric":
            k = [L <= math.exp(sum(lr) / n) <= U] * n
        if veto and any(math.exp(x) < veto for x in lr):
            vetoed += 1
            k = [False] * n
        keep[i, :n] = torch.tensor(k, dtype=torch.float64)
        dropped += n - sum(k)
        seq_dropped += sum(k) < n
    return w, keep, units, trunc, dropped, seq_dropped, vetoed, tokens


@pytest.mark.parametrize("is_level,rs_level,veto,U,L", [
    ("token", "none", 0.0, 1.25, 0.85), ("sequence", "none", 0.0, 1.25, 0.85), ("token", "token", 0.0, 1.25, 0.85),
    ("sequence", "geometric", 0.7, 1.07, 0.97), ("none", "sequence", 0.0, 1.25, 0.85),
    ("token", "geometric", 0.0, 1.07, 0.97),
])
def test_weights_mask_and_metrics_match_float64(is_level, rs_level, veto, U, L):
    old, roll, mask = batch()
    C = 1.3
    got = rollout_correction(old, roll, mask, rollout_is=is_level, rollout_is_threshold=C, rollout_rs=rs_level,
                             rollout_rs_threshold=U, rollout_rs_threshold_lower=L, rollout_token_veto_threshold=veto)
    ref = reference(old, roll, mask, is_level, C, rs_level, U, L, veto)
    w, keep, units, trunc, dropped, seq_dropped, vetoed, tokens = ref
    m = got.metrics
    valid = mask.bool()
    seqs = int((mask.sum(-1) > 0).sum())
    torch.testing.assert_close(got.response_mask.double(), keep)
    if is_level == "none":
        assert got.weights is None and "rollout_corr/rollout_is_mean" not in m
    else:
        torch.testing.assert_close(got.weights.double()[valid], w[valid], atol=1e-6, rtol=1e-6)
        assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(units) / len(units), rel=1e-9)
        assert m["rollout_corr/rollout_is_max"] == pytest.approx(max(units), rel=1e-9)
        assert m["rollout_corr/rollout_is_min"] == pytest.approx(min(units), rel=1e-9)
        mean = sum(units) / len(units)
        std = math.sqrt(sum((u - mean) ** 2 for u in units) / len(units))
        assert m["rollout_corr/rollout_is_std"] == pytest.approx(std, rel=1e-6)
        assert m["rollout_corr/rollout_is_truncated_fraction"] == pytest.approx(trunc / len(units))
        assert 0 < trunc < len(units)  # the cap really bites on this batch
    if rs_level != "none" or veto:
        assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(dropped / tokens)
        assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(seq_dropped / seqs)
        assert m["rollout_corr/rollout_rs_veto_fraction"] == pytest.approx(vetoed / seqs)
        assert 0 < dropped < tokens
    lr = [(float(old[i, t]) - float(roll[i, t])) for i in range(6) for t in range(int(mask[i].sum()))]
    assert m["rollout_corr/kl"] == pytest.approx(-sum(lr) / len(lr), rel=1e-9)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in lr) / len(lr), rel=1e-9)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in lr) / len(lr) - 1, rel=1e-9)
    def ppl(lp):
        lens = [int(mask[i].sum()) for i in range(6)]
        return sum(math.exp(-sum(float(lp[i, t]) for t in range(n)) / n) for i, n in enumerate(lens) if n) / seqs

    assert m["rollout_corr/training_ppl"] == pytest.approx(ppl(old), rel=1e-9)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(ppl(roll), rel=1e-9)


def test_lower_bound_defaults_to_reciprocal_and_metrics_are_global():
    old, roll, mask = batch(seed=1)
    a = rollout_correction(old, roll, mask, rollout_rs="token", rollout_rs_threshold=1.2)
    b = rollout_correction(old, roll, mask, rollout_rs="token", rollout_rs_threshold=1.2,
                           rollout_rs_threshold_lower=1 / 1.2)
    assert torch.equal(a.response_mask, b.response_mask)
    # two "ranks" holding halves, with reduce / reduce_max over both, give the whole batch's metrics
    whole = rollout_correction(old, roll, mask, rollout_is="sequence", rollout_is_threshold=1.1, rollout_rs="geometric",
                               rollout_rs_threshold=1.1)
    halves = [(old[:3], roll[:3], mask[:3]), (old[3:], roll[3:], mask[3:])]
    # emulate the all-reduce: collect what each half sends, then give both halves the combined vectors
    sums, maxes = [], []
    for o, r, mk in halves:
        rollout_correction(o, r, mk, rollout_is="sequence", rollout_is_threshold=1.1, rollout_rs="geometric",
                           rollout_rs_threshold=1.1, reduce=lambda t: sums.append(t) or t,
                           reduce_max=lambda t: maxes.append(t) or t)
    total, top = sums[0] + sums[1], torch.maximum(maxes[0], maxes[1])
    parts = [rollout_correction(o, r, mk, rollout_is="sequence", rollout_is_threshold=1.1, rollout_rs="geometric",
                                rollout_rs_threshold=1.1, reduce=lambda t: total, reduce_max=lambda t: top)
             for o, r, mk in halves]
    for k, v in whole.metrics.items():
        assert parts[0].metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
        assert parts[1].metrics[k] == parts[0].metrics[k]


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "sapo", "gpg", "gmpo"])
def test_weights_multiply_the_per_token_loss(name):
    """loss(weights w) == the loss's own aggregation of w * L, written out for token-mean (seq-mean-token-mean for
    gspo / gmpo / sapo): weights 1 leave the loss unchanged, and a weight of 0 removes a token's gradient."""
    g = torch.Generator().manual_seed(3)
    B, T = 4, 5
    mask = (torch.arange(T)[None] < torch.tensor([5, 2, 4, 3])[:, None]).float()
    old = (-1.5 + 0.2 * torch.randn(B, T, generator=g)).double()
    lp = (old + 0.1 * torch.randn(B, T, generator=g).double()).requires_grad_(True)
    adv = torch.randn(B, T, generator=g).double()
    w = (0.5 + torch.rand(B, T, generator=g)).double()
    fn = POLICY_LOSSES.get(name)
    base, _ = fn(old, lp, adv, mask)
    same, _ = fn(old, lp, adv, mask, rollout_is_weights=torch.ones(B, T, dtype=torch.float64))
    assert float(same.detach()) == pytest.approx(float(base.detach()), rel=1e-12)
    got, _ = fn(old, lp, adv, mask, rollout_is_weights=w)
    if name in ("gspo", "gmpo", "sapo"):
        # sequence-level objectives: gspo's token-level form (every token carries the sequence's loss value)
        # averages w * L over each response; gmpo weighs its per-sequence loss by the GEOMETRIC mean of the
        # response's weights (the geometric mean of rho_t * w_t); sapo's default aggregation is seq-mean-token-mean
        per_tok = []
        for i in range(B):
            n = int(mask[i].sum())
            lr = lp[i, :n] - old[i, :n]
            if name == "gspo":
                s = torch.exp(lr.mean())
                li = torch.maximum(-adv[i, :n] * s, -adv[i, :n] * s.clamp(0.8, 1.2))
                per_tok.append((w[i, :n] * li).mean())
            elif name == "sapo":
                a = adv[i, :n]
                gate = torch.where(a > 0, 4 / 1.0 * torch.sigmoid(1.0 * (torch.exp(lr) - 1)),
                                   4 / 1.05 * torch.sigmoid(1.05 * (torch.exp(lr) - 1)))
                per_tok.append((w[i, :n] * -a * gate).mean())
            else:
                a = adv[i, :n].mean()
                d = torch.minimum(lr, lr.clamp(-0.4, 0.4)) if a > 0 else torch.maximum(lr, lr.clamp(-0.4, 0.4))
                per_tok.append(-a * torch.exp(d.mean()) * torch.exp(torch.log(w[i, :n]).mean()))
        want = torch.stack(per_tok).mean()
    else:
        ratio = torch.exp(lp - old)
        clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        L = {"ppo": lambda: torch.where(adv < 0, torch.minimum(clipped, -3 * adv), clipped),
             "cispo": lambda: -adv * ratio.clamp(0.8, 1.2),
             "gpg": lambda: -adv * lp}[name]()
        want = (w * L * mask).sum() / mask.sum()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-9)
    zero = w.clone()
    zero[0, 1] = 0.0
    lp.grad = None
    fn(old, lp, adv, mask, rollout_is_weights=zero)[0].backward()
    if name not in ("gspo", "gmpo"):  # sequence-level: a token's gradient also flows through its sequence's ratio
        assert float(lp.grad[0, 1]) == 0.0


def test_truncate_logits_matches_a_float64_nucleus_and_the_actor_path():
    """truncate_logits (vLLM's ascending-cumsum rule) equals the descending 'mass before < p' rule in float64, and
    logprobs_from_hidden(top_k, top_p) is log_softmax over the kept set."""
    g = torch.Generator().manual_seed(0)
    V, H, N = 40, 8, 12
    w = torch.randn(V, H, generator=g)
    h = torch.randn(N, H, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    for temp, top_k, top_p in ((0.7, -1, 0.9), (1.0, 7, 1.0), (0.7, 12, 0.8)):
        z = (h.double() @ w.double().T) / temp
        keep = torch.ones_like(z, dtype=torch.bool)
        if top_k > 0:
            keep &= z >= torch.sort(z, -1, descending=True).values[:, top_k - 1: top_k]
        p = torch.softmax(torch.where(keep, z, -torch.inf), -1)
        ps, order = torch.sort(p, -1, descending=True)
        before = torch.cumsum(ps, -1) - ps
        nuc = torch.zeros_like(keep).scatter(-1, order, before < top_p)
        nuc.scatter_(-1, order[:, :1], True)
        want = torch.log_softmax(torch.where(keep & nuc, z, -torch.inf), -1)
        got_z = truncate_logits(z.float(), top_k, top_p)
        assert torch.equal(torch.isfinite(got_z), keep & nuc)
        lp, _ = logprobs_from_hidden(h, w, y, temperature=temp, top_k=top_k, top_p=top_p, with_entropy=False,
                                     chunk_size=5)
        ref = want.gather(-1, y[:, None])[:, 0]
        inside = torch.isfinite(ref)
        assert inside.any() and (~inside).any() if top_p < 1 else True
        torch.testing.assert_close(lp.double()[inside], ref[inside], atol=1e-5, rtol=0)
        assert torch.isneginf(lp[~inside]).all()


@pytest.mark.parametrize("key,value,match", [
    ("rollout_is", "geometric", "rollout_correction.rollout_is = 'geometric' is not one of none, token, sequence"),
    ("rollout_rs", "seq", "rollout_correction.rollout_rs"),
    ("rollout_is_threshold", 0.0, "rollout_correction.rollout_is_threshold must be > 0"),
    ("rollout_rs_threshold_lower", 3.0, "rollout_correction.rollout_rs_threshold_lower = 3.0 must be >= 0 and below"),
    ("rollout_token_veto_threshold", 1.5, "rollout_correction.rollout_token_veto_threshold must be in"),
])
def test_config_errors_are_one_line(key, value, match):
    cfg = Config()
    cfg.model.path, cfg.data.train_files = "m", ["t.parquet"]
    setattr(cfg.rollout_correction, key, value)
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")) as e:
        validate(cfg, world_size=1)
    assert "\n" not in str(e.value)


def test_config_rejects_a_loss_that_cannot_take_the_weights():
    from spmdrl.algos.losses import POLICY_LOSSES as REG

    @REG.register("_no_weights_test_loss")
    def plain(old_log_prob, log_prob, advantages, response_mask, **_):
        raise AssertionError("not called")

    try:
        cfg = Config()
        cfg.model.path, cfg.data.train_files = "m", ["t.parquet"]
        cfg.actor.policy_loss, cfg.rollout_correction.rollout_is = "_no_weights_test_loss", "token"
        with pytest.raises(ConfigError, match="takes no rollout_is_weights"):
            validate(cfg, world_size=1)
        cfg.rollout_correction.rollout_is_in_loss = False
        validate(cfg, world_size=1)
    finally:
        REG._fns.pop("_no_weights_test_loss")
