"""Multi-turn rollouts on real vLLM under torchrun: rollout TP=2 (one engine over both ranks) or rollout DP=2
(an engine per rank). Each rank writes OUT/rank{r}.json; tests/test_multi_turn_vllm.py checks it.

  uneven:   prompts b, b, a, a greedily: with DP=2 rank 0's samples answer after one turn while rank 1's call a
            tool in every turn up to the turn limit (the DP groups take different numbers of turns)
  seeded:   prompts a, b, c, d, n=2, temperature 1, rollout.per_request_seed: TP=2 and DP=2 must give the same
            trajectories; every generate call is recorded (what vLLM sampled, turn by turn)
  diverge:  TP=2 only: rank 1's engine drops the tool call of one sample in turn 1 (as a diverging rank would):
            the group's agreement check must raise on both ranks instead of hanging in vLLM
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from spmdrl.errors import SpmdrlError
from spmdrl.loop.generate import trajectories_to_batch
from spmdrl.rollout import SamplingSpec, build_engine
from spmdrl.rollout.chat import ChatGlue
from spmdrl.rollout.multi_turn import AgentLoop, TurnLimits
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: tool_agent
from tool_agent import SCHEMAS, runner, prompt_messages  # noqa: E402


class Recording:
    """The engine, with every generate call's requests and outputs kept (and, on `drop_rank`, the first
    output of the first call replaced by an answer: a rank that diverges from its TP peer)."""

    def __init__(self, engine, drop_rank=None):
        self.engine, self.calls, self.drop_rank = engine, [], drop_rank

    def generate(self, prompts, spec, seeds):
        out = self.engine.generate(prompts, spec, seeds)
        self.calls.append({"prompts": prompts, "seeds": seeds, "max_tokens": spec.max_tokens, "stop": spec.stop,
                           "ids": out.response_ids, "logprobs": out.logprobs, "finish": out.finish_reason})
        if self.drop_rank is not None and dist.get_rank() == self.drop_rank and len(self.calls) == 1:
            out.response_ids[0] = out.response_ids[0][:1] + [self.engine.tokenizer.eos_token_id]
            out.logprobs[0] = out.logprobs[0][:1] + [0.0]
            out.finish_reason[0] = "stop"
        return out


def rollout(engine, tok, tp_group, letters, seeds, spec, limits):
    msgs = [prompt_messages(x) for x in letters]
    ids = [tok.encode(tok.apply_chat_template(m, tools=SCHEMAS, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False) for m in msgs]
    loop = AgentLoop(engine, ChatGlue(tok, SCHEMAS), runner(), limits, tp_group=tp_group)
    trajs = loop.run(ids, msgs, seeds, spec)
    batch = trajectories_to_batch(trajs, list(range(len(letters))), spec.n, tok.pad_token_id)
    return {
        "trajs": [{"prompt": t.prompt, "ids": t.ids, "mask": t.mask, "logprobs": t.logprobs, "finish": t.finish,
                   "seed": t.seed, "sample": t.sample, "info": t.info()} for t in trajs],
        "batch_responses": [batch["responses"][i, : int(batch["response_len"][i])].tolist() for i in range(len(batch))],
        "batch_mask": [batch["response_mask"][i, : int(batch["response_len"][i])].tolist() for i in range(len(batch))],
        "loop_turns": loop.stats.turns, "generate_calls": getattr(engine, "calls", None),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    eng = build_engine("vllm", model_path=args.model, tp_size=args.tp, max_model_len=512, seed=0, kv_cache_gb=0.2)
    tok = eng.tokenizer
    tp_group = dist.group.WORLD if args.tp == 2 else None
    dp, dp_size = (0, 1) if args.tp == 2 else (rank, world)

    def share(xs):  # this rollout dp rank's contiguous part
        per = len(xs) // dp_size
        return xs[dp * per: (dp + 1) * per]

    res = {"rank": rank, "tp": args.tp}
    eos = [tok.eos_token_id]
    limits = TurnLimits(max_turns=3, max_response_tokens=300)
    greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=300, stop_token_ids=eos)
    res["uneven"] = rollout(eng, tok, tp_group, share(list("bbaa")), share([1, 2, 3, 4]), greedy, limits)

    eng.per_request_seed = True
    sampled = SamplingSpec(n=2, temperature=1.0, max_tokens=300, stop_token_ids=eos)
    res["seeded"] = rollout(Recording(eng), tok, tp_group, share(list("abcd")), share([11, 12, 13, 14]), sampled,
                            limits)

    if args.tp == 2:
        try:
            rollout(Recording(eng, drop_rank=1), tok, tp_group, list("ab"), [5, 6], greedy, limits)
            res["diverge_error"] = None
        except SpmdrlError as e:
            res["diverge_error"] = str(e)

    t = torch.ones(1)
    dist.all_reduce(t)  # the world still works after the rollouts
    res["all_reduce_after"] = t.item()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    eng.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    from spmdrl.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
