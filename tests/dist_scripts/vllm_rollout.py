"""One rollout layout under torchrun (or a single plain process): build VLLMEngine, generate, stream new weights
in two buckets, generate again, check the world group; each rank writes what it saw to OUT/rank{r}.json.

python -m torch.distributed.run --nproc-per-node 2 vllm_rollout.py --model M --new-model M2 --tp 2 --out DIR
The pytest side (tests/test_rollout_vllm.py) compares the JSON with a transformers forward.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spmdrl.errors import SpmdrlError
from spmdrl.rollout import SamplingSpec, build_engine

PROMPTS = ["hello world", "abc", "The quick brown fox", "1+1="]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--new-model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    result = {"rank": rank, "world": world, "tp": args.tp}

    torch.manual_seed(1234)
    expected_draw = torch.rand(4)
    torch.manual_seed(1234)
    t0 = time.perf_counter()
    eng = build_engine("vllm", model_path=args.model, tp_size=args.tp, max_model_len=128, seed=0, kv_cache_gb=1)
    result["build_s"] = time.perf_counter() - t0
    result["rng_preserved"] = bool(torch.equal(torch.rand(4), expected_draw))
    result["tp_rank"], result["dp_rank"], result["dp_size"] = eng.tp_rank, eng.dp_rank, eng.dp_size

    tok = eng.tokenizer
    # Ranks of one TP group send the same request; different rollout-DP groups send different prompts.
    shift = eng.dp_rank
    prompts = [tok.encode(PROMPTS[(i + shift) % len(PROMPTS)]) for i in range(3)]
    seeds = [100 * eng.dp_rank + i for i in range(len(prompts))]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=24)
    result["prompts"], result["seeds"] = prompts, seeds

    # Ranks start generate from different global RNG states (as training leaves them); generate reseeds from
    # the request seeds, which makes that irrelevant, and leaves the global RNG where it was.
    torch.manual_seed(1000 + rank)
    before = torch.get_rng_state()
    t0 = time.perf_counter()
    first = eng.generate(prompts, spec, seeds)
    result["first_generate_s"] = time.perf_counter() - t0
    result["generate_kept_rng"] = bool(torch.equal(before, torch.get_rng_state()))
    t0 = time.perf_counter()
    again = eng.generate(prompts, spec, seeds)
    result["warm_generate_s"] = time.perf_counter() - t0
    result["first"], result["again"] = vars(first), vars(again)
    result["greedy"] = vars(eng.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=16), seeds))
    result["compute_logprobs"] = eng.compute_logprobs([prompts[0]], [first.response_ids[0]])
    # processed log-probs: the distribution each token was drawn from (temperature, then nucleus truncation)
    nucleus = SamplingSpec(n=2, temperature=0.7, top_p=0.9, max_tokens=24)
    result["processed"] = vars(eng.generate(prompts, nucleus, seeds))
    result["other_seeds"] = vars(eng.generate(prompts, spec, [s + 7 for s in seeds]))
    eng.per_request_seed = True  # the opt-in mode: one seeded request per sample
    result["per_request"] = vars(eng.generate(prompts, spec, seeds))
    result["per_request_alone"] = vars(eng.generate(prompts[1:2], spec, seeds[1:2]))
    eng.per_request_seed = False

    if distributed:  # the training world still works after vLLM joined it
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        result["all_reduce"] = x.item()
        gathered = [None] * world
        dist.all_gather_object(gathered, first.response_ids)
        result["all_gather_object_ok"] = gathered[rank] == first.response_ids

    # New weights in two buckets that split layers (q/k/v, gate/up of one layer land in different buckets).
    state = sorted(load_file(os.path.join(args.new_model, "model.safetensors")).items())
    t0 = time.perf_counter()
    eng.update_weights(iter(state[0::2]))
    eng.update_weights(iter(state[1::2]))
    eng.finish_weight_update()
    result["update_s"] = time.perf_counter() - t0
    result["updated"] = vars(eng.generate(prompts, spec, seeds))

    if distributed and args.tp > 1:  # ranks of a TP group disagreeing is caught, not silently wrong
        try:
            eng.generate([prompts[rank % len(prompts)]], spec, [0])
            result["mismatch_error"] = None
        except SpmdrlError as e:
            result["mismatch_error"] = str(e)

    eng.close()
    if distributed:
        x = torch.ones(1)
        dist.all_reduce(x)
        result["all_reduce_after_close"] = x.item()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    from spmdrl.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
