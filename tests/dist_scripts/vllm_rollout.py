"""One rollout layout under torchrun (or a single plain process): build VLLMEngine, generate, stream new weights
in two buckets, generate again, check the world group; each rank writes what it saw to OUT/rank{r}.json.

python -m torch.distributed.run --nproc-per-node 2 vllm_rollout.py --model M --new-model M2 --tp 2 --out DIR
The pytest side (tests/test_rollout_vllm.py) compares the JSON with a transformers forward.
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spmdrl.errors import SpmdrlError
from spmdrl.rollout import SamplingSpec, build_engine

PROMPTS = ["hello world", "abc", "The quick brown fox", "1+1="]


def record_v2_seeds(worker) -> None:
    """On the worker (collective_rpc): from now on, note the seed vLLM's CUDA runner (Model Runner V2) would give
    each request that joins the batch, computed by V2's own code at the moment V2 runs it: SamplingStates.add_request
    (vllm/v1/worker/gpu/sample/states.py), which draws an unseeded request's seed from numpy's global RNG, called by
    the runner's execute_model for the step's new requests (model_runner.py add_requests) before the forward."""
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.sample.states import SamplingStates

    buffer_utils.is_uva_available = lambda: False  # V2 mirrors its state in pinned memory; plain host memory here
    states = SamplingStates(max_num_reqs=256, vocab_size=worker.model_runner.model_config.get_vocab_size())
    worker.v2_seeds = []
    runner = worker.model_runner
    execute_model = runner.execute_model

    def execute_model_as_v2(scheduler_output, *args, **kwargs):
        for new in scheduler_output.scheduled_new_reqs:
            slot = len(worker.v2_seeds) % states.max_num_reqs
            states.add_request(slot, new.sampling_params)
            worker.v2_seeds.append(int(states.seeds.np[slot]))
        return execute_model(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model_as_v2


def take_v2_seeds(worker) -> list[int]:
    seeds, worker.v2_seeds = worker.v2_seeds, []
    return seeds


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
    eng.llm.collective_rpc(record_v2_seeds)
    v2_seeds = {}
    torch.manual_seed(1000 + rank)
    np.random.seed(1000 + rank)
    before, np_before = torch.get_rng_state(), np.random.get_state()
    t0 = time.perf_counter()
    first = eng.generate(prompts, spec, seeds)
    result["first_generate_s"] = time.perf_counter() - t0
    result["generate_kept_rng"] = bool(torch.equal(before, torch.get_rng_state()))
    result["generate_kept_numpy_rng"] = all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                                            for a, b in zip(np_before, np.random.get_state()))
    v2_seeds["first"] = eng.llm.collective_rpc(take_v2_seeds)[0]
    t0 = time.perf_counter()
    again = eng.generate(prompts, spec, seeds)
    result["warm_generate_s"] = time.perf_counter() - t0
    v2_seeds["again"] = eng.llm.collective_rpc(take_v2_seeds)[0]
    result["first"], result["again"] = vars(first), vars(again)
    result["greedy"] = vars(eng.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=16), seeds))
    result["compute_logprobs"] = eng.compute_logprobs([prompts[0]], [first.response_ids[0]])
    # processed log-probs: the distribution each token was drawn from (temperature, then nucleus truncation)
    nucleus = SamplingSpec(n=2, temperature=0.7, top_p=0.9, max_tokens=24)
    result["processed"] = vars(eng.generate(prompts, nucleus, seeds))
    eng.llm.collective_rpc(take_v2_seeds)
    result["other_seeds"] = vars(eng.generate(prompts, spec, [s + 7 for s in seeds]))
    v2_seeds["other_seeds"] = eng.llm.collective_rpc(take_v2_seeds)[0]
    result["v2_seeds"] = v2_seeds
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
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
