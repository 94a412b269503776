"""Advantage estimators: hand-computed cases, an independent float64 loop reference, edge cases."""
import math
import statistics

import pytest
import torch

from spmdrl.algos import ADV_ESTIMATORS, discounted_returns, group_stats
from spmdrl.errors import ConfigError, SpmdrlError

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

NAN = float("nan")
H = math.sqrt(3) / 2  # (1 - 0.5) / stdev([1, 0, 0, 1])


# ------------------------------------------------------------------ fixtures: a hand-made batch


def hand_batch():
    """7 samples, T=4. Group 10: scores [1, 0, 0, 1]; group 42: one sample; group 7: all-equal scores.
    Masked reward slots hold NaN / junk that must be ignored."""
    mask = torch.tensor(
        [
            [1, 1, 1, 0],
            [1, 1, 0, 0],
            [1, 0, 0, 0],
            [1, 1, 1, 1],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 0, 0, 0],
        ]
    )
    r = torch.zeros(7, 4)
    r[0, 2], r[3, 3], r[4, 1], r[5, 2], r[6, 0] = 1.0, 1.0, 1.0, 2.0, 2.0
    r[1, 3], r[2, 2], r[6, 3] = NAN, 99.0, NAN
    index = torch.tensor([10, 10, 10, 10, 42, 7, 7])
    return r, mask, index


def rows(per_seq, mask):
    return torch.tensor(per_seq, dtype=torch.float32)[:, None] * mask


# ------------------------------------------------------------------ hand-computed cases


def test_grpo_hand():
    r, mask, index = hand_batch()
    adv, ret = ADV_ESTIMATORS.get("grpo")(r, mask, index=index, epsilon=0.0)
    torch.testing.assert_close(adv, rows([H, -H, -H, H, 0, 0, 0], mask))
    torch.testing.assert_close(ret, adv)
    adv, _ = ADV_ESTIMATORS.get("grpo")(r, mask, index=index)  # default epsilon 1e-6
    torch.testing.assert_close(adv, rows([H, -H, -H, H, 0, 0, 0], mask), rtol=1e-5, atol=1e-5)


def test_drgrpo_hand_and_alias():
    r, mask, index = hand_batch()
    want = rows([0.5, -0.5, -0.5, 0.5, 0, 0, 0], mask)
    adv, _ = ADV_ESTIMATORS.get("drgrpo")(r, mask, index=index)
    torch.testing.assert_close(adv, want)
    adv, _ = ADV_ESTIMATORS.get("grpo")(r, mask, index=index, norm_by_std=False)
    torch.testing.assert_close(adv, want)
    adv, _ = ADV_ESTIMATORS.get("drgrpo")(r, mask, index=index, norm_by_std=True)  # alias ignores it
    torch.testing.assert_close(adv, want)


def test_rloo_hand():
    r, mask, index = hand_batch()
    adv, ret = ADV_ESTIMATORS.get("rloo")(r, mask, index=index)
    # 1 - mean(0, 0, 1) = 2/3 ; 0 - mean(1, 0, 1) = -2/3
    torch.testing.assert_close(adv, rows([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0], mask))
    torch.testing.assert_close(ret, adv)


def test_reinforce_pp_hand():
    r = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = ADV_ESTIMATORS.get("reinforce_plus_plus")(r, mask, gamma=0.5)
    # return-to-go with gamma 0.5: row0 [1 + .5*1, 0 + .5*2, 2] ; row1 [0 + .5*3, 3]
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 2.0], [1.5, 3.0, 0.0]]))
    # valid returns [1.5, 1, 2, 1.5, 3]: mean 1.8, unbiased var 2.3 / 4 = 0.575
    dev = torch.tensor([[-0.3, -0.8, 0.2], [-0.3, 1.2, 0.0]])
    torch.testing.assert_close(adv, dev / math.sqrt(0.575))
    adv, _ = ADV_ESTIMATORS.get("reinforce_plus_plus")(r, mask, gamma=0.5, whiten=False)
    torch.testing.assert_close(adv, ret)


