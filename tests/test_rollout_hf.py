"""HFEngine (the transformers fallback) in one process, plus the engine-independent pieces of spmdrl.rollout."""
import logging

import pytest
import torch

from spmdrl.errors import ConfigError, SpmdrlError
from spmdrl.rollout import SamplingSpec, build_engine, sample_seed
from spmdrl.rollout.base import RolloutEngine
from spmdrl.rollout.hf_engine import HFEngine
from spmdrl.tiny import build_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny(str(tmp_path_factory.mktemp("tiny") / "m"), seed=0)


@pytest.fixture()
def engine(model_dir):
    return HFEngine(model_dir, max_model_len=256, max_num_seqs=4)


def prompts_of(engine):
    return [engine.tokenizer.encode(t) for t in ("hello world", "abc", "The quick brown fox jumps")]


@torch.no_grad()
def argmax_decode(model, prompt, steps):
    """Greedy decoding the slow, obvious way: full forward per token, no cache, no padding."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def forward_logprobs(model, prompt, response):
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.quick
def test_greedy_matches_argmax_decoding(engine):
    prompts = prompts_of(engine)  # different lengths: exercises left padding and the KV cache
    out = engine.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=12), [0, 1, 2])
    for p, resp, reason in zip(prompts, out.response_ids, out.finish_reason):
        ref = argmax_decode(engine.model, p, len(resp))
        assert resp == ref
        assert reason == "stop" or len(resp) == 12


def processed_logprobs64(logits, temperature, top_k, top_p):
    """Reference written out here in float64: log of the sampling distribution. Keep the k largest logits (ties
    with the k-th kept); then, in descending order of probability among those, keep a token while the mass of
    the tokens ranked before it is below top_p (the first always); renormalise over the kept tokens."""
    z = logits.double() / temperature
    out = torch.empty_like(z)
    for i in range(z.shape[0]):
        row = z[i]
        keep = torch.ones_like(row, dtype=torch.bool)
        if top_k > 0:
            keep = row >= torch.sort(row, descending=True).values[top_k - 1]
        p = torch.softmax(torch.where(keep, row, -torch.inf), -1)
        order = torch.argsort(p, descending=True)
        before = torch.cumsum(p[order], 0) - p[order]
        nucleus = torch.zeros_like(keep)
        nucleus[order] = before < top_p
        nucleus[order[0]] = True
        out[i] = torch.log_softmax(torch.where(keep & nucleus, row, -torch.inf), -1)
    return out


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, -1), (0.7, 0.95, 50)])
def test_logprobs_are_processed_and_match_forward(engine, temperature, top_p, top_k):
    """The returned log-probs are those of the distribution each token was drawn from (temperature, top-k,
    top-p, renormalised), as vLLM's processed_logprobs; compute_logprobs stays raw."""
    prompts = prompts_of(engine)
    spec = SamplingSpec(n=2, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=16)
    out = engine.generate(prompts, spec, [5, 6, 7])
    truncated = False
    for k, (resp, lps) in enumerate(zip(out.response_ids, out.logprobs)):
        assert len(resp) == len(lps) > 0
        p = prompts[k // 2]
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([p + resp])).logits[0, len(p) - 1: -1]
        ref = processed_logprobs64(logits, temperature, top_k, top_p).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        assert (torch.tensor(lps, dtype=torch.float64) - ref).abs().max().item() < 1e-5
        untruncated = torch.log_softmax(logits.double() / temperature, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        truncated |= bool(((ref - untruncated).abs() > 1e-3).any())
    assert truncated == (top_p < 1 or top_k > 0)  # the truncation really renormalised some steps
    again = engine.compute_logprobs([prompts[k // 2] for k in range(6)], out.response_ids)
    for k, (resp, lps) in enumerate(zip(out.response_ids, again)):
        assert (torch.tensor(lps) - forward_logprobs(engine.model, prompts[k // 2], resp)).abs().max().item() < 1e-5


def test_n_samples_are_prompt_major_and_seeded_per_sample(engine):
    prompts = prompts_of(engine)
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=10)
    engine.per_request_seed = True
    out = engine.generate(prompts, spec, [11, 12, 13])
    assert len(out) == 9
    # prompt 1's samples are slots 3..5 and do not depend on what else is in the batch
    alone = engine.generate([prompts[1]], spec, [12])
    assert out.response_ids[3:6] == alone.response_ids
    assert len({tuple(r) for r in out.response_ids[0:3]}) == 3
    assert engine.generate(prompts, spec, [11, 12, 13]).response_ids == out.response_ids


def test_default_sampling_is_batched_and_seeded_per_call(engine):
    """One generator per call seeded with call_seed(seeds), one multinomial draw for all rows of a batch of
    max_num_seqs: checked against a plain re-implementation (full forward per token, no KV cache, no padding)."""
    from spmdrl.rollout.base import call_seed

    prompts = prompts_of(engine)
    spec = SamplingSpec(n=3, temperature=0.7, max_tokens=6)
    calls = []
    hook = engine.model.register_forward_hook(lambda m, args, kw, out: calls.append(kw["input_ids"].shape[0]),
                                              with_kwargs=True)
    try:
        out = engine.generate(prompts, spec, [11, 12, 13])
    finally:
        hook.remove()
    assert sorted(set(calls)) == [1, 4]  # 9 samples in batches of max_num_seqs=4: 4, 4, 1
    rows = [p for p in prompts for _ in range(3)]
    gen = torch.Generator().manual_seed(call_seed([11, 12, 13]))
    expected = []
    for start in range(0, 9, 4):  # the engine's batches; every row draws each step until all rows stop
        batch = [list(p) for p in rows[start : start + 4]]
        resp, done = [[] for _ in batch], [False] * len(batch)
        for _ in range(spec.max_tokens):
            with torch.no_grad():
                logits = torch.stack([engine.model(input_ids=torch.tensor([p + r])).logits[0, -1]
                                      for p, r in zip(batch, resp)]).float()
            draw = torch.multinomial(torch.softmax(logits / spec.temperature, -1), 1, generator=gen)[:, 0]
            for i, t in enumerate(draw.tolist()):
                if not done[i]:
                    resp[i].append(t)
                    done[i] = t in engine.eos_ids
            if all(done):
                break
        expected += resp
    assert out.response_ids == expected
    assert engine.generate(prompts, spec, [11, 12, 13]).response_ids == out.response_ids
    assert engine.generate(prompts, spec, [21, 12, 13]).response_ids != out.response_ids


def test_stops_on_eos(engine):
    """Swap the EOS row of lm_head with the row of the k-th greedy token: greedy decoding then emits EOS at k."""
    (eos,) = engine.eos_ids
    prompt = prompts_of(engine)[0]
    greedy = argmax_decode(engine.model, prompt, 12)
    k = next(i for i in range(12) if greedy[i] not in greedy[:i] and eos not in greedy[: i + 1])
    w = engine.model.lm_head.weight.detach().clone()
    w[[eos, greedy[k]]] = w[[greedy[k], eos]]
    engine.update_weights([("lm_head.weight", w)])
    out = engine.generate([prompt], SamplingSpec(n=1, temperature=0.0, max_tokens=12), [0])
    assert out.response_ids[0] == greedy[:k] + [eos]
    assert out.finish_reason == ["stop"]


def test_stops_on_stop_token_ids_and_strings(engine):
    prompt = prompts_of(engine)[0]
    greedy = argmax_decode(engine.model, prompt, 12)
    k = next(i for i in range(12) if greedy[i] not in greedy[:i])
    by_id = engine.generate([prompt], SamplingSpec(n=1, temperature=0, max_tokens=12, stop_token_ids=[greedy[k]]), [0])
    assert by_id.response_ids[0] == greedy[: k + 1] and by_id.finish_reason == ["stop"]
    stop_text = engine.tokenizer.decode([greedy[k]])  # one character per token in the tiny tokenizer
    by_str = engine.generate([prompt], SamplingSpec(n=1, temperature=0, max_tokens=12, stop=[stop_text]), [0])
    assert by_str.response_ids[0] == greedy[: k + 1] and by_str.finish_reason == ["stop"]
    long = engine.generate([prompt], SamplingSpec(n=1, temperature=0, max_tokens=5), [0])
    assert long.finish_reason == ["length"] and len(long.response_ids[0]) == 5


def test_update_weights_by_name(engine, tmp_path):
    other_dir = build_tiny(str(tmp_path / "other"), seed=1)
    other = HFEngine(other_dir)
    state = sorted(other.model.state_dict().items())
    before = engine.weight_snapshot()
    engine.update_weights(state[0::2])
    engine.update_weights(state[1::2])
    engine.finish_weight_update()
    # the snapshot (rollout.verify_sync reads it) is a host copy by HF name: the update did not change it
    after = engine.weight_snapshot()
    assert all(torch.equal(after[k], v) for k, v in state) and not torch.equal(before[state[0][0]], state[0][1])
    prompt = prompts_of(engine)[2]
    spec = SamplingSpec(n=1, temperature=0, max_tokens=8)
    assert engine.generate([prompt], spec, [0]).response_ids == other.generate([prompt], spec, [0]).response_ids
    with pytest.raises(SpmdrlError, match="no parameter named 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(SpmdrlError, match="unsharded"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_bad_requests_are_config_errors(engine):
    with pytest.raises(ConfigError, match="one seed per prompt"):
        engine.generate([[5, 6]], SamplingSpec(), [1, 2])
    with pytest.raises(ConfigError, match="top_p"):
        engine.generate([[5, 6]], SamplingSpec(top_p=0), [1])
    with pytest.raises(ConfigError, match="prompt 0 is empty"):
        engine.generate([[]], SamplingSpec(), [1])


def test_build_engine_hf_warns_and_drops_vllm_kwargs(model_dir, caplog, monkeypatch):
    import spmdrl.rollout.hf_engine as hf_engine

    monkeypatch.setattr(hf_engine, "_warned_slow", False)
    with caplog.at_level(logging.WARNING, logger="spmdrl.rollout.hf_engine"):
        eng = build_engine("hf", model_path=model_dir, tp_size=2, kv_cache_gb=1.0, max_model_len=64, seed=3)
    assert isinstance(eng, HFEngine) and isinstance(eng, RolloutEngine)
    assert "slower than vLLM" in caplog.text
    eng.sleep(), eng.wake_up()  # no-ops on CPU
    assert len(eng.generate([[5, 6]], SamplingSpec(max_tokens=3), [0]).response_ids[0]) <= 3
    with pytest.raises(ConfigError, match="rollout.engine"):
        build_engine("sglang", model_path=model_dir)


def test_auto_falls_back_to_hf_without_vllm(model_dir, monkeypatch):
    import spmdrl.rollout as rollout

    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    assert isinstance(build_engine("auto", model_path=model_dir, tp_size=1, max_model_len=64, seed=0), HFEngine)
    with pytest.raises(ConfigError, match="not installed"):
        build_engine("vllm", model_path=model_dir)


@pytest.mark.quick
def test_sample_seed_is_deterministic_and_spread():
    assert sample_seed(7, 0) == sample_seed(7, 0)
    seeds = {sample_seed(s, j) for s in range(50) for j in range(8)}
    assert len(seeds) == 400  # neighbouring prompt seeds never share a sample seed
    assert all(0 <= x < 2**63 for x in seeds)
