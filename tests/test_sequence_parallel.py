"""Sequence parallelism (Ulysses, FSDP2 backend): sp = 2 x dp = 2 and sp = 4 (grouped key/value heads repeated)
on 4 gloo ranks give the sp = 1 results: in float64 against an unsharded model run sequence by sequence, and
through FSDPEngine (float32) against the engine at dp = 4."""
import os

import pytest
import torch

from spmdrl.dist.layout import sp_head_problem as check_heads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from launching import REPO, run
    from spmdrl.tiny import build_tiny

    tmp = tmp_path_factory.mktemp("sp")
    model_dir = build_tiny(str(tmp / "m"), seed=0)  # 4 query heads, 2 key/value heads
    out = tmp / "sp.pt"
    run([os.path.join(REPO, "tests", "dist_scripts", "sequence_parallel.py"), model_dir, str(out)], nproc=4)
    return model_dir, torch.load(out)


def _script():
    import importlib.util

    from launching import REPO

    spec = importlib.util.spec_from_file_location("sp_script", os.path.join(REPO, "tests", "dist_scripts", "sequence_parallel.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _reference64(model_dir):
    """logp, entropy, values [N, R] and the gradient of sum(w * each), one sequence at a time, float64, transformers'
    own SDPA attention, no packing and no padding."""
    from transformers import AutoModelForCausalLM

    s = _script()
    b = s.global_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    value_w = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    R = b["responses"].shape[1]
    weights = torch.randn(3, s.N, R, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    heads = [torch.zeros(s.N, R, dtype=torch.float64) for _ in range(3)]
    total = 0.0
    for i, (p, r) in enumerate(zip(*s.sequences(b, range(s.N)))):
        out = model(input_ids=torch.cat([p, r])[None], output_hidden_states=True)
        h = out.hidden_states[-1][0, len(p) - 1: -1]
        logp_all = torch.log_softmax(out.logits[0, len(p) - 1: -1], -1)
        per = (logp_all.gather(-1, r[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1), h @ value_w)
        for k, x in enumerate(per):
            heads[k][i, : len(r)] = x.detach()
            total = total + (weights[k, i, : len(r)] * x).sum()
    total.backward()
    return heads, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.dist
def test_sequence_parallel_float64_equals_unsharded_model(runs):
    """Log-probs, entropy, values and gradients at sp = 2 (x dp = 2) and sp = 4, packed and padded, with sequences
    crossing the split points (the script asserts it): equal to the unsharded float64 model to 1e-10."""
    model_dir, result = runs
    heads, grads = _reference64(model_dir)
    assert set(result["float64"]) == {(2, True), (2, False), (4, True), (4, False)}
    for key, got in result["float64"].items():
        for name, x, ref in zip(("logp", "entropy", "values"), got["heads"], heads):
            assert x.shape == ref.shape, (key, name)
            assert float((x - ref).abs().max()) < 1e-10, (key, name, float((x - ref).abs().max()))
        err = max(float((got["grads"][n] - grads[n]).abs().max()) for n in grads)
        assert err < 1e-10 * max(1.0, max(float(g.abs().max()) for g in grads.values())), (key, err)


@pytest.mark.dist
def test_sequence_parallel_engine_equals_sp1(runs):
    """FSDPEngine at sp = 2 x dp = 2 and sp = 4 (FSDP2 over dp x sp): the log-probs, entropy and a critic's values
    of a packed batch, and an actor update's gradient with padded micro-batches (sp = 4: two of them) and packed
    token-budget micro-batches, equal the dp = 4 engine's (float32)."""
    _, result = runs
    base = result["engine"][1]
    for sp in (2, 4):
        got = result["engine"][sp]
        for k in ("logp", "entropy", "values"):
            assert float((got[k] - base[k]).abs().max()) < 1e-5, (sp, k)
        for layout in ("padded", "packed_budget"):
            assert set(got[layout]) == set(base[layout]) and got[layout], (sp, layout)
            scale = max(float(g.abs().max()) for g in base[layout].values())
            err = max(float((got[layout][n] - base[layout][n]).abs().max()) for n in base[layout])
            assert err < 1e-5 * scale, (sp, layout, err, scale)


def test_head_split_rules():
    assert check_heads(4, 2, 1) is None and check_heads(4, 2, 2) is None and check_heads(4, 2, 4) is None
    assert "attention heads are not divisible by sp = 8" in check_heads(4, 2, 8)
    assert "key/value heads" in check_heads(12, 3, 2)