def test_discount_skips_masked_holes():
    # multi-turn: the middle token is tool output (masked); it does not count as a discount step
    r = torch.tensor([[0.0, 5.0, 1.0]])
    mask = torch.tensor([[1, 0, 1]])
    torch.testing.assert_close(discounted_returns(r, mask != 0, 0.5), torch.tensor([[0.5, 0.0, 1.0]]))
    torch.testing.assert_close(discounted_returns(r, mask != 0, 1.0), torch.tensor([[1.0, 0.0, 1.0]]))


def test_reinforce_pp_baseline_hand():
    r, mask, index = hand_batch()
    adv, _ = ADV_ESTIMATORS.get("reinforce_plus_plus_baseline")(r, mask, index=index, whiten=False)
    torch.testing.assert_close(adv, rows([0.5, -0.5, -0.5, 0.5, 0, 0, 0], mask))
    adv, _ = ADV_ESTIMATORS.get("reinforce_plus_plus_baseline")(r, mask, index=index)
    # valid token values: +.5 x (3 + 4), -.5 x (2 + 1), 0 x (2 + 3 + 1): n = 16, mean = 2/16 = 0.125
    vals = [0.5] * 7 + [-0.5] * 3 + [0.0] * 6
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    want = rows([(x - mu) / sd for x in (0.5, -0.5, -0.5, 0.5, 0, 0, 0)], mask)
    torch.testing.assert_close(adv, want, rtol=1e-5, atol=1e-6)


def test_gae_hand():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, NAN]])
    v = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = ADV_ESTIMATORS.get("gae")(r, mask, values=v, gamma=1.0, lam=1.0, whiten=False)
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t ; value past the last valid token is 0
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3], [0.5, 0.4, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    # gamma = 0.9, lam = 0.5, row 0: deltas [0 + .54 - .5, 0 + .63 - .6, 1 - .7] = [.04, .03, .3]
    adv, _ = ADV_ESTIMATORS.get("gae")(r[:1], mask[:1], values=v[:1], gamma=0.9, lam=0.5, whiten=False)
    a2 = 0.3
    a1 = 0.03 + 0.45 * a2
    a0 = 0.04 + 0.45 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]]))


def test_remax_hand():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = ADV_ESTIMATORS.get("remax")(r, mask, baseline_rewards=torch.tensor([0.25, 1.0]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.75], [-0.5, -0.5, 0.0]]))


def test_group_stats_matches_torch_std():
    s = torch.tensor([1.0, 4.0, 2.0, 8.0, 3.0])
    idx = torch.tensor([5, 9, 5, 9, 100])
    mean, std, n = group_stats(s, idx)
    torch.testing.assert_close(mean, torch.tensor([1.5, 6.0, 1.5, 6.0, 3.0], dtype=torch.float64))
    g0, g1 = torch.tensor([1.0, 2.0]).std().item(), torch.tensor([4.0, 8.0]).std().item()
    torch.testing.assert_close(std, torch.tensor([g0, g1, g0, g1, 0.0], dtype=torch.float64))
    torch.testing.assert_close(n, torch.tensor([2.0, 2, 2, 2, 1], dtype=torch.float64))


# ------------------------------------------------------------------ independent float64 reference


