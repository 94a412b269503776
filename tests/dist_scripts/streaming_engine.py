"""The request-level interface of VLLMEngine in one plain process: generate (now a drain of it) against vLLM's own
batch call on the same engine, admit / step / abort / re-admit, and requests carried across a weight update in
keep and recompute mode. Writes OUT/result.json for tests/test_streaming.py.

python streaming_engine.py --model OLD --new-model NEW --out DIR
"""
import argparse
import json
import os

from safetensors.torch import load_file

from spmdrl.errors import ConfigError
from spmdrl.rng import seed_everything
from spmdrl.rollout import SamplingSpec, build_engine
from spmdrl.rollout.base import call_seed, preserved_rng_state, sample_seed


def batch_call(eng, prompts, spec, seeds, per_request):
    """What VLLMEngine.generate did before it stepped the engine itself: one LLM.generate call (one n-sample request
    per prompt and the global RNGs seeded from the call seed, or one seeded request per sample)."""
    from vllm.inputs import TokensPrompt

    if per_request:
        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(spec.n)]
        params = [eng._sampling_params(spec, 1, sample_seed(s, j)) for s in seeds for j in range(spec.n)]
    else:
        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        params = eng._sampling_params(spec, spec.n, None)
    with preserved_rng_state():
        seed_everything(call_seed(seeds))
        outs = eng.llm.generate(reqs, params, use_tqdm=False)
    comps = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
    return {"response_ids": [list(c.token_ids) for c in comps],
            "logprobs": [[float(c.logprobs[k][t].logprob) for k, t in enumerate(c.token_ids)] for c in comps],
            "finish_reason": [c.finish_reason for c in comps]}


def drain_until(eng, ids, limit=10_000):
    done = {}
    for _ in range(limit):
        done.update((c.id, vars(c)) for c in eng.step())
        if all(i in done for i in ids):
            return done
    raise AssertionError(f"not finished: {[i for i in ids if i not in done]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--new-model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    eng = build_engine("vllm", model_path=args.model, max_model_len=128, seed=0, kv_cache_gb=0.25)
    tok = eng.tokenizer
    prompts = [tok.encode(t) for t in ("hello world", "abc", "The quick brown fox jumps", "1+1=")]
    seeds = [11, 12, 13, 14]
    res = {}

    # (a) generate == vLLM's batch call, both seeding modes, sampled and greedy
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=20)
    greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=12)
    for name, sp, per_request in (("shared", spec, False), ("per_request", spec, True), ("greedy", greedy, False)):
        eng.per_request_seed = per_request
        res[f"drain_{name}"] = vars(eng.generate(prompts, sp, seeds))
        res[f"batch_{name}"] = batch_call(eng, prompts, sp, seeds, per_request)
    eng.per_request_seed = False

    # (b) admit, step, abort, re-admit; a seeded request equals generate's per-request sample
    one = SamplingSpec(n=1, temperature=1.0, max_tokens=20)
    eng.admit(["a", "b", "c"], prompts[:3], one, [sample_seed(seeds[0], 0), 5, None])
    res["in_flight_admitted"] = eng.in_flight
    early = [vars(c) for _ in range(3) for c in eng.step()]
    res["early"] = early
    (taken,) = eng.abort(["b"])
    res["aborted"] = vars(taken)
    res["in_flight_after_abort"] = eng.in_flight
    try:
        eng.admit(["a"], prompts[:1], one, [None])
        res["duplicate_error"] = None
    except ConfigError as e:
        res["duplicate_error"] = str(e)
    eng.admit(["b"], [prompts[1] + taken.token_ids], SamplingSpec(n=1, max_tokens=20 - len(taken.token_ids)), [5])
    res["rest"] = drain_until(eng, ["a", "b", "c"])
    res["in_flight_end"] = eng.in_flight

    # (c) carried across a weight update: 4 steps with the old weights, then the new ones, keep or recompute
    new_state = sorted(load_file(os.path.join(args.new_model, "model.safetensors")).items())
    old_state = sorted(load_file(os.path.join(args.model, "model.safetensors")).items())
    long = SamplingSpec(n=1, temperature=1.0, max_tokens=24)
    for mode in ("keep", "recompute"):
        eng.update_weights(iter(old_state))
        eng.weight_version = 0
        eng.reseed(7)
        eng.admit([f"{mode}0", f"{mode}1"], prompts[2:4], long, [21, 22])
        for _ in range(4):
            assert not eng.step()
        eng.update_weights(iter(new_state))
        eng.finish_weight_update()
        eng.weight_version = 1
        if mode == "recompute":
            eng.rebuild_kv()
        res[mode] = drain_until(eng, [f"{mode}0", f"{mode}1"])
    res["prompts"] = prompts
    eng.close()
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    from spmdrl.process.launcher import leave

    leave(main())
