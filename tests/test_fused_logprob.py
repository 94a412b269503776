"""The fused linear + log-prob (+ entropy) head (spmdrl.algos.token_stats.LinearLogprob) against a float64
reference over the whole [N, V] logits with plain autograd: values and gradients w.r.t. the hidden states, the
weight and the bias, with a temperature, ignored labels, chunks that do not divide N, and the entropy
differentiated or detached. And what it keeps for backward: never an [N, V] tensor."""
import pytest
import torch

from devices import DEVICES
from spmdrl.algos.token_stats import LinearLogprob, logprobs_from_hidden

N, H, V = 37, 16, 50


def data(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    b = torch.randn(V, generator=g) * 0.1 if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    y[[3, 10, 11]] = -100  # ignored labels
    return h, w, b, y, torch.randn(N, generator=g), torch.randn(N, generator=g)


def graph_ops(t) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None and type(f).__name__ not in seen:
            seen.add(type(f).__name__)
            todo += [n for n, _ in f.next_functions]
    return seen


def reference(h, w, b, y, temp, g_lp, g_ent, ent_grad, softcap=None):
    h, w = h.double().requires_grad_(), w.double().requires_grad_()
    b = b.double().requires_grad_() if b is not None else None
    z = torch.nn.functional.linear(h, w, b)
    if softcap:  # Gemma-style final-logit soft-capping, written out
        z = softcap * torch.tanh(z / softcap)
    z = z / temp
    logp_all = torch.log_softmax(z, -1)
    keep = y != -100
    lp = torch.where(keep, logp_all.gather(-1, y.clamp(min=0)[:, None]).squeeze(-1), torch.zeros(()).double())
    ent = -(logp_all.exp() * logp_all).sum(-1)
    loss = (lp * g_lp).sum() + ((ent if ent_grad else ent.detach()) * g_ent).sum()
    loss.backward()
    return lp, ent, h.grad, w.grad, (b.grad if b is not None else None)


@pytest.mark.parametrize("ent_grad", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["no-softcap", "softcap2"])
def test_fused_head_matches_float64_autograd(ent_grad, bias, softcap):
    """softcap 2: most logits (|z| up to ~5 here) sit on the curved part of tanh, so a missing factor shows."""
    h, w, b, y, g_lp, g_ent = data(bias=bias)
    temp = 0.7
    ref = reference(h, w, b, y, temp, g_lp, g_ent, ent_grad, softcap)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    bb = b.clone().requires_grad_() if bias else None
    lp, ent = logprobs_from_hidden(hh, ww, y, temperature=temp, chunk_size=8, with_entropy=True, entropy_grad=ent_grad,
                                   lm_head_bias=bb, softcap=softcap)
    assert "LinearLogprobBackward" in graph_ops(lp)  # the fused path ran
    assert ent.requires_grad == ent_grad
    ((lp * g_lp).sum() + ((ent if ent_grad else ent.detach()) * g_ent).sum()).backward()
    assert torch.allclose(lp.double(), ref[0], atol=1e-5, rtol=0)
    assert torch.allclose(ent.double(), ref[1], atol=1e-5, rtol=0)
    assert (lp[[3, 10, 11]] == 0).all()
    for got, want in zip((hh.grad, ww.grad, bb.grad if bias else None), ref[2:]):
        if want is not None:
            assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5), (got.double() - want).abs().max()


def test_logprob_only_gradient_and_no_vocab_sized_tensor_kept():
    h, w, b, y, g_lp, _ = data()
    ref = reference(h, w, b, y, 1.0, g_lp, torch.zeros(N), False)
    hh, ww, bb = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = logprobs_from_hidden(hh, ww, y, chunk_size=10, with_entropy=False, lm_head_bias=bb)
    assert ent is None
    (lp * g_lp).sum().backward()
    assert torch.allclose(hh.grad.double(), ref[2], atol=1e-5) and torch.allclose(ww.grad.double(), ref[3], atol=1e-5)
    assert torch.allclose(bb.grad.double(), ref[4], atol=1e-5)
    assert saved and all(s[-1] != V or len(s) == 1 for s in saved if s != tuple(w.shape)), saved  # no [N, V]


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_matches_float64_and_the_unfused_checkpointed_path(device):
    """In bf16 (the GPU compute dtype), on the device: the fused head agrees with float64 autograd over the
    bf16-rounded inputs, and with the checkpointed autograd path it replaces, to bf16 rounding (the same matmuls
    in the weight's dtype, the softmax math in float32)."""
    h, w, _, y, g_lp, g_ent = data(1, bias=False)
    want = reference(h.bfloat16(), w.bfloat16(), None, y, 1.0, g_lp, g_ent, True)
    out = []
    for fused in (True, False):
        hh, ww = (t.to(device, torch.bfloat16).requires_grad_() for t in (h, w))
        yy, glp, gent = (t.to(device) for t in (y, g_lp, g_ent))
        if fused:
            lp, ent = LinearLogprob.apply(hh, ww, None, yy, 1.0, -100, True, True, 8)
            assert "LinearLogprobBackward" in graph_ops(lp)
        else:
            lp, ent = logprobs_from_hidden(hh, ww, yy, chunk_size=8, top_p=1 - 1e-9)  # truncation: the old path
        ((lp * glp).sum() + (ent * gent).sum()).backward()
        out.append(tuple(t.float().cpu() for t in (lp, ent, hh.grad, ww.grad)))
    for a, b in zip(*out):
        assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (a - b).abs().max()
    for got, ref in zip(out[0], want[:4]):  # float64: values and gradients within bf16 rounding of their scale
        assert (got.double() - ref).abs().max() <= 2e-2 * ref.abs().max(), (got.double() - ref).abs().max()