def _valid_positions(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def ref_scores(r, mask):
    return [sum(float(r[i, t]) for t in _valid_positions(mask, i)) for i in range(r.shape[0])]


def ref_groups(index):
    groups = {}
    for i, g in enumerate(index.tolist()):
        groups.setdefault(g, []).append(i)
    return groups


def ref_per_seq(r, mask, index, kind, eps=1e-6):
    s = ref_scores(r, mask)
    out = [0.0] * len(s)
    for members in ref_groups(index).values():
        vals = [s[i] for i in members]
        n = len(vals)
        for i in members:
            if n == 1:
                continue
            mu = sum(vals) / n
            if kind == "grpo":
                out[i] = (s[i] - mu) / (statistics.stdev(vals) + eps)
            elif kind == "drgrpo" or kind == "baseline":
                out[i] = s[i] - mu
            elif kind == "rloo":
                out[i] = s[i] - (sum(vals) - s[i]) / (n - 1)
    return out


def ref_rtg(r, mask, gamma):
    out = torch.zeros(r.shape, dtype=torch.float64)
    for i in range(r.shape[0]):
        pos = _valid_positions(mask, i)
        g = 0.0
        for t in reversed(pos):
            g = float(r[i, t]) + gamma * g
            out[i, t] = g
    return out


def ref_gae(r, v, mask, gamma, lam):
    adv = torch.zeros(r.shape, dtype=torch.float64)
    for i in range(r.shape[0]):
        pos = _valid_positions(mask, i)
        last, next_v = 0.0, 0.0
        for t in reversed(pos):
            delta = float(r[i, t]) + gamma * next_v - float(v[i, t])
            last = delta + gamma * lam * last
            next_v = float(v[i, t])
            adv[i, t] = last
    return adv


def ref_whiten(x, mask):
    vals = [float(x[i, t]) for i in range(x.shape[0]) for t in _valid_positions(mask, i)]
    mu = sum(vals) / len(vals)
    var = sum((a - mu) ** 2 for a in vals) / (len(vals) - 1)
    out = (x.double() - mu) / math.sqrt(var + 1e-8)
    return out * mask


@pytest.fixture
def random_batch():
    g = torch.Generator().manual_seed(0)
    B, T = 24, 9
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[3] = 0  # zero-length response
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    mask[5, 2] = 0  # a hole (masked tool output) inside a response
    mask[5, :6] = torch.tensor([1, 1, 0, 1, 1, 1])
    r = torch.randn(B, T, generator=g)
    r = torch.where(mask.bool(), r, torch.full_like(r, NAN))  # garbage in masked slots
    v = torch.where(mask.bool(), torch.randn(B, T, generator=g), torch.full_like(r, NAN))
    index = torch.randint(0, 7, (B,), generator=g)
    index[0] = 1000  # a group of one
    return r, v, mask, index


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_group_estimators_vs_reference(random_batch, name):
    r, _, mask, index = random_batch
    adv, _ = ADV_ESTIMATORS.get(name)(r, mask, index=index)
    want = torch.tensor(ref_per_seq(r, mask, index, name), dtype=torch.float64)[:, None] * mask
    torch.testing.assert_close(adv.double(), want, rtol=1e-5, atol=1e-5)


def test_reinforce_pp_vs_reference(random_batch):
    r, _, mask, _ = random_batch
    for gamma in (1.0, 0.9):
        adv, ret = ADV_ESTIMATORS.get("reinforce_plus_plus")(r, mask, gamma=gamma)
        want_ret = ref_rtg(r, mask, gamma)
        torch.testing.assert_close(ret.double(), want_ret, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(adv.double(), ref_whiten(want_ret, mask), rtol=1e-4, atol=1e-5)


def test_reinforce_pp_baseline_vs_reference(random_batch):
    r, _, mask, index = random_batch
    adv, _ = ADV_ESTIMATORS.get("reinforce_plus_plus_baseline")(r, mask, index=index)
    per_tok = torch.tensor(ref_per_seq(r, mask, index, "baseline"), dtype=torch.float64)[:, None] * mask
    torch.testing.assert_close(adv.double(), ref_whiten(per_tok, mask), rtol=1e-4, atol=1e-5)


def test_gae_vs_reference(random_batch):
    r, v, mask, _ = random_batch
    want = ref_gae(r, v, mask, 0.95, 0.9)
    adv, ret = ADV_ESTIMATORS.get("gae")(r, mask, values=v, gamma=0.95, lam=0.9, whiten=False)
    torch.testing.assert_close(adv.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), (want + torch.nan_to_num(v.double())) * mask, rtol=1e-5, atol=1e-5)
    adv_w, _ = ADV_ESTIMATORS.get("gae")(r, mask, values=v, gamma=0.95, lam=0.9)
    torch.testing.assert_close(adv_w.double(), ref_whiten(want, mask), rtol=1e-4, atol=1e-5)


def test_remax_vs_reference(random_batch):
    r, _, mask, _ = random_batch
    b = torch.randn(r.shape[0], dtype=torch.float64)
    adv, ret = ADV_ESTIMATORS.get("remax")(r, mask, baseline_rewards=b.float())
    rtg = ref_rtg(r, mask, 1.0)
    torch.testing.assert_close(adv.double(), (rtg - b[:, None]) * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), rtg, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ one signature, edge cases, errors


def _call_all(r, mask, index):
    B, T = r.shape
    kw = dict(index=index, values=torch.zeros(B, T), baseline_rewards=torch.zeros(B), gamma=0.99, lam=0.95)
    return {name: ADV_ESTIMATORS.get(name)(r, mask, **kw) for name in ADV_ESTIMATORS.names()}


def _assert_clean(out, mask):
    for name, (adv, ret) in out.items():
        assert adv.shape == mask.shape and ret.shape == mask.shape, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all(), name


def test_all_estimators_same_signature_random(random_batch):
    r, _, mask, index = random_batch
    _assert_clean(_call_all(r, mask, index), mask)


def test_all_masked_batch_gives_zeros():
    r = torch.full((4, 5), NAN)
    mask = torch.zeros(4, 5, dtype=torch.long)
    out = _call_all(r, mask, torch.tensor([0, 0, 1, 2]))
    _assert_clean(out, mask)


def test_zero_length_time_axis():
    out = _call_all(torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool), torch.tensor([0, 0, 1]))
    _assert_clean(out, torch.zeros(3, 0))


