"""Each loss and estimator against its paper's formula, written out here in float64 (never from the function
under test), for the cases where spmdrl's convention is a decision: CISPO far off-policy, GMPO's clip sign and
rollout weights, SAPO's aggregation, the ppo_kl metric, groups of one and masks with holes (docs/algorithms.md,
"Fidelity to the papers and to verl")."""
import math

import pytest
import torch

from spmdrl.algos import ADV_ESTIMATORS, POLICY_LOSSES
from spmdrl.algos.losses import resolve_agg_mode

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

D = torch.float64


def _grad(fn, logp):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = fn(logp)
    loss.backward()
    return loss.detach(), metrics, logp.grad


# --------------------------------------------------------------------------------------------- CISPO


def test_cispo_gradient_is_sg_clip_r_times_a_at_any_log_ratio():
    """MiniMax-M1 section 3.1: J = (1 / sum |o_i|) sum_it sg(r^_it) A_it log pi_it, r^ = clip(r, 1 - eps_low,
    1 + eps_high). Every token's gradient is -sg(r^) A / N, also at |log-ratio| > 20 (where a clamp on the gradient
    path used to give none)."""
    old = torch.zeros(1, 4, dtype=D)
    d = torch.tensor([[25.0, -25.0, 0.1, -0.3]], dtype=D)
    adv = torch.tensor([[1.0, -2.0, 0.5, 1.5]], dtype=D)
    mask = torch.ones(1, 4, dtype=D)
    rhat = torch.exp(d).clamp(0.8, 1.28)  # [1.28, 0.8, e^0.1, 0.8]
    loss, m, g = _grad(lambda x: POLICY_LOSSES.get("cispo")(old, x, adv, mask, clip_ratio_low=0.2,
                                                            clip_ratio_high=0.28), d)
    torch.testing.assert_close(g, -rhat * adv / 4, rtol=1e-12, atol=1e-15)
    assert float(loss) == pytest.approx(float((-adv * rhat).sum() / 4), abs=1e-12)
    assert float(m["pg_clipfrac"]) == 0.25 and float(m["pg_clipfrac_lower"]) == 0.5  # d=25 above; d=-25, -0.3 below
    # the paper's setting: no lower bound (eps_low = 1, r^ = min(r, 1 + eps_high))
    loss, _, g = _grad(lambda x: POLICY_LOSSES.get("cispo")(old, x, adv, mask, clip_ratio_low=1.0,
                                                            clip_ratio_high=0.28), d)
    rhat = torch.minimum(torch.exp(d), torch.tensor(1.28, dtype=D))
    torch.testing.assert_close(g, -rhat * adv / 4, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------- GMPO


def _gmpo_ref(old, logp, adv, mask, eps, w=None):
    """GMPO (arXiv 2507.20673): L_i = -A_i exp(mean_t d~_it), d~ = log-space clip, pessimistic by the sign of the
    response's advantage A_i; rollout weights by their geometric mean; mean over responses with a valid token."""
    losses = []
    for i in range(logp.shape[0]):
        pos = [t for t in range(logp.shape[1]) if mask[i, t]]
        if not pos:
            continue
        a = sum(float(adv[i, t]) for t in pos) / len(pos)
        dt = []
        for t in pos:
            di = float(logp[i, t] - old[i, t])
            ci = min(max(di, -eps), eps)
            dt.append(min(di, ci) if a > 0 else max(di, ci) if a < 0 else di)
        li = -a * math.exp(sum(dt) / len(dt))
        if w is not None:
            li *= math.exp(sum(math.log(float(w[i, t])) for t in pos) / len(pos))
        losses.append(li)
    return sum(losses) / len(losses)


def test_gmpo_clips_by_the_sign_of_the_response_advantage():
    """Token-level advantages of mixed sign and 0 (GAE, REINFORCE++): every token of a response with A_i > 0 is
    clipped from above, so rho_i is a pessimistic bound on the objective -A_i rho_i."""
    old = torch.zeros(1, 3, dtype=D)
    logp = torch.tensor([[0.1, 0.6, 0.5]], dtype=D)
    adv = torch.tensor([[2.0, -1.0, 0.0]], dtype=D)  # A_i = 1/3 > 0
    mask = torch.ones(1, 3, dtype=D)
    loss, m, g = _grad(lambda x: POLICY_LOSSES.get("gmpo")(old, x, adv, mask, clip_ratio_low=0.4,
                                                           clip_ratio_high=0.4), logp)
    rho = math.exp((0.1 + 0.4 + 0.4) / 3)  # min(d, 0.4) on every token
    assert float(loss) == pytest.approx(-rho / 3, abs=1e-12)
    assert float(loss) == pytest.approx(_gmpo_ref(old, logp, adv, mask, 0.4), abs=1e-12)
    # only the unclipped token moves rho: d loss / d logp_0 = -A_i rho / 3
    torch.testing.assert_close(g, torch.tensor([[-rho / 9, 0.0, 0.0]], dtype=D))
    assert float(m["pg_clipfrac"]) == pytest.approx(2 / 3) and float(m["pg_clipfrac_lower"]) == 0.0


def test_gmpo_rollout_weights_enter_as_their_geometric_mean():
    old = torch.zeros(2, 2, dtype=D)
    logp = torch.tensor([[0.1, -0.2], [0.05, 0.3]], dtype=D)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=D)
    mask = torch.ones(2, 2, dtype=D)
    w = torch.tensor([[0.5, 2.0], [0.25, 1.0]], dtype=D)  # geometric means 1 and 0.5 (arithmetic: 1.25, 0.625)
    fn = POLICY_LOSSES.get("gmpo")
    got = float(fn(old, logp, adv, mask, rollout_is_weights=w)[0])
    assert got == pytest.approx(_gmpo_ref(old, logp, adv, mask, 0.4, w), abs=1e-12)
    plain = [float(fn(old[i:i + 1], logp[i:i + 1], adv[i:i + 1], mask[i:i + 1])[0]) for i in range(2)]
    assert got == pytest.approx((plain[0] * 1.0 + plain[1] * 0.5) / 2, abs=1e-12)


