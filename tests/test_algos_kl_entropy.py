"""KL estimators and controllers; log-probs and entropy (full-vocab and chunked) against float64."""
import math

import pytest
import torch

from spmdrl.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_hidden,
    logprobs_from_logits,
)
from spmdrl.errors import ConfigError, SpmdrlError

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

LN2 = math.log(2)
NAN = float("nan")

# ------------------------------------------------------------------ KL estimators

LOGP = torch.tensor([[0.0, LN2]])
REF = torch.tensor([[LN2, 0.0]])


@pytest.mark.parametrize(
    "kinds,want",
    [
        (("k1", "kl"), [-LN2, LN2]),
        (("abs",), [LN2, LN2]),
        (("k2", "mse"), [0.5 * LN2**2, 0.5 * LN2**2]),
        # exp(d) - d - 1 with d = ref - logp: d = ln2 -> 2 - ln2 - 1 ; d = -ln2 -> 1/2 + ln2 - 1
        (("k3", "low_var_kl"), [1 - LN2, LN2 - 0.5]),
    ],
)
def test_kl_hand(kinds, want):
    for kind in kinds:
        torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor([want]))


def test_k3_vs_float64_and_clamped():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 6, generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)  # inside the [-10, 10] clamp
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), (ref - lp).exp() - (ref - lp) - 1)
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    big = kl_penalty(torch.tensor([[-1000.0]]), torch.tensor([[0.0]]), "k3")
    assert big.item() == 10.0


def test_kl_penalty_mask_and_nan():
    lp = torch.tensor([[0.0, NAN]], requires_grad=True)
    ref = torch.tensor([[LN2, NAN]])
    mask = torch.tensor([[1, 0]])
    for kind in KL_ESTIMATORS.names():
        kl = kl_penalty(lp, ref, kind, response_mask=mask)
        assert kl[0, 1].item() == 0.0 and torch.isfinite(kl).all()
        (g,) = torch.autograd.grad(kl.sum(), lp)
        assert torch.isfinite(g).all() and g[0, 1].item() == 0.0


def test_kl_errors():
    with pytest.raises(ConfigError) as e:
        kl_penalty(LOGP, REF, "k4")
    assert "low_var_kl" in str(e.value) and "k1" in str(e.value)
    with pytest.raises(SpmdrlError):
        kl_penalty(LOGP, REF[:, :1], "k1")


# ------------------------------------------------------------------ KL controllers


def test_adaptive_kl_controller_hand():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    c.update(12.0, n_steps=256)  # error clip(12/6 - 1) = +0.2 -> x (1 + 0.2 * 256 / 10000)
    assert c.value == pytest.approx(0.1 * 1.00512)
    c.update(torch.tensor(3.0), n_steps=256)  # error clip(-0.5) = -0.2
    assert c.value == pytest.approx(0.1 * 1.00512 * 0.99488)
    c.update(6.6, n_steps=1000)  # error 0.1, unclipped
    want = 0.1 * 1.00512 * 0.99488 * 1.01
    assert c.value == pytest.approx(want)
    c.update(float("nan"), 10)
    assert c.value == pytest.approx(want)

    state = c.state_dict()
    c2 = AdaptiveKLController(0.5, 6.0, 10000)
    c2.load_state_dict(state)
    assert c2.value == c.value


def test_fixed_kl_controller():
    c = FixedKLController(0.05)
    c.update(100.0, 10)
    assert c.value == 0.05
    c2 = FixedKLController(1.0)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.05
    with pytest.raises(ConfigError):
        AdaptiveKLController(0.1, 0.0, 100)


# ------------------------------------------------------------------ full-vocab log-probs and entropy


def ref_entropy(logits):
    p = torch.softmax(logits.double(), -1)
    return -(p * torch.log(p)).nan_to_num().sum(-1)


def test_entropy_and_logprobs_vs_float64():
    g = torch.Generator().manual_seed(0)
    logits = 5 * torch.randn(3, 4, 17, generator=g)
    labels = torch.randint(0, 17, (3, 4), generator=g)
    torch.testing.assert_close(entropy_from_logits(logits).double(), ref_entropy(logits), rtol=1e-5, atol=1e-5)
    want = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels).double(), want, rtol=1e-5, atol=1e-5)


