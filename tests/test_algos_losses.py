"""Loss aggregation, masked reductions, policy losses (PPO dual-clip, GSPO), value loss."""
import math

import pytest
import torch

from spmdrl.algos import (
    LOSS_AGG,
    POLICY_LOSSES,
    agg_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    value_loss,
)
from spmdrl.errors import ConfigError, SpmdrlError

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

NAN = float("nan")

# ------------------------------------------------------------------ masked reductions and agg_loss

L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode,kw,want",
    [
        ("token-mean", {}, 7 / 3),  # (1 + 2 + 4) / 3
        ("seq-mean-token-sum", {}, 3.5),  # mean(3, 4); the empty row is skipped
        ("seq-mean-token-mean", {}, 2.75),  # mean(1.5, 4)
        ("seq-mean-token-sum-norm", {"norm": 3.0}, 7 / 6),  # mean(3/3, 4/3)
        ("seq-mean-token-sum-norm", {"norm": 2.0}, 1.75),  # mean(3/2, 4/2)
    ],
)
def test_agg_loss_hand(mode, kw, want):
    x = L.clone()
    x[2, 0] = NAN  # masked garbage
    x.requires_grad_(True)
    out = agg_loss(x, M, mode, **kw)
    assert out.item() == pytest.approx(want)
    out.backward()
    assert torch.isfinite(x.grad).all() and (x.grad[M == 0] == 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG.names())
def test_agg_loss_all_masked_is_zero(mode):
    x = torch.full((2, 3), NAN, requires_grad=True)
    out = agg_loss(x, torch.zeros(2, 3), mode, norm=4.0)
    assert out.item() == 0.0
    out.backward()
    assert (x.grad == 0).all()
    assert agg_loss(torch.zeros(2, 0), torch.zeros(2, 0), mode, norm=4.0).item() == 0.0


def test_agg_loss_errors():
    with pytest.raises(ConfigError) as e:
        agg_loss(L, M, "seq-sum")
    assert "token-mean" in str(e.value) and "seq-mean-token-sum-norm" in str(e.value)
    with pytest.raises(SpmdrlError, match="shape"):
        agg_loss(L, M[:, :2], "token-mean")
    # Dr. GRPO's divisor must be a constant of the run, never the padded width of whatever rows are given
    with pytest.raises(SpmdrlError, match="constant norm"):
        agg_loss(L, M, "seq-mean-token-sum-norm")


def test_masked_reductions_hand():
    x = torch.tensor([[1.0, 3.0, NAN], [2.0, NAN, NAN]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sum(x, m).item() == 6.0
    assert masked_mean(x, m).item() == 2.0
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([2.0, 2.0]))
    assert masked_var(x, m).item() == pytest.approx(1.0)  # [1, 3, 2]: sum sq dev 2, / (3 - 1)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2 / 3)
    torch.testing.assert_close(masked_var(x, m, dim=-1), torch.tensor([2.0, 0.0]))  # one element -> 0
    torch.testing.assert_close(masked_whiten(x, m), torch.tensor([[-1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    unshifted = masked_whiten(x, m, shift_mean=False)
    torch.testing.assert_close(unshifted, torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]]))
    empty = torch.zeros(2, 3)
    for fn in (masked_sum, masked_mean, masked_var):
        assert fn(x, empty).item() == 0.0
    assert (masked_whiten(x, empty) == 0).all()
    assert (masked_whiten(torch.full((3, 3), 0.1), torch.ones(3, 3)) == 0).all()


def test_masked_mean_float_weights_vs_float64():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 7, generator=g), torch.rand(5, 7, generator=g)
    torch.testing.assert_close(masked_mean(x, w).double(), (x.double() * w).sum() / w.double().sum())


# ------------------------------------------------------------------ PPO


def test_ppo_hand():
    # ratios r = [0.5, 1, 1.5, 5], A = [1, -1, 1, -1]; 5th token masked with NaN garbage
    r = torch.tensor([[0.5, 1.0, 1.5, 5.0, 1.0]])
    old = torch.zeros(1, 5)
    logp = torch.log(r)
    logp[0, 4] = NAN
    logp.requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    loss, m = POLICY_LOSSES.get("ppo")(old, logp, adv, mask, **kw)
    # per token: max(-.5, -.8) = -.5 ; 1 ; max(-1.5, -1.2) = -1.2 (clipped) ; min(max(5, 1.2), 3) = 3 (dual)
    assert loss.item() == pytest.approx((-0.5 + 1.0 - 1.2 + 3.0) / 4)
    assert m["pg_clipfrac"].item() == pytest.approx(0.25)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert m["ppo_kl"].item() == pytest.approx(-(math.log(0.5) + math.log(1.5) + math.log(5)) / 4)
    loss.backward()
    # d/dlogp of -A r / 4 where neither clip is active, else 0
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5 / 4, 1.0 / 4, 0.0, 0.0, 0.0]]))


