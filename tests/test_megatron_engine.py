"""The Megatron-core backend (spmdrl/engines/megatron) on CPU/gloo with real megatron-core, several processes.

One torchrun run per layout (tests/dist_scripts/megatron_engine.py) on a tiny fp32 Qwen2 (a Qwen3 for the
qwen3 layout: per-head q / k norms, head_dim set apart from hidden / heads); every check compares
against an independent reference computed here: an unsharded HF float64 forward (log-probs, entropy), the float64
whole-batch PPO objective of tests/test_objective_layout.py (gradients, per loss aggregation mode), the original
safetensors (HF -> Megatron -> HF round trip, bitwise), and the running engine (bitwise resume, `spmdrl export`).
"""
import functools
import os
import sys

import pytest
import torch

from launching import run

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist_scripts"))
from megatron_engine import MODES, SPLIT, TRUNC, fixed_batch  # noqa: E402
from test_objective_layout import _reference as _reference_uncached  # noqa: E402
from hf_files import read_safetensors

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.dist
SCRIPT = os.path.join(HERE, "dist_scripts", "megatron_engine.py")
# (name, model, nproc, tp, pp, extra args): dp = nproc / (tp * pp); the first runs torch SDPA attention (the
# default) with selective recompute (core attention), the second megatron's own DotProductAttention and full
# activation recompute, the third a Qwen3 (megatron's qk_layernorm) at tp 2 x pp 2
LAYOUTS = [("tp2_pp2_tied", "tied", 4, 2, 2, ["--recompute", "selective"]),
           ("pp2_dp2_local_recompute", "untied", 4, 1, 2, ["--recompute", "--attention", "local"]),
           ("qwen3_tp2_pp2", "qwen3", 4, 2, 2, [])]


@functools.lru_cache(maxsize=None)
def _reference(model_path: str, mode: str):
    return _reference_uncached(model_path, mode)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from spmdrl.tiny import build_tiny

    root = tmp_path_factory.mktemp("megatron_models")
    return {"untied": build_tiny(str(root / "untied"), seed=0),
            "tied": build_tiny(str(root / "tied"), seed=1, tie_word_embeddings=True),
            "qwen3": _tiny_qwen3(str(root / "qwen3"))}