def test_gmpo_empty_rows_do_not_count_and_zero_advantage_rows_do_not_move():
    old = torch.zeros(3, 2, dtype=D)
    logp = torch.tensor([[0.2, 0.1], [9.0, 9.0], [0.3, -0.2]], dtype=D)
    adv = torch.tensor([[1.0, 1.0], [5.0, 5.0], [1.0, -1.0]], dtype=D)  # row 2: A_i = 0
    mask = torch.tensor([[1, 1], [0, 0], [1, 1]], dtype=D)
    loss, _, g = _grad(lambda x: POLICY_LOSSES.get("gmpo")(old, x, adv, mask), logp)
    assert float(loss) == pytest.approx(_gmpo_ref(old, logp, adv, mask, 0.4), abs=1e-12)
    assert float(loss) == pytest.approx(-math.exp(0.15) / 2, abs=1e-12)  # (L_0 + 0) / 2 responses
    assert (g[1:] == 0).all()


# ---------------------------------------------------------------------------------------------- SAPO


def test_sapo_defaults_to_the_papers_sequence_mean():
    """SAPO (arXiv 2511.20347): J = (1/G) sum_i (1/|y_i|) sum_t f(r_it) A_it; "auto" resolves to it, an explicit
    other mode is honoured."""
    assert resolve_agg_mode("sapo", "auto") == "seq-mean-token-mean"
    assert resolve_agg_mode("sapo", "token-mean") == "token-mean"
    old = torch.zeros(2, 3, dtype=D)
    logp = torch.tensor([[0.2, -0.1, 0.0], [0.3, 0.0, 0.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=D)
    per_seq = []
    for i in range(2):
        pos = [t for t in range(3) if mask[i, t]]
        f = []
        for t in pos:
            tau = 1.0 if adv[i, t] > 0 else 1.05
            r = math.exp(float(logp[i, t] - old[i, t]))
            f.append(4 / tau / (1 + math.exp(-tau * (r - 1))) * float(adv[i, t]))
        per_seq.append(-sum(f) / len(pos))
    loss, _ = POLICY_LOSSES.get("sapo")(old, logp, adv, mask)
    assert float(loss) == pytest.approx(sum(per_seq) / 2, abs=1e-12)


# ------------------------------------------------------------------------------------------- ppo_kl


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_ppo_kl_is_the_unclamped_k1_mean_for_every_loss(name):
    old = torch.tensor([[-1.0, -2.0, -30.5], [-0.5, -1.0, 0.0]], dtype=D)
    logp = torch.tensor([[-1.2, -1.7, -0.5], [-0.6, 7.0, 0.0]], dtype=D)  # one token at log-ratio 30
    adv = torch.tensor([[1.0, -1.0, 0.5], [2.0, -0.5, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=D)
    want = ((-1.0 + 1.2) + (-2.0 + 1.7) + (-30.5 + 0.5) + (-0.5 + 0.6)) / 4
    _, m = POLICY_LOSSES.get(name)(old, logp, adv, mask)
    assert float(m["ppo_kl"]) == pytest.approx(want, abs=1e-12)


# ---------------------------------------------------------------------- groups of one, masks with holes


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"])
def test_a_group_of_one_gets_advantage_zero(name):
    """A lone sample has no baseline: advantage 0 (REINFORCE++-baseline: 0 before the batch whitening)."""
    r = torch.tensor([[0.0, 3.0], [0.0, 1.0], [0.0, 0.0]], dtype=D)
    mask = torch.ones(3, 2, dtype=D)
    index = torch.tensor([7, 8, 8])  # sample 0 alone in its group
    kw = {"whiten": False} if name == "reinforce_plus_plus_baseline" else {}
    adv, _ = ADV_ESTIMATORS.get(name)(r, mask, index=index, **kw)
    assert (adv[0] == 0).all()
    assert adv[1:].abs().sum() > 0  # the group of two does learn


HOLE_R = torch.tensor([[0.0, 0.0, 9.0, 0.0, 1.0]], dtype=D)  # 9.0 sits on a masked (tool) token
HOLE_M = torch.tensor([[1, 1, 0, 1, 1]], dtype=D)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"])
def test_outcome_scores_ignore_rewards_on_holes(name):
    """s_i = sum over VALID tokens of r_it: a reward on a masked position does not count."""
    r = torch.cat([HOLE_R, torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]], dtype=D)])
    mask = torch.cat([HOLE_M, torch.ones(1, 5, dtype=D)])
    index = torch.tensor([0, 0])
    kw = {"whiten": False} if name == "reinforce_plus_plus_baseline" else {}
    adv, _ = ADV_ESTIMATORS.get(name)(r, mask, index=index, **kw)
    r_valid = torch.cat([torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]], dtype=D), r[1:]])
    want, _ = ADV_ESTIMATORS.get(name)(r_valid, mask, index=index, **kw)
    torch.testing.assert_close(adv, want)
    assert (adv[0, 2] == 0).all() and adv[0, 0] != 0