def test_ppo_asymmetric_clip():
    r = torch.tensor([[1.25]])
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)  # DAPO clip-higher: 1.25 is inside [0.8, 1.28]
    loss, m = POLICY_LOSSES.get("ppo")(torch.zeros(1, 1), r.log(), torch.ones(1, 1), torch.ones(1, 1), **kw)
    assert loss.item() == pytest.approx(-1.25) and m["pg_clipfrac"].item() == 0.0


def _ppo_ref(old, logp, adv, mask, lo, hi, c):
    ratio = torch.exp(logp - old)
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)
    obj = torch.where(adv < 0, torch.maximum(obj, c * adv), obj)
    return -(obj * mask).sum() / mask.sum()


def test_ppo_vs_float64_reference():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 11
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=2.0)
    loss, m = POLICY_LOSSES.get("vanilla")(old, logp, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    logp_ref = logp.detach().clone().requires_grad_(True)
    ref = _ppo_ref(old, logp_ref, adv, mask, 0.2, 0.3, 2.0)
    (grad_ref,) = torch.autograd.grad(ref, logp_ref)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, grad_ref)
    assert 0 < m["pg_clipfrac"].item() < 1 and 0 < m["pg_clipfrac_lower"].item() < 1


def test_ppo_bad_dual_clip():
    x = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        POLICY_LOSSES.get("ppo")(x, x, x, x + 1, clip_ratio_c=1.0)


# ------------------------------------------------------------------ GSPO


def _gspo_batch():
    g = torch.Generator().manual_seed(3)
    B, T = 8, 10
    lengths = torch.tensor([10, 7, 3, 1, 0, 5, 9, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    logp = old + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = torch.where(mask.bool(), logp, torch.full_like(logp, NAN))
    a_seq = torch.randn(B, generator=g, dtype=torch.float64)
    return old, logp, a_seq, mask


def test_gspo_token_form_equals_sequence_form():
    old, logp0, a_seq, mask = _gspo_batch()
    lo, hi = 0.05, 0.08
    logp = logp0.clone().requires_grad_(True)
    adv = a_seq[:, None] * mask
    loss, m = POLICY_LOSSES.get("gspo")(old, logp, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi)
    (grad,) = torch.autograd.grad(loss, logp)

    # sequence-level objective: J = mean_i min(s_i A_i, clip(s_i) A_i) over non-empty sequences
    logp_ref = logp0.clone().requires_grad_(True)
    lr = torch.where(mask.bool(), logp_ref - old, torch.zeros_like(old))
    n = mask.sum(-1)
    nonempty = n > 0
    s = torch.exp(lr.sum(-1)[nonempty] / n[nonempty])
    a = a_seq[nonempty]
    ref = -torch.minimum(s * a, s.clamp(1 - lo, 1 + hi) * a).mean()
    (grad_ref,) = torch.autograd.grad(ref, logp_ref)

    clipped = ((s < 1 - lo) | (s > 1 + hi)).sum().item()
    assert 0 < clipped < len(s), "test must mix clipped and unclipped sequences"
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.nan_to_num(grad), torch.nan_to_num(grad_ref, nan=0.0))
    assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()
    assert m["pg_clipfrac_lower"].item() == 0.0


def test_gspo_ratio_is_sequence_level():
    # tokens of one sequence share the ratio exp(mean log-ratio) = exp(0) = 1 here: no clipping
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, -0.5]])
    loss, m = POLICY_LOSSES.get("gspo")(old, logp, torch.ones(1, 2), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-1.0) and m["pg_clipfrac"].item() == 0.0


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_losses_edge_cases(name):
    # all masked, zero-length, NaN garbage: loss 0, gradients 0, metrics finite
    for B, T in ((3, 4), (3, 0)):
        logp = torch.full((B, T), NAN, requires_grad=True)
        x = torch.full((B, T), NAN)
        loss, m = POLICY_LOSSES.get(name)(x, logp, x, torch.zeros(B, T))
        assert loss.item() == 0.0
        loss.backward()
        assert (logp.grad == 0).all()
        assert set(m) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
        assert all(torch.isfinite(v) for v in m.values())


