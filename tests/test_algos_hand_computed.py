"""Policy losses, advantage estimators, KL estimators and dynamic sampling beyond the PPO / GRPO core, each against
a hand computation or an independent float64 formula."""
import math

import pytest
import torch

from spmdrl.algos import ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from spmdrl.algos.agg import masked_moments, masked_whiten
from spmdrl.algos.kl import controller_kl
from spmdrl.algos.losses import resolve_agg_mode
from spmdrl.algos.sampling import dynamic_sampling_quota
from spmdrl.errors import ConfigError

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

D = torch.float64


def _grad(fn, logp):
    logp = logp.clone().requires_grad_(True)
    out = fn(logp)
    (out[0] if isinstance(out, tuple) else out).backward()
    out = (out[0].detach(), out[1]) if isinstance(out, tuple) else out.detach()
    return out, logp.grad


# ------------------------------------------------------------------------------------------------ KL


@pytest.mark.parametrize("name,base", [("k1+", "k1"), ("kl+", "k1"), ("k3+", "k3"), ("low_var_kl+", "low_var_kl")])
def test_straight_through_kl_value_of_base_gradient_of_k2(name, base):
    logp = torch.tensor([-1.0, -2.5, -0.3], dtype=D)
    ref = torch.tensor([-1.2, -2.0, -0.9], dtype=D)
    out, g = _grad(lambda x: KL_ESTIMATORS.get(name)(x, ref).sum(), logp)
    d = ref - logp
    want_value = (logp - ref).sum() if base in ("k1",) else (torch.exp(d) - d - 1).sum()
    assert float(out.detach()) == pytest.approx(float(want_value), abs=1e-12)
    torch.testing.assert_close(g, logp.detach() - ref)  # d/dlogp 0.5 (logp - ref)^2


# ------------------------------------------------------------------------------------------- losses

OLD = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]], dtype=D)
LOGP = torch.tensor([[-0.5, -1.1, -1.0], [-2.4, -1.95, 0.0]], dtype=D)
ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]], dtype=D)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)


def test_cispo_value_and_gradient():
    r = torch.exp(LOGP - OLD)
    rhat = r.clamp(1 - 0.2, 1 + 0.28)
    (loss, m), g = _grad(lambda x: POLICY_LOSSES.get("cispo")(OLD, x, ADV, MASK, clip_ratio_low=0.2,
                                                              clip_ratio_high=0.28), LOGP)
    n = MASK.sum()
    assert float(loss) == pytest.approx(float((-ADV * rhat * MASK).sum() / n), abs=1e-12)
    # the paper's gradient: -sg(r^) A d logp, on every token, clipped ones included (r = e^0.5 > 1.28)
    torch.testing.assert_close(g, -rhat * ADV * MASK / n)
    assert g[0, 0] != 0 and float(m["pg_clipfrac"]) == pytest.approx(1 / 5)


def test_sapo_value_and_gradient():
    r = torch.exp(LOGP - OLD)
    tau = torch.where(ADV > 0, torch.full_like(ADV, 1.0), torch.full_like(ADV, 2.0))
    sig = torch.sigmoid(tau * (r - 1))
    (loss, _), g = _grad(lambda x: POLICY_LOSSES.get("sapo")(OLD, x, ADV, MASK, sapo_tau_pos=1.0, sapo_tau_neg=2.0,
                                                             loss_agg_mode="seq-mean-token-mean"), LOGP)
    per_tok = -ADV * 4 / tau * sig
    seq = (per_tok * MASK).sum(-1) / MASK.sum(-1)
    assert float(loss) == pytest.approx(float(seq.mean()), abs=1e-12)
    dL = -ADV * 4 * sig * (1 - sig) * r  # d/dlogp of -A (4/tau) sigmoid(tau (r - 1)), r = e^(logp - old)
    torch.testing.assert_close(g, dL * MASK / MASK.sum(-1, keepdim=True) / 2)
    # on-policy the gate's slope is 1: plain policy gradient
    _, g1 = _grad(lambda x: POLICY_LOSSES.get("sapo")(x.detach(), x, ADV, MASK, loss_agg_mode="token-mean")[0], OLD)
    torch.testing.assert_close(g1, -ADV * MASK / MASK.sum())


