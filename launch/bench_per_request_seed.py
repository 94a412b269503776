"""The cost of rollout.per_request_seed on this machine: one vLLM engine (in this process), the same prompts,
the two sampling modes alternated (so a change in the machine's load hits both); for each, the median wall
seconds and the median CPU seconds of this process (all its threads; robust to other jobs on a shared
machine) per generate call, and generated tokens per CPU second.

    python launch/bench_per_request_seed.py [--model DIR] [--prompts 32 128] [--max-tokens 64] [--reps 5]

Without --model it builds the untrained tiny model (its samples run to max_tokens, so every call decodes
prompts x n x max_tokens tokens). Prints one line per (prompts, mode).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def bench(model: str, prompts: int, n: int, max_tokens: int, reps: int) -> dict[str, tuple[float, float]]:
    from spmdrl.rollout import SamplingSpec, build_engine

    eng = build_engine("vllm", model_path=model, tp_size=1, max_model_len=max_tokens + 32, seed=0, kv_cache_gb=0.5,
                       max_num_seqs=256)  # rollout.max_num_seqs' default
    ids = [eng.tokenizer.encode(f"{i}+{i * 7}=") for i in range(prompts)]
    spec = SamplingSpec(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=True)
    eng.generate(ids, spec, list(range(prompts)))  # warm-up
    wall: dict[str, list[float]] = {"batched": [], "per_request_seed": []}
    cpu: dict[str, list[float]] = {"batched": [], "per_request_seed": []}
    toks: dict[str, list[int]] = {"batched": [], "per_request_seed": []}
    for rep in range(reps):
        for key, per_request in (("batched", False), ("per_request_seed", True)):
            eng.per_request_seed = per_request
            t0, c0 = time.perf_counter(), time.process_time()
            out = eng.generate(ids, spec, list(range(1000 * rep, 1000 * rep + prompts)))
            cpu[key].append(time.process_time() - c0)
            wall[key].append(time.perf_counter() - t0)
            toks[key].append(sum(len(r) for r in out.response_ids))
    eng.close()
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k]), sum(toks[k]) / sum(cpu[k])) for k in wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: build the untrained tiny model)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    model = a.model
    if model is None:
        from spmdrl.tiny import build_tiny

        model = build_tiny(os.path.join(tempfile.mkdtemp(prefix="spmdrl_prs_"), "tiny"), seed=0)
    for p in a.prompts:
        res = bench(model, p, a.n, a.max_tokens, a.reps)
        base = res["batched"][1]
        for mode, (wall, cpu, tps) in res.items():
            print(f"prompts={p} n={a.n} max_tokens={a.max_tokens} per_request_seed={mode == 'per_request_seed'} "
                  f"wall_s={wall:.3f} cpu_s={cpu:.3f} tokens_per_cpu_s={tps:.0f} cpu_vs_batched={cpu / base:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