def test_unknown_policy_loss_lists_registered():
    with pytest.raises(ConfigError) as e:
        POLICY_LOSSES.get("grpo")
    assert "ppo" in str(e.value) and "gspo" in str(e.value) and "vanilla" in str(e.value)


# ------------------------------------------------------------------ value loss


def test_value_loss_hand():
    v = torch.tensor([[1.0, 1.6, NAN]], requires_grad=True)
    old = torch.tensor([[1.5, 1.5, NAN]])
    ret = torch.tensor([[0.0, 3.0, NAN]])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = value_loss(v, old, ret, mask, cliprange_value=0.2)
    # t0: (1 - 0)^2 = 1 vs (1.3 - 0)^2 = 1.69 -> 1.69 (clipped) ; t1: inside the range, (1.6 - 3)^2 = 1.96
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.96) / 2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.5 * 2 * (1.6 - 3.0) / 2, 0.0]]))


def test_value_loss_all_masked():
    v = torch.full((2, 3), NAN, requires_grad=True)
    loss, m = value_loss(v, v.detach(), v.detach(), torch.zeros(2, 3), 0.5, "seq-mean-token-mean")
    assert loss.item() == 0.0 and m["vf_clipfrac"].item() == 0.0
    loss.backward()
    assert (v.grad == 0).all()


def test_informative_groups_keeps_groups_with_differing_scores():
    from spmdrl.algos.sampling import informative_groups

    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0])
    index = torch.tensor([3, 3, 5, 5, 9, 9, 11])  # group 11 has one sample: all equal
    assert informative_groups(scores, index).tolist() == [False, False, True, True, False, False, False]


def test_overlong_penalty_by_hand():
    from spmdrl.algos.sampling import overlong_penalty

    # max_len 10, buffer 4: no penalty up to 6, then -(len-6)/4, -1 at 10; times factor 0.5
    got = overlong_penalty(torch.tensor([0, 6, 7, 8, 10]), 10, 4, 0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "gmpo", "gspo"])
def test_log_ratio_clamp_keeps_far_off_policy_tokens_finite(name):
    """The documented +-20 log-ratio clamp (docs/algorithms.md, "Log-ratio clamp"): with A < 0 the ratio term is
    -A r; below 20 nats its gradient is -A r, past 20 the value is -A e^20 with zero gradient, and a log-ratio
    whose exp overflows float32 (100) still gives a finite loss and gradient."""
    fn = POLICY_LOSSES.get(name)
    kw = {"kl_cov_coef": 0.0} if name == "kl_cov" else {}
    for d, want_value, want_grad in ((19.0, math.exp(19.0), math.exp(19.0)), (25.0, math.exp(20.0), 0.0),
                                     (100.0, math.exp(20.0), 0.0)):
        old = torch.zeros(1, 1)
        logp = torch.full((1, 1), d, requires_grad=True)
        loss, _ = fn(old, logp, torch.full((1, 1), -1.0), torch.ones(1, 1), **kw)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (name, d)
        assert float(loss.detach()) == pytest.approx(want_value, rel=1e-5), (name, d)
        assert float(logp.grad[0, 0]) == pytest.approx(want_grad, rel=1e-5, abs=0.0), (name, d)