def _tiny_qwen3(out_dir: str) -> str:
    """A tiny random Qwen3: head_dim 32 with hidden 64 and 4 heads (q_proj is [128, 64]: megatron's kv_channels,
    not hidden / heads), 2 kv groups, and q / k norm weights drawn away from HF's init of ones (so a norm
    that is not loaded, loaded swapped, or not applied changes the outputs)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from spmdrl.tiny import build_tokenizer

    tok = build_tokenizer(out_dir)
    cfg = Qwen3Config(vocab_size=max(320, len(tok)), hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      use_sliding_window=False, tie_word_embeddings=False, bos_token_id=0, pad_token_id=0,
                      eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        model = AutoModelForCausalLM.from_config(cfg).float()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    out = {}
    for name, model, nproc, tp, pp, extra in LAYOUTS:
        d = tmp_path_factory.mktemp(name)
        run([SCRIPT, "--model", models[model], "--out", str(d), "--tp", str(tp), "--pp", str(pp), "--micro", "2", *extra],
            nproc=nproc, timeout=900)
        out[name] = (models[model], d, [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(nproc)])
    return out


def _hf_logprobs(model_path, temperature):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    out = []
    for p, r in zip(*fixed_batch()):
        logits = hf(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1: len(p) - 1 + len(r)] / temperature
        ls = torch.log_softmax(logits, -1)
        out.append((ls.gather(-1, r[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)))
    return out


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_logprobs_match_unsharded_hf(runs, layout):
    model, _, ranks = runs[layout]
    for temp in (1.0, 0.7):
        ref = _hf_logprobs(model, temp)
        for res in ranks:  # every rank gets the last stage's results
            for packed in (False, True):
                lp, ent = res["logprobs"][(packed, temp)]
                for i, (want_lp, want_ent) in enumerate(ref):
                    n = len(want_lp)
                    torch.testing.assert_close(lp[i, :n].double(), want_lp, atol=1e-5, rtol=0)
                    torch.testing.assert_close(ent[i, :n].double(), want_ent, atol=1e-5, rtol=0)
                    assert float(lp[i, n:].abs().sum()) == 0.0


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_forward_micro_batches_one_schedule_match_per_call_and_hf(runs, layout):
    """Several micro-batches of different shapes in one forward-only pipeline schedule (forward_all's path; pp 2:
    the stages pipeline them, one broadcast brings the last stage's results to every rank): bitwise the results
    of one call per micro-batch, and the unsharded float64 HF log-probs / critic values."""
    model, d, ranks = runs[layout]
    ref = _hf_logprobs(model, 0.7)
    values, _, _ = _critic_reference(str(d / "critic_export"))
    for res in ranks:
        for key, want in (("forward_mb", [lp for lp, _ in ref]), ("values_mb", values)):
            for packed in (False, True):
                r = res[key][packed]
                assert r["schedules"] == 1 and r["equal_per_call"], (key, packed)
                for (a, b), got in zip(SPLIT, r["got"]):
                    for i in range(a, b):
                        n = len(want[i])
                        torch.testing.assert_close(got[i - a, :n].double(), want[i], atol=1e-5, rtol=0)
                        assert float(got[i - a, n:].abs().sum()) == 0.0


def test_tp2_ran_the_gpu_configuration(runs):
    """The tp 2 layout's engine is built as on a GPU: sequence parallelism on, and every norm (two per layer, the
    final one) spmdrl's SP-capable RMSNorm with its weight marked for finalize_model_grads' tp all-reduce
    (megatron's own torch norm asserts that sequence parallelism is off). The gradient test below fails when
    that mark is missing."""
    for res in runs["tp2_pp2_tied"][2]:  # selective recompute: core attention checkpointed in every layer
        assert res["config"] == {"sequence_parallel": True, "norms": [("RMSNorm", True)], "recompute": "selective",
                                 "core_attention_checkpointed": [True], "qk_norms": 0}
    for res in runs["qwen3_tp2_pp2"][2]:  # Qwen3's q / k norms, 2 per layer of the rank's stage, are RMSNorm too
        assert res["config"] == {"sequence_parallel": True, "norms": [("RMSNorm", True)], "recompute": None,
                                 "core_attention_checkpointed": [False], "qk_norms": 4}
    for res in runs["pp2_dp2_local_recompute"][2]:  # tp 1: nothing to split the sequence over
        assert res["config"] == {"sequence_parallel": False, "norms": [("RMSNorm", False)], "recompute": "full",
                                 "core_attention_checkpointed": [False], "qk_norms": 0}


def _assemble(ranks, key, mode, shapes):
    full = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
    for res in ranks:
        for name, blocks in res[key][mode].items():
            for (offs, shape), t in blocks:
                full[name][tuple(slice(o, o + s) for o, s in zip(offs, shape))] = t
    return full


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_update_gradient_matches_float64_whole_batch(runs, layout, mode):
    """tp x pp x dp with 2 micro-batches per rank: the gradient equals the unsharded float64 computation."""
    model, _, ranks = runs[layout]
    values, ref = _reference(model, mode)
    got = _assemble(ranks, "grads", mode, {k: tuple(g.shape) for k, g in ref.items()})
    assert got.keys() == ref.keys()
    for k, g in ref.items():
        torch.testing.assert_close(got[k].double(), g, atol=1e-5, rtol=1e-5, msg=lambda m: f"{layout} {mode} {k}: {m}")
    assert max(float(g.abs().max()) for g in ref.values()) > 1e-2
    norm = float(sum(g.pow(2).sum() for g in ref.values()).sqrt())  # tp duplicates / tied copies counted once
    for res in ranks:  # logged objective, the same on every rank (pp stages replay the loss for metrics)
        for key, v in values.items():
            assert res["metrics"][mode][key] == pytest.approx(v, abs=1e-5), (layout, mode, key)
        assert res["metrics"][mode]["actor/grad_norm"] == pytest.approx(norm, rel=1e-5)


@functools.lru_cache(maxsize=None)
def _critic_reference(critic_dir):
    """Float64 HF token-classification model (the critic's export): values at response positions of the fixed
    batch, and the gradient of the token-mean clipped value loss over the global batch."""
    from transformers import AutoModelForTokenClassification

    from objective_layout import global_batch

    hf = AutoModelForTokenClassification.from_pretrained(critic_dir, dtype=torch.float64)
    values = [hf(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1: len(p) - 1 + len(r), 0] for p, r in zip(*fixed_batch())]
    b = global_batch()
    mask = b["response_mask"].double()
    old, ret = b["values"].double(), (b["values"] + b["advantages"]).double()
    v = torch.zeros_like(mask)
    for i in range(len(mask)):
        p, r = int(b["prompt_len"][i]), int(b["response_len"][i])
        ids = torch.cat([b["prompts"][i, :p], b["responses"][i, :r]])[None]
        v = v + torch.nn.functional.pad(hf(input_ids=ids).logits[0, p - 1: p - 1 + r, 0], (0, v.shape[1] - r))[None] \
            * torch.nn.functional.one_hot(torch.tensor(i), len(mask)).double()[:, None]
    v_clip = old + (v - old).clamp(-0.5, 0.5)
    loss = ((0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)) * mask).sum() / mask.sum()
    loss.backward()
    return [x.detach() for x in values], float(loss.detach()), {k: p.grad for k, p in hf.named_parameters()}


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_critic_values_and_update_match_float64(runs, layout):
    model, d, ranks = runs[layout]
    values, loss, grads = _critic_reference(str(d / "critic_export"))
    for res in ranks:
        for packed in (False, True):
            for i, want in enumerate(values):
                torch.testing.assert_close(res["values"][packed][i, :len(want)].double(), want, atol=1e-5, rtol=0)
        assert res["critic_metrics"]["critic/vf_loss"] == pytest.approx(loss, abs=1e-5)
    got = _assemble(ranks, "critic_grads", "token-mean", {k: tuple(g.shape) for k, g in grads.items()})
    assert "score.weight" in got and got.keys() == grads.keys()
    for k, g in grads.items():
        torch.testing.assert_close(got[k].double(), g, atol=1e-5, rtol=1e-5, msg=lambda m: f"{layout} critic {k}: {m}")


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_weight_shards_match_source_blocks(runs, layout):
    assert all(res["blocks_ok"] for res in runs[layout][2])


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_hf_megatron_hf_round_trip_is_exact(runs, layout):
    model, d, _ = runs[layout]
    orig, back = read_safetensors(model), read_safetensors(d / "export")
    assert orig.keys() == back.keys() and len(orig) > 10
    for k in orig:
        assert torch.equal(orig[k], back[k]), k


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_resume_is_bitwise_and_spmdrl_export_reads_the_checkpoint(runs, layout, tmp_path):
    from spmdrl.export import export_hf

    model, d, ranks = runs[layout]
    assert all(res["resume_equal"] for res in ranks)
    for res in ranks:  # saved and loaded from a fully parked engine: gradients never came back, all parked again
        for op in ("ckpt_save", "ckpt_load"):
            assert res[op] == {"unparked": ["optimizer", "params"], "parked_after": ["params", "grads", "optimizer"]}
    assert max(res["moved"] for res in ranks) > 1e-4  # the steps really changed the weights
    ckpt = [os.path.join(d, "ckpt", x) for x in os.listdir(d / "ckpt") if x.startswith("step_")]
    out = export_hf(ckpt[0], str(tmp_path / "exported"), dtype="float32")
    got, want = read_safetensors(out), read_safetensors(d / "export_step1")
    assert got.keys() == want.keys() == read_safetensors(model).keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_nan_injection_skips_one_update(runs, layout):
    """SPMDRL_FAULT_INJECT=nan through the engine protocol (spmdrl/faults.py poison_next_update) on the Megatron
    engine: the poisoned update's grad norm is NaN on every rank, it is skipped (weights bitwise unchanged) and its
    loss metrics stay finite; the next update runs. tests/test_faults.py checks the same on FSDP2."""
    import math

    for res in runs[layout][2]:
        got = res["nan_injection"]
        poisoned, clean = got["poisoned"], got["clean"]
        assert poisoned["actor/skipped_step"] == 1 and math.isnan(poisoned["actor/grad_norm"]), poisoned
        assert math.isfinite(poisoned["actor/pg_loss"]) and got["kept"], poisoned
        assert clean["actor/skipped_step"] == 0 and math.isfinite(clean["actor/grad_norm"]), clean


def _truncated_reference(model_path, top_k, top_p, temperature=0.7):
    """Float64 unsharded HF forward; the sampler's kept set written independently of truncate_logits: top-k keeps
    z_v >= the k-th largest logit; top-p then keeps v when the probability mass of the tokens no more likely than v
    (v included) exceeds 1 - top_p, and always the most likely token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    out = []
    for p, r in zip(*fixed_batch()):
        z = hf(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1: len(p) - 1 + len(r)] / temperature
        keep = torch.ones_like(z, dtype=torch.bool)
        if top_k > 0:
            keep &= z >= z.sort(-1, descending=True).values[:, top_k - 1: top_k]
        if top_p < 1:
            q = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
            mass = (q[:, None, :] * (q[:, None, :] <= q[:, :, None])).sum(-1)  # [n, v]: sum_u q_u [q_u <= q_v]
            keep &= (mass > 1 - top_p) | (q == q.max(-1, keepdim=True).values)
        ls = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
        ent = -(ls.exp() * ls.masked_fill(~keep, 0.0)).sum(-1)
        out.append((ls.gather(-1, r[:, None]).squeeze(-1), ent, keep.sum(-1) / z.shape[-1]))
    return out


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_truncated_logprobs_match_unsharded_float64(runs, layout):
    """top-k / top-p log-probs (the rollout mismatch diagnostic's) with the vocabulary gathered over tp."""
    model, _, ranks = runs[layout]
    kept_labels = dropped_labels = 0
    for k, top_p in TRUNC:
        ref = _truncated_reference(model, k, top_p)
        assert all(float(f.min()) > 0.01 and float(f.max()) < 1 for _, _, f in ref)  # kept fraction: really cut
        for res in ranks:
            for packed in (False, True):
                lp, ent = res["trunc"][(packed, k, top_p)]
                for i, (want_lp, want_ent, _) in enumerate(ref):
                    n = len(want_lp)
                    got = lp[i, :n].double()
                    assert torch.equal(torch.isinf(got), torch.isinf(want_lp)), (layout, k, top_p, i)
                    fin = torch.isfinite(want_lp)
                    torch.testing.assert_close(got[fin], want_lp[fin], atol=1e-5, rtol=0)
                    torch.testing.assert_close(ent[i, :n].double(), want_ent, atol=1e-5, rtol=0)
                    kept_labels += int(fin.sum())
                    dropped_labels += int((~fin).sum())
    assert kept_labels > 0 and dropped_labels > 0


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_offload_round_trip_frees_state_and_is_exact(runs, layout):
    """park / unpark (offload / onload's CUDA path, driven on CPU) on an engine just loaded from a checkpoint:
    params, AdamW moments and the DDP grad buffer free their storage and come back bitwise; its log-probs are
    bitwise the same, and its next step gives the metrics and (resume_equal) parameters of the running engine's
    step from the same state, which made no round trip."""
    ranks = runs[layout][2]
    for res in ranks:
        assert all(n > 0 for n in res["held_before"]) and res["held_parked"] == (0, 0, 0)
        assert res["held_after"] == res["held_before"]
        assert res["offload_state_equal"] and res["offload_logprobs_equal"]
        assert res["step_metrics_equal"] and res["resume_equal"]


def test_host_stash_keeps_every_view_and_pins_nothing_extra():
    """HostStash on plain CPU tensors: views of one buffer count once, values come back bitwise, a kind parked twice
    is skipped, grads-style storages come back as zeros, and the host copies add up to exactly the storage."""
    from spmdrl.engines.base import unique_storages
    from spmdrl.engines.megatron.offload import HostStash, pieces

    buf = torch.randn(70_001)  # 280,004 bytes: a 256 KiB piece and a 17,860-byte tail
    views = [buf[:10].view(2, 5), buf[100:70_001]]
    other, grad = torch.randn(3, 7), torch.randn(5)
    want = [buf.clone(), other.clone()]
    assert len(unique_storages(views + [other])) == 2
    assert [s for _, s in pieces(280_004)] == [262_144, 17_860]
    stash = HostStash(pin=False)
    assert stash.park("params", unique_storages(views + [other])) == 280_004 + 84
    assert stash.park("params", unique_storages(views)) == 0  # already parked
    stash.park("grads", unique_storages([grad]), keep_values=False)
    assert buf.untyped_storage().nbytes() == other.untyped_storage().nbytes() == grad.untyped_storage().nbytes() == 0
    assert sum(h.numel() for h in stash._parked["params"][0][1]) == 280_004
    stash.unpark("params")
    stash.unpark("params")
    stash.unpark("grads")
    assert torch.equal(buf, want[0]) and torch.equal(other, want[1]) and torch.equal(views[1], want[0][100:])
    assert torch.equal(grad, torch.zeros(5))