def test_gpg_loss_is_plain_policy_gradient():
    (loss, _), g = _grad(lambda x: POLICY_LOSSES.get("gpg")(OLD, x, ADV, MASK), LOGP)
    assert float(loss) == pytest.approx(float((-ADV * LOGP * MASK).sum() / 5), abs=1e-12)
    torch.testing.assert_close(g, -ADV * MASK / 5)


def test_gmpo_geometric_mean_with_log_space_clip():
    lo, hi = 0.4, 0.4
    (loss, m), g = _grad(lambda x: POLICY_LOSSES.get("gmpo")(OLD, x, ADV, MASK, clip_ratio_low=lo, clip_ratio_high=hi,
                                                             loss_agg_mode="token-mean"), LOGP)
    # by hand: seq 0 (A = 1 > 0): d = [0.5, -0.1, 0] -> min(d, clip(d)) = [0.4, -0.1, 0]; rho = e^(0.3/3)
    # seq 1 (A = -2 < 0): d = [-0.4, 0.05] -> max(d, clip(d)) = [-0.4, 0.05]; rho = e^(-0.175)
    rho0, rho1 = math.exp(0.1), math.exp(-0.175)
    assert float(loss) == pytest.approx((-1.0 * rho0 + 2.0 * rho1) / 2, abs=1e-12)  # loss_agg_mode ignored
    # gradient: the clipped token (d = 0.5 > 0.4 with A > 0) gets none; others -A_i rho_i / |o_i| / 2
    want = torch.tensor([[0.0, -rho0 / 3 / 2, -rho0 / 3 / 2], [2 * rho1 / 2 / 2, 2 * rho1 / 2 / 2, 0.0]], dtype=D)
    torch.testing.assert_close(g, want)
    assert float(m["pg_clipfrac"]) == pytest.approx(1 / 5) and float(m["pg_clipfrac_lower"]) == 0.0


def test_clip_cov_detaches_the_top_covariance_token():
    old = torch.zeros(1, 4, dtype=D)
    logp = torch.tensor([[-3.0, 0.0, 0.1, -0.1]], dtype=D)  # r = [e^-3, 1, e^0.1, e^-0.1]
    adv = torch.tensor([[-3.0, 1.0, 1.0, 1.0]], dtype=D)
    mask = torch.ones(1, 4, dtype=D)
    # cov_t = (A - 0) (logp + 0.75) = [6.75, 0.75, 0.85, 0.65]; token 0 is clipped by PPO (A < 0, r < 0.8) so it
    # is not a candidate; candidates need 0.5 < cov < 5: tokens 1..3; k = max(1, 0.3 * 4) = 1 -> token 2
    (loss, m), g = _grad(lambda x: POLICY_LOSSES.get("clip_cov")(old, x, adv, mask, clip_cov_ratio=0.3,
                                                                 clip_cov_lb=0.5, clip_cov_ub=5.0), logp)
    ppo = torch.maximum(-adv * torch.exp(logp), -adv * torch.exp(logp).clamp(0.8, 1.2))
    assert float(loss) == pytest.approx(float((ppo[0, 0] + ppo[0, 1] + ppo[0, 3]) / 4), abs=1e-12)
    torch.testing.assert_close(g, torch.tensor([[0.0, -0.25, 0.0, -math.exp(-0.1) / 4]], dtype=D))
    assert float(m["pg_clipfrac"]) == pytest.approx(0.25)


def test_kl_cov_penalises_the_top_covariance_token():
    old = torch.zeros(1, 4, dtype=D)
    logp = torch.tensor([[-0.5, 0.1, 0.0, -0.2]], dtype=D)
    adv = torch.tensor([[-2.0, 1.0, 0.0, 0.5]], dtype=D)
    mask = torch.ones(1, 4, dtype=D)
    cov = (adv - adv.mean()) * (logp - logp.mean())  # token 0 has the largest
    assert int(cov.argmax()) == 0
    (loss, _), g = _grad(lambda x: POLICY_LOSSES.get("kl_cov")(old, x, adv, mask, kl_cov_ratio=0.25, kl_cov_coef=2.0),
                         logp)
    r = torch.exp(logp)
    want = (-adv * r).sum() + 2.0 * 0.5
    assert float(loss) == pytest.approx(float(want / 4), abs=1e-12)
    torch.testing.assert_close(g, (-adv * r + torch.tensor([[-2.0, 0, 0, 0]], dtype=D)) / 4)  # d|logp|/dlogp = -1


