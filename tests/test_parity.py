"""Trainer = sampler: the compute paths the parity check switches between, each against an independent float64
transformers forward, the defaults that replace refusals (dropout off, eager attention where only it computes
the model), the mismatch bounds, and the generic tiny builder the coverage sweep uses.

The end-to-end check (parity check in the Trainer, the planted mismatch it refuses, the sweep over families) is in
tests/test_model_sweep.py."""
import logging

import pytest
import torch

from spmdrl.algos.token_stats import logprobs_from_hidden, logprobs_from_model_logits, truncate_logits
from spmdrl.engines.token_batch import pack_sequences
from spmdrl.errors import ConfigError

# ---- the model head's log-probs --------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8)])
def test_model_logits_head_equals_float64_and_the_fused_kernel(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(9, 16, generator=g), torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 40, (9,), generator=g)
    z = h.double() @ w.double().T
    ref = torch.log_softmax(truncate_logits(z / temperature, top_k, top_p).double(), -1)
    expected = ref.gather(-1, labels[:, None])[:, 0]
    got, ent = logprobs_from_model_logits(h @ w.T, labels, temperature, top_k, top_p, with_entropy=True)
    keep = expected > -1e30  # tokens the truncation keeps
    assert (got.double()[keep] - expected[keep]).abs().max() < 1e-5
    p = ref.exp()
    assert (ent.double() - (-(p * ref.masked_fill(p == 0, 0)).sum(-1))).abs().max() < 1e-5
    fused, _ = logprobs_from_hidden(h, w, labels, temperature=temperature, top_k=top_k, top_p=top_p, with_entropy=False)
    assert (got[keep] - fused[keep]).abs().max() < 1e-5


# ---- the FSDP2 engine's compute paths, a world of one ---------------------------------------------------------

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from launching import world_of_one

    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.tiny import build_any

    root = tmp_path_factory.mktemp("parity")
    with world_of_one():
        meshes = RoleMeshes(plan_layout(PlacementConfig(), 1), 0, "cpu")
        models = {}
        for arch, changes in (("cohere", {"logit_scale": 0.25}), ("gemma2", {"attention_dropout": 0.1})):
            path = build_any(str(root / arch), arch)
            if changes:  # a scale the fused head would ignore; a dropout RL must not run
                import json

                cfg_path = root / arch / "config.json"
                cfg = json.loads(cfg_path.read_text())
                cfg.update(changes)
                cfg_path.write_text(json.dumps(cfg))
            models[arch] = path
        yield models, meshes


def _batch():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g) for n in (5, 9, 4)]
    resps = [torch.randint(3, 250, (n,), generator=g) for n in (6, 3, 7)]
    return prompts, resps


def _float64_reference(path, prompts, resps, w):
    """log-probs of each sequence alone and the gradient of sum(w * log-probs) by transformers' own eager
    forward in float64."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").double()
    ref.config.attention_dropout = 0.0  # the trainer's model runs without dropout; so does this reference
    ref.eval()
    loss, lps = 0.0, []
    for i, (p, r) in enumerate(zip(prompts, resps)):
        logits = ref(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1: -1]
        lp = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
        lps.append(lp.detach())
        loss = loss + (w[i, : len(r)].double() * lp).sum()
    loss.backward()
    return lps, {n: p.grad for n, p in ref.named_parameters()}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _assert_trains_like(eng, prompts, resps, w, ref_lp, ref_grad):
    """The engine's log-probs and the gradient of sum(w * log-probs), packed and padded, equal the float64
    reference's within 1e-5."""
    for packed in (True, False):
        tb = pack_sequences(prompts, resps, 0, packed=packed)
        eng.module.zero_grad()
        lp, _ = eng.logprobs(tb)
        (lp * w * tb.resp_mask).sum().backward()
        for i, r in enumerate(resps):
            assert (lp[i, : len(r)].double() - ref_lp[i]).abs().max() < 1e-5, packed
        grads = {n: _full(p.grad) for n, p in eng.hf.named_parameters()}
        err = max(float((grads[n].double() - ref_grad[n]).abs().max()) for n in ref_grad)
        assert err < 1e-5, (packed, err)


def test_model_head_computes_a_logit_scale_the_fused_head_ignores(world):
    """Cohere multiplies its logits by logit_scale in its CausalLM forward: spmdrl's fused head (the LM head's
    matmul only) computes another distribution; head "model" (the model's own forward to its logits) matches the
    float64 transformers forward, log-probs and gradients, packed and padded; reference_logprobs is transformers'
    own forward and leaves the engine's compute path as it was."""
    from spmdrl.engines.fsdp import FSDPEngine

    models, meshes = world
    prompts, resps = _batch()
    w = torch.randn(len(prompts), max(map(len, resps)), generator=torch.Generator().manual_seed(1))
    ref_lp, ref_grad = _float64_reference(models["cohere"], prompts, resps, w)
    eng = FSDPEngine(models["cohere"], meshes["actor"], torch.device("cpu"), trainable=True)
    assert eng.compute == ("spmdrl", "fused")
    assert ("spmdrl", "model") in eng.compute_options()
    tb = pack_sequences(prompts, resps, 0, packed=True)
    fused = eng.logprobs(tb)[0].detach()
    assert max((fused[i, : len(r)].double() - ref_lp[i]).abs().max() for i, r in enumerate(resps)) > 0.1
    reference = eng.reference_logprobs(tb)
    assert eng.compute == ("spmdrl", "fused")
    for i, r in enumerate(resps):
        assert (reference[i, : len(r)].double() - ref_lp[i]).abs().max() < 1e-5
    eng.set_compute("spmdrl", "model")
    _assert_trains_like(eng, prompts, resps, w, ref_lp, ref_grad)