def test_reinforce_pp_return_crosses_holes():
    """G_t = r_t + gamma G_t', t' the next VALID token: the outcome reward after a tool segment reaches the tokens
    before it, and the hole is not a discount step (verl resets the return at masked positions)."""
    adv, ret = ADV_ESTIMATORS.get("reinforce_plus_plus")(HOLE_R, HOLE_M, gamma=0.5, whiten=False)
    torch.testing.assert_close(ret, torch.tensor([[0.125, 0.25, 0.0, 0.5, 1.0]], dtype=D))
    torch.testing.assert_close(adv, ret)


def test_gae_bootstraps_across_holes():
    """delta_t = r_t + gamma V_t' - V_t and A_t = delta_t + gamma lam A_t', t' the next VALID token."""
    v = torch.tensor([[0.2, 0.4, 100.0, 0.6, 0.8]], dtype=D)  # the value on the hole is never read
    gamma, lam = 0.9, 0.5
    adv, ret = ADV_ESTIMATORS.get("gae")(HOLE_R, HOLE_M, values=v, gamma=gamma, lam=lam, whiten=False)
    a4 = 1.0 - 0.8
    a3 = 0.0 + gamma * 0.8 - 0.6 + gamma * lam * a4
    a1 = 0.0 + gamma * 0.6 - 0.4 + gamma * lam * a3
    a0 = 0.0 + gamma * 0.4 - 0.2 + gamma * lam * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, 0.0, a3, a4]], dtype=D))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.2, a1 + 0.4, 0.0, a3 + 0.6, a4 + 0.8]], dtype=D))


def test_opo_length_counts_valid_tokens_only():
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 0, 0, 1], [1, 1, 1, 0]], dtype=D)  # |o| = 2 (two holes) and 3
    adv, _ = ADV_ESTIMATORS.get("opo")(r, mask, index=torch.tensor([0, 0]))
    b = (2 * 1.0 + 3 * 0.0) / 5
    torch.testing.assert_close(adv, torch.tensor([[1 - b, 0, 0, 1 - b], [-b, -b, -b, 0]], dtype=D))


@pytest.mark.parametrize("name", ["gspo", "gmpo"])
def test_sequence_ratios_average_over_valid_tokens_only(name):
    """A hole neither counts in |o_i| nor contributes its (garbage) log-ratio to the sequence ratio."""
    old = torch.zeros(1, 3, dtype=D)
    logp = torch.tensor([[0.1, 50.0, 0.05]], dtype=D)
    adv = torch.ones(1, 3, dtype=D)
    holed = POLICY_LOSSES.get(name)(old, logp, adv, torch.tensor([[1, 0, 1]], dtype=D), clip_ratio_low=0.2,
                                    clip_ratio_high=0.2)[0]
    packed = POLICY_LOSSES.get(name)(old[:, :2], logp[:, [0, 2]], adv[:, :2], torch.ones(1, 2, dtype=D),
                                     clip_ratio_low=0.2, clip_ratio_high=0.2)[0]
    assert float(holed) == pytest.approx(float(packed), abs=1e-12)
    assert float(holed) == pytest.approx(-math.exp(0.075), abs=1e-12)


def test_outcome_score_sits_on_the_last_valid_token():
    """A response that ends inside a masked (tool) segment keeps its score: it goes on the last valid token."""
    from spmdrl.batch import Batch
    from spmdrl.loop.scoring import Scorer

    batch = Batch({
        "responses": torch.zeros(3, 5, dtype=torch.long),
        "response_len": torch.tensor([5, 3, 0]),
        "response_mask": torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.float32),
        "scores": torch.tensor([2.0, -1.0, 7.0]),
    })
    Scorer.place_token_scores(batch)
    want = torch.zeros(3, 5)
    want[0, 1], want[1, 2] = 2.0, -1.0
    torch.testing.assert_close(batch["token_level_scores"], want)