def test_sequence_level_losses_fix_their_aggregation():
    assert resolve_agg_mode("gspo", "auto") == "seq-mean-token-mean"
    assert resolve_agg_mode("gmpo", "seq-mean-token-mean") == "seq-mean-token-mean"
    assert resolve_agg_mode("ppo", "auto") == "token-mean"
    assert resolve_agg_mode("ppo", "seq-mean-token-sum-norm") == "seq-mean-token-sum-norm"
    with pytest.raises(ConfigError, match="actor.loss_agg_mode = 'token-mean' conflicts"):
        resolve_agg_mode("gspo", "token-mean")
    # GSPO ignores a loss_agg_mode passed directly: one token-level and one sequence-level call agree
    a = POLICY_LOSSES.get("gspo")(OLD, LOGP, ADV, MASK, loss_agg_mode="token-mean")[0]
    b = POLICY_LOSSES.get("gspo")(OLD, LOGP, ADV, MASK, loss_agg_mode="seq-mean-token-mean")[0]
    assert float(a) == float(b)


# --------------------------------------------------------------------------------------- advantages


def _rewards(scores, lengths):
    T = max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()
    r = torch.zeros(len(scores), T)
    r[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores)
    return r, mask


def test_grpo_passk_only_the_best_sample_learns():
    r, mask = _rewards([0.2, 0.9, 0.5, 1.0, 0.0, 1.0], [2, 1, 3, 1, 2, 2])
    index = torch.tensor([4, 4, 4, 9, 9, 9])
    adv, ret = ADV_ESTIMATORS.get("grpo_passk")(r, mask, index=index, epsilon=1e-6)
    std = torch.tensor([0.2, 0.9, 0.5], dtype=D).std()
    want0 = (0.9 - 0.5) / (float(std) + 1e-6)
    per_seq = adv.sum(-1) / mask.sum(-1)
    torch.testing.assert_close(per_seq, torch.tensor([0.0, want0, 0.0, 0.0, 0.0, 0.0]))  # tie in group 9: 0
    adv2, _ = ADV_ESTIMATORS.get("grpo_passk")(r, mask, index=index, norm_by_std=False)
    assert float(adv2[1, 0]) == pytest.approx(0.4) and torch.equal(adv, ret)


def test_opo_length_weighted_baseline():
    r, mask = _rewards([1.0, 0.0, 3.0], [2, 4, 5])
    adv, _ = ADV_ESTIMATORS.get("opo")(r, mask, index=torch.tensor([0, 0, 1]))
    b = (2 * 1.0 + 4 * 0.0) / 6  # sum |o| s / sum |o|
    torch.testing.assert_close(adv[0, :2], torch.full((2,), 1 - b))
    torch.testing.assert_close(adv[1, :4], torch.full((4,), -b))
    assert adv[2].abs().sum() == 0 and adv[0, 2:].abs().sum() == 0  # group of one; padding