def test_entropy_hand_and_stability():
    # uniform over 4 -> ln 4; a one-hot-ish distribution with -inf logits -> 0; huge logits stay finite
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    z = torch.tensor([3.0, -float("inf"), -float("inf")], requires_grad=True)
    h = entropy_from_logits(z)
    assert h.item() == 0.0
    h.backward()
    assert torch.isfinite(z.grad).all()
    big = torch.tensor([1e4, 1e4, -1e4], dtype=torch.bfloat16)
    assert entropy_from_logits(big).item() == pytest.approx(LN2, abs=1e-6)
    assert logprobs_from_logits(big, torch.tensor(0)).item() == pytest.approx(-LN2, abs=1e-6)


def test_logprobs_ignore_index():
    logits = torch.zeros(2, 5)
    out = logprobs_from_logits(logits, torch.tensor([1, -100]))
    torch.testing.assert_close(out, torch.tensor([-math.log(5), 0.0]))


# ------------------------------------------------------------------ chunked log-probs from hidden states


def _hidden_case(N=37, Hd=8, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, Hd, generator=g)
    w = torch.randn(V, Hd, generator=g) / 2
    labels = torch.randint(0, V, (N,), generator=g)
    labels[5] = -100
    return hidden, w, labels


def _ref_from_hidden(hidden, w, labels, temperature):
    logits = hidden.double() @ w.double().T / temperature
    logp_all = torch.log_softmax(logits, -1)
    keep = labels != -100
    logp = logp_all.gather(-1, labels.clamp_min(0)[:, None]).squeeze(-1) * keep
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


@pytest.mark.parametrize("checkpoint", [True, False])
def test_logprobs_from_hidden_vs_float64_with_grads(checkpoint):
    hidden, w, labels = _hidden_case()
    a, b = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    h1, w1 = hidden.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, ent = logprobs_from_hidden(h1, w1, labels, temperature=0.7, chunk_size=8, checkpoint=checkpoint)
    assert logp.dtype == torch.float32 and logp.shape == ent.shape == (37,)
    gh, gw = torch.autograd.grad((a * logp + b * ent).sum(), (h1, w1))

    h2, w2 = hidden.double().requires_grad_(True), w.double().requires_grad_(True)
    logp_ref, ent_ref = _ref_from_hidden(h2, w2, labels, 0.7)
    gh_ref, gw_ref = torch.autograd.grad((a * logp_ref + b * ent_ref).sum(), (h2, w2))

    torch.testing.assert_close(logp.double(), logp_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh.double(), gh_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw.double(), gw_ref, rtol=1e-4, atol=1e-4)
    assert logp[5].item() == 0.0


def test_logprobs_from_hidden_does_not_keep_chunk_logits():
    hidden, w, labels = _hidden_case(N=64, V=50)
    chunk = 16

    def largest_saved(checkpoint):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        h = hidden.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, ent = logprobs_from_hidden(h, w, labels, chunk_size=chunk, checkpoint=checkpoint)
        (logp.sum() + ent.sum()).backward()
        assert torch.isfinite(h.grad).all()
        return max(sizes, default=0)

    assert largest_saved(False) >= chunk * 50  # without checkpointing, [chunk, V] logits are kept
    assert largest_saved(True) < chunk * 50  # with it, only the inputs of each chunk are


def test_logprobs_from_hidden_shapes_and_no_grad():
    hidden, w, labels = _hidden_case(N=12)
    with torch.no_grad():
        logp, ent = logprobs_from_hidden(
            hidden.view(3, 4, 8), w, labels.view(3, 4), chunk_size=5, with_entropy=False
        )
    assert logp.shape == (3, 4) and ent is None
    want, _ = _ref_from_hidden(hidden, w, labels, 1.0)
    torch.testing.assert_close(logp.reshape(-1).double(), want, rtol=1e-5, atol=1e-5)
    logp, ent = logprobs_from_hidden(hidden[:0], w, labels[:0])
    assert logp.shape == ent.shape == (0,)
    with pytest.raises(SpmdrlError, match="lm_head_weight"):
        logprobs_from_hidden(hidden, w[:, :3], labels)
    with pytest.raises(SpmdrlError, match="temperature"):
        logprobs_from_hidden(hidden, w, labels, temperature=0.0)


def test_logprobs_from_hidden_bf16_close_to_float64():
    hidden, w, labels = _hidden_case()
    logp, ent = logprobs_from_hidden(hidden.bfloat16(), w.bfloat16(), labels, chunk_size=8)
    logp_ref, ent_ref = _ref_from_hidden(hidden.bfloat16().double(), w.bfloat16().double(), labels, 1.0)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), logp_ref, rtol=0.05, atol=0.1)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=0.05, atol=0.1)