def test_soft_capped_attention_trains_with_eager_and_dropout_off(world, caplog):
    """Gemma 2 soft-caps its attention logits, which only transformers' eager attention computes (SDPA ignores
    it): with model.attn_implementation "auto" the engine builds with eager attention and says so; its log-probs
    and gradients equal the float64 eager forward (packed batches laid out as padded rows). attention_dropout 0.1
    in config.json is set to 0 with one line. An explicit "spmdrl" or "sdpa" is refused in one line."""
    from spmdrl.engines.fsdp import FSDPEngine

    models, meshes = world
    prompts, resps = _batch()
    w = torch.randn(len(prompts), max(map(len, resps)), generator=torch.Generator().manual_seed(2))
    ref_lp, ref_grad = _float64_reference(models["gemma2"], prompts, resps, w)
    with caplog.at_level(logging.INFO, logger="spmdrl"):
        eng = FSDPEngine(models["gemma2"], meshes["actor"], torch.device("cpu"), trainable=True)
    text = caplog.text
    assert "attn_logit_softcapping" in text and "eager" in text
    assert "dropout set to 0" in text and "attention_dropout = 0.1" in text
    assert eng.hf.config.attention_dropout == 0.0
    assert eng.compute == ("eager", "fused") and {a for a, _ in eng.compute_options()} == {"eager"}
    _assert_trains_like(eng, prompts, resps, w, ref_lp, ref_grad)
    for impl in ("spmdrl", "sdpa"):
        with pytest.raises(ConfigError, match="attn_logit_softcapping.*model.attn_implementation = 'eager'"):
            FSDPEngine(models["gemma2"], meshes["ref"], torch.device("cpu"), trainable=False, attn_implementation=impl)


# ---- bounds, defaults, tiny builder ------------------------------------------------------------------------

@pytest.mark.quick
def test_mismatch_watch_warns_once_and_stops_past_the_error_bound(caplog):
    from spmdrl.config import Config
    from spmdrl.config.derived import logprob_diff_bounds
    from spmdrl.loop.correction import MismatchWatch

    cfg = Config()
    assert logprob_diff_bounds(cfg, on_gpu=False) == (0.1, 0.05)  # float32 actor and rollout on CPU
    assert logprob_diff_bounds(cfg, on_gpu=True) == (2.0, 0.5)  # bfloat16
    cfg.rollout.logprob_diff_warn, cfg.rollout.logprob_diff_error = 0.3, -1
    assert logprob_diff_bounds(cfg, on_gpu=False) == (0.3, float("inf"))
    watch = MismatchWatch(0.1, 0.05)
    with caplog.at_level(logging.WARNING, logger="spmdrl"):
        watch.check(1, {"rollout/logprob_diff_max": 1e-6, "rollout/logprob_diff_mean": 1e-7})
        watch.check(2, {"rollout/logprob_diff_max": 0.5, "rollout/logprob_diff_mean": 0.01})
        watch.check(3, {"rollout/logprob_diff_max": 0.7, "rollout/logprob_diff_mean": 0.01})
    assert caplog.text.count("rollout.logprob_diff_warn") == 1 and "step 2" in caplog.text
    watch.check(4, {"rollout/logprob_diff_max": 1.5, "rollout/logprob_diff_mean": 0.8,
                    "train/weight_version_lag": 1.0})  # a stale batch (split placement): the policy moved
    with pytest.raises(ConfigError, match="step 5: rollout/logprob_diff_mean = 0.8 .*rollout.logprob_diff_error"):
        watch.check(5, {"rollout/logprob_diff_max": 1.5, "rollout/logprob_diff_mean": 0.8})
    with pytest.raises(ConfigError, match="step 6: rollout/logprob_diff_mean = nan"):
        watch.check(6, {"rollout/logprob_diff_max": float("nan"), "rollout/logprob_diff_mean": float("nan")})


@pytest.mark.quick
def test_dropout_off_sets_every_dropout_probability_to_zero():
    from transformers import AutoConfig

    from spmdrl.models.model import dropout_off

    cfg = AutoConfig.for_model("gpt2", resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.0, summary_first_dropout=0.3)
    changed = dropout_off(cfg)
    assert sorted(changed) == ["embd_pdrop = 0.2", "resid_pdrop = 0.1", "summary_first_dropout = 0.3"]
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.summary_first_dropout == 0.0
    assert dropout_off(cfg) == []


@pytest.mark.quick
@pytest.mark.parametrize("arch", ["olmo2", "deepseek_v3", "jamba", "gpt_oss", "granitemoe"])
def test_tiny_config_scales_a_published_default_down(arch):
    """The sweep's tiny builder: transformers' defaults (a published model) scaled to a few hundred thousand to a
    few million parameters, with every kind of layer kept and token ids inside the tiny vocabulary."""
    from transformers import AutoModelForCausalLM

    from spmdrl.tiny import tiny_config

    cfg = tiny_config(arch)
    text = cfg.get_text_config()
    assert text.vocab_size == 320 and text.pad_token_id == 0 and text.hidden_size == 128
    model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) < 10_000_000
    assert model(torch.randint(3, 300, (1, 7))).logits.shape == (1, 7, 320)