def test_gpg_advantage_scale():
    r, mask = _rewards([1.0, 0.0, 0.0, 0.0], [1, 1, 1, 1])
    adv, _ = ADV_ESTIMATORS.get("gpg")(r, mask, index=torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(adv[:, 0], torch.tensor([2.0, -2.0, 0.0, 0.0]))  # alpha = B / M = 4 / 1
    # with a reduce (other ranks: 4 samples, 3 non-zero) alpha = 8 / 4
    adv, _ = ADV_ESTIMATORS.get("gpg")(r, mask, index=torch.tensor([0, 0, 1, 1]),
                                      reduce=lambda t: t + torch.tensor([4.0, 3.0], dtype=D))
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_whitening_statistics_combine_across_ranks_exactly():
    """Two 'ranks' (halves of a batch): each computes masked_moments on its half; the reduce adds the other
    half's vector, as the all-reduce would. The result equals float64 whitening of the whole batch."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g, dtype=D) * 3 + 7
    mask = torch.rand(6, 5, generator=g) > 0.3
    whole = x[mask]
    want = torch.where(mask, (x - whole.mean()) / torch.sqrt(whole.var() + 1e-8), torch.zeros_like(x))
    halves = [(x[:3], mask[:3]), (x[3:], mask[3:])]
    vecs = []
    for xh, mh in halves:  # the vector a rank contributes: [n, n*mu, M2, n*mu^2] of its own rows
        n, mu, m2 = masked_moments(xh, mh)
        vecs.append(torch.stack([n, n * mu, m2, n * mu * mu]))
    out = torch.cat([masked_whiten(xh, mh, reduce=lambda t, o=vecs[1 - i]: t + o) for i, (xh, mh) in enumerate(halves)])
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


def test_controller_kl_is_mean_of_sequence_means():
    kl = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0], [9.0, 9.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert controller_kl(kl, mask) == pytest.approx((1.0 + 3.0) / 2)  # the empty sequence does not count
    assert controller_kl(kl, mask, reduce=lambda t: t + torch.tensor([2.0, 2.0], dtype=D)) == pytest.approx(6 / 4)
    assert controller_kl(kl, torch.zeros(3, 4)) == 0.0


@pytest.mark.parametrize("kept,target,n,dp,want", [
    (64, 64, 4, 2, 32), (100, 64, 4, 2, 32), (40, 64, 4, 2, 20), (42, 64, 4, 2, 20), (7, 64, 4, 2, 0),
    (12, 64, 4, 4, 0), (16, 64, 4, 4, 4),
])
def test_dynamic_sampling_quota(kept, target, n, dp, want):
    assert dynamic_sampling_quota(kept, target, n, dp) == want


# ------------------------------------------------------------------------------- config validation


def _validate(world, *overrides):
    from spmdrl.config import load_config, validate

    cfg = load_config(None, ["model.path=m", 'data.train_files=["t.parquet"]', "actor.micro_batch_size=1", *overrides])
    return validate(cfg, world)


def test_layout_that_splits_groups_is_rejected_with_numbers():
    # rollout tp 2 -> rollout dp 4 divides 12 prompts, but 24 samples over 8 actor ranks = 3 per rank
    with pytest.raises(ConfigError) as e:
        _validate(8, "data.train_batch_size=12", "rollout.n=2", "placement.rollout_tp=2")
    msg = str(e.value)
    assert "data.train_batch_size = 12" in msg and "rollout.n = 2" in msg and "8 actor data-parallel" in msg
    assert "3 samples per rank" in msg and "multiple of 8" in msg
    _validate(8, "data.train_batch_size=16", "rollout.n=2", "placement.rollout_tp=2")  # 4 per rank: whole groups
    # an estimator without groups does not care (and without dynamic sampling)
    _validate(8, "data.train_batch_size=12", "rollout.n=2", "placement.rollout_tp=2",
              "algorithm.adv_estimator=reinforce_plus_plus")
    with pytest.raises(ConfigError, match="splits a prompt"):
        _validate(8, "data.train_batch_size=12", "rollout.n=2", "placement.rollout_tp=2",
                  "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.filter_groups=true")


def test_gspo_with_explicit_other_aggregation_is_rejected():
    _validate(2, "actor.policy_loss=gspo")
    _validate(2, "actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean")
    with pytest.raises(ConfigError, match="sequence-level objective"):
        _validate(2, "actor.policy_loss=gspo", "actor.loss_agg_mode=token-mean")
    with pytest.raises(ConfigError, match="actor.loss_agg_mode = 'sum' is not registered"):
        _validate(2, "actor.loss_agg_mode=sum")
    with pytest.raises(ConfigError, match="algorithm.filter_metric"):
        _validate(2, "algorithm.filter_metric=acc")
    with pytest.raises(ConfigError, match="actor.loss_agg_norm must be >= 0"):
        _validate(2, "actor.loss_agg_norm=-1")


@pytest.mark.parametrize("name", ["cispo", "sapo", "clip_cov", "kl_cov", "gmpo", "geo_mean", "gpg"])
def test_policy_losses_reachable_by_config(name):
    _validate(2, f"actor.policy_loss={name}")


@pytest.mark.parametrize("name", ["grpo_passk", "opo", "gpg"])
def test_estimators_reachable_by_config(name):
    _validate(2, f"algorithm.adv_estimator={name}")


@pytest.mark.parametrize("name", ["k1+", "k3+", "low_var_kl+"])
def test_straight_through_kl_reachable_by_config(name):
    _validate(2, "actor.use_kl_loss=true", f"actor.kl_loss_type={name}")