def test_equal_rewards_give_zero_advantage():
    r = torch.zeros(6, 3)
    r[:, -1] = 0.7  # 0.7 is not exact in binary: means must still cancel exactly
    mask = torch.ones(6, 3, dtype=torch.long)
    out = _call_all(r, mask, torch.tensor([0, 0, 0, 1, 1, 1]))
    for name in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"):
        assert (out[name][0] == 0).all(), name
    adv, _ = ADV_ESTIMATORS.get("grpo")(r, mask, index=torch.tensor([0, 0, 0, 1, 1, 1]), epsilon=0.0)
    assert (adv == 0).all()


def test_large_batch_is_vectorised():
    B, T = 8192, 16
    g = torch.Generator().manual_seed(1)
    r = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    index = torch.arange(B) // 16
    adv, _ = ADV_ESTIMATORS.get("grpo")(r, mask, index=index)
    per_group = r.sum(-1).view(-1, 16)
    want = (per_group - per_group.mean(-1, keepdim=True)) / (per_group.std(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(adv[:, 0], want.reshape(-1), rtol=1e-4, atol=1e-4)


def test_unknown_estimator_lists_registered():
    with pytest.raises(ConfigError) as e:
        ADV_ESTIMATORS.get("ppo2")
    for name in ("grpo", "rloo", "gae", "remax", "reinforce_plus_plus"):
        assert name in str(e.value)


def test_missing_inputs_are_config_errors():
    r, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ConfigError, match="values"):
        ADV_ESTIMATORS.get("gae")(r, mask)
    with pytest.raises(ConfigError, match="baseline_rewards"):
        ADV_ESTIMATORS.get("remax")(r, mask)
    with pytest.raises(ConfigError, match="index"):
        ADV_ESTIMATORS.get("grpo")(r, mask)


def test_shape_errors():
    with pytest.raises(SpmdrlError, match="response_mask"):
        ADV_ESTIMATORS.get("grpo")(torch.zeros(2, 3), torch.ones(2, 4), index=torch.zeros(2, dtype=torch.long))
    with pytest.raises(SpmdrlError, match="index"):
        ADV_ESTIMATORS.get("grpo")(torch.zeros(2, 3), torch.ones(2, 3), index=torch.zeros(3, dtype=torch.long))
