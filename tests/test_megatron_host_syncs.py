"""The Megatron engine's per-step host work: no read of device data that grows with the number of micro-batches in
an optimizer step or a forward-only pass, one pipeline schedule per forward_all, and SDPA's grouped-query
attention without repeated K / V.

The engine runs for real (megatron-core's schedule, one plain process: tests/dist_scripts/megatron_host_syncs.py);
the reads are counted at the aten level (see that script). PP = 2 and TP = 2 forward passes in one schedule are
checked against an unsharded HF float64 forward in tests/test_megatron_engine.py."""
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from launching import run

pytest.importorskip("megatron.core")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist_scripts"))


@pytest.fixture(scope="module")
def syncs(tmp_path_factory):
    from spmdrl.tiny import build_tiny

    d = tmp_path_factory.mktemp("megatron_syncs")
    model = build_tiny(str(d / "m"), seed=0)
    proc = run([os.path.join(HERE, "dist_scripts", "megatron_host_syncs.py"), "--model", model, "--out", str(d)],
               nproc=None, timeout=600)
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("SYNCS "))[len("SYNCS "):])
    return model, res, torch.load(d / "forward.pt")


def _device_reads(sites: dict) -> dict:
    """The reads that are not of the caller's host tensors (see the script's HOST_BUILDERS)."""
    return {k: v for k, v in sites.items() if "@host:" not in k}


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_train_step_reads_the_device_a_fixed_number_of_times(syncs, layout):
    """4 micro-batches read the device exactly as often, and at the same places, as 1: the metrics once
    (host_floats: one stacked copy), the grad norm once; nothing per micro-batch inside megatron's schedule or
    the heads (the response positions are host indices, not a boolean mask of device data)."""
    _, res, _ = syncs
    one, four = res[f"train/{layout}/M1"], res[f"train/{layout}/M4"]
    assert one["schedules"] == four["schedules"] == 1
    assert _device_reads(four["sites"]) == _device_reads(one["sites"])
    reads = _device_reads(one["sites"])
    assert reads["cpu@engines/base.py:host_floats"] == 1 and reads["tolist@engines/base.py:host_floats"] == 1
    assert not any(k.startswith("bool_index") or k.startswith("nonzero") for k in reads)
    # the staging on the host ran once per micro-batch (so the counter did see the work that scales with M)
    assert one["sites"]["nonzero.default@host:of"] == 1 and four["sites"]["nonzero.default@host:of"] == 4


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_forward_all_is_one_schedule_and_one_copy(syncs, layout):
    """forward_all over 4 micro-batches: one megatron schedule, one device-to-host copy, no other read of device
    data; the result equals one engine.logprobs call per micro-batch bitwise."""
    _, res, _ = syncs
    for m in (1, 4):
        r = res[f"forward/{layout}/M{m}"]
        assert r["schedules"] == 1, (m, r)
        assert _device_reads(r["sites"]) == {"cpu@loop/update.py:forward_all": 1}, (m, r["sites"])
        assert r["max_diff_per_call"] == 0.0


def test_forward_all_matches_unsharded_hf(syncs):
    """forward_all's log-probs (temperature 0.7, 1 and 4 micro-batches, padded and packed) against an HF float64
    forward of each sequence alone."""
    from megatron_engine import fixed_batch
    from transformers import AutoModelForCausalLM

    model, _, saved = syncs
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64)
    for i, (p, r) in enumerate(zip(*fixed_batch())):
        logits = hf(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1: len(p) - 1 + len(r)] / 0.7
        want = torch.log_softmax(logits, -1).gather(-1, r[:, None]).squeeze(-1)
        for key, got in saved.items():
            torch.testing.assert_close(got[i, :len(r)].double(), want, atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
            assert float(got[i, len(r):].abs().sum()) == 0.0


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_grouped_query_attention_matches_repeated_kv(masked):
    """SdpaAttention hands SDPA the grouped K / V (enable_gqa); forward and gradients equal the repeat_interleave
    form it replaced within 1e-6 (fp32), causal and with a block-diagonal (packed) mask."""
    from types import SimpleNamespace

    from spmdrl.engines.megatron.model import SdpaAttention

    g = torch.Generator().manual_seed(0)
    s, b, heads, groups, hn = 7, 2, 8, 2, 16
    q, k, v = (torch.randn(s, b, n, hn, generator=g, requires_grad=True) for n in (heads, groups, groups))
    mask = None
    if masked:  # two sequences per row (4 + 3 tokens), True = not allowed (megatron's convention)
        seg = torch.tensor([0, 0, 0, 0, 1, 1, 1])
        allowed = (seg[:, None] == seg[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
        mask = (~allowed)[None, None].expand(b, 1, s, s)
    attn = SdpaAttention(SimpleNamespace(), 1, None, None)
    out = attn(q, k, v, mask)
    rep = heads // groups
    qq, kk, vv = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
    ref = (F.scaled_dot_product_attention(qq, kk, vv, is_causal=True) if mask is None
           else F.scaled_dot_product_attention(qq, kk, vv, attn_mask=~mask))
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, -1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, e in zip(grads, want):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=0)
    assert grads[1].abs().sum() > 0
