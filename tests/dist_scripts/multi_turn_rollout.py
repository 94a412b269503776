"""Multi-turn rollouts on real vLLM under torchrun: rollout TP=2 (one engine over both ranks) or rollout DP=2
(an engine per rank). Each rank writes OUT/rank{r}.json; tests/test_multi_turn_vllm.py checks it.

  uneven:   prompts b, b, a, a greedily: with DP=2 rank 0's samples answer after one turn while rank 1's call a
            tool in every turn up to the turn limit (the DP groups take different numbers of turns)
  seeded:   prompts a, b, c, d, n=2, temperature 1, rollout.per_request_seed: TP=2 and DP=2 must give the same
            trajectories; every request is recorded (what vLLM sampled, and the engine steps it was admitted and
            finished at)
  by_turns: uneven and seeded again with `by_turns`, a turn-synchronous loop written here (one generate call per
            turn for every trajectory still running, the whole batch waiting for its slowest turn): the reference
            the agent loop on the stepped engine must equal
  diverge:  TP=2 only: rank 1's engine drops the tool call of one sample in turn 1 (as a diverging rank would):
            the group's agreement check must raise on both ranks instead of hanging in vLLM
"""
import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

from spmdrl.errors import SpmdrlError
from spmdrl.loop.generate import trajectories_to_batch
from spmdrl.rollout import SamplingSpec, build_engine
from spmdrl.rollout.chat import ChatGlue, tool_message
from spmdrl.rollout.multi_turn import AgentLoop, TurnLimits, tool_text, turn_seed
from spmdrl.rollout.trajectory import Trajectory, Turn
from spmdrl.tools.parse import parse_tool_calls, stop_strings
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: tool_agent
from tool_agent import SCHEMAS, runner, prompt_messages  # noqa: E402


class Recording:
    """The engine, with every request kept: its prompt, seed and budget, what it sampled, and the engine steps it
    was admitted and finished at (and, on `drop_rank`, the first completion of more than two tokens replaced by
    an answer: a rank that diverges from its TP peer)."""

    def __init__(self, engine, drop_rank=None):
        self.engine, self.requests, self.drop_rank = engine, [], drop_rank
        self.steps, self._live, self._dropped = 0, {}, False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def admit(self, ids, prompts, spec, seeds):
        self.engine.admit(ids, prompts, spec, seeds)
        for i, p, s in zip(ids, prompts, seeds):
            self._live[i] = {"prompt": list(p), "seed": s, "max_tokens": spec.max_tokens, "admitted": self.steps}
            self.requests.append(self._live[i])

    def step(self):
        out = self.engine.step()
        self.steps += 1
        for c in out:
            self._live.pop(c.id).update(ids=c.token_ids, logprobs=c.logprobs, finish=c.finish_reason, done=self.steps)
        longer = [k for k, c in enumerate(out) if len(c.token_ids) > 2]  # not an answer already
        if longer and self.drop_rank is not None and dist.get_rank() == self.drop_rank and not self._dropped:
            k, self._dropped = longer[0], True
            c = out[k]
            out[k] = dataclasses.replace(c, token_ids=c.token_ids[:1] + [self.engine.tokenizer.eos_token_id],
                                         logprobs=c.logprobs[:1] + [0.0], versions=c.versions[:2],
                                         finish_reason="stop")
        return out


def by_turns(engine, tok, runner_, limits, prompts, msgs, seeds, spec):
    """The reference: turn by turn, ONE generate call for every trajectory still running (prompt + all so far,
    seeded by turn_seed, the longest budget left; each response cut to its own), then the turn's tools on every
    calling trajectory, then their results as template glue."""
    glue = ChatGlue(tok, SCHEMAS)
    trajs = [Trajectory(prompt=list(p), messages=[dict(m) for m in ms], seed=s, sample=j)
             for p, ms, s in zip(prompts, msgs, seeds) for j in range(spec.n)]
    stops = {tok.eos_token_id, *spec.stop_token_ids}
    base = dataclasses.replace(spec, n=1, stop=[*spec.stop, *stop_strings("hermes")])
    for turn in range(limits.max_turns):
        active = [t for t in trajs if not t.finish]
        if not active:
            break
        left = [limits.max_response_tokens - len(t.ids) for t in active]
        out = engine.generate([t.prompt + t.ids for t in active], dataclasses.replace(base, max_tokens=max(left)),
                              [turn_seed(t.seed, t.sample, turn) for t in active])
        calling = []
        for k, t in enumerate(active):
            ids, lps, reason = out.response_ids[k], out.logprobs[k], out.finish_reason[k]
            if len(ids) > left[k]:
                ids, lps, reason = ids[: left[k]], lps[: left[k]], "length"
            t.ids, t.mask, t.logprobs = t.ids + ids, t.mask + [1] * len(ids), t.logprobs + lps
            end = ids[-1] if ids and reason == "stop" and ids[-1] in stops else None
            text = tok.decode(ids[:-1] if end is not None else ids, skip_special_tokens=False)
            calls = parse_tool_calls(text, "hermes") if reason == "stop" else []
            t.turns.append(Turn(text=text, calls=calls))
            t.messages.append({"role": "assistant", "content": text})
            if reason == "length" or len(t.ids) >= limits.max_response_tokens and calls:
                t.finish = "length"
            elif not calls:
                t.finish = "answer"
            elif turn == limits.max_turns - 1:
                t.finish = "turn_limit"
            else:
                calling.append((t, "" if end is None else tok.decode([end], skip_special_tokens=False)))
        results = runner_.run([t.turns[-1].calls for t, _ in calling]) if calling else []
        for (t, sampled_end), res in zip(calling, results):
            res = [dataclasses.replace(r, text=tool_text(r.text, tok, limits.max_tool_response_tokens)) for r in res]
            t.turns[-1].results = res
            tool_msgs = [tool_message(r.text, r.name) for r in res]
            ids = glue.glue_ids(t.messages[:-1], t.turns[-1].text, tool_msgs, sampled_end)
            if len(t.ids) + len(ids) >= limits.max_response_tokens:
                t.finish = "length"
                continue
            t.ids, t.mask, t.logprobs = t.ids + ids, t.mask + [0] * len(ids), t.logprobs + [0.0] * len(ids)
            t.messages += tool_msgs
            t.turns[-1].appended = True
    return [{"ids": t.ids, "mask": t.mask, "logprobs": t.logprobs, "finish": t.finish, "info": t.info()}
            for t in trajs]


def inputs(tok, letters):
    msgs = [prompt_messages(x) for x in letters]
    ids = [tok.encode(tok.apply_chat_template(m, tools=SCHEMAS, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False) for m in msgs]
    return ids, msgs


def rollout(engine, tok, tp_group, letters, seeds, spec, limits):
    ids, msgs = inputs(tok, letters)
    loop = AgentLoop(engine, ChatGlue(tok, SCHEMAS), runner(), limits, tp_group=tp_group)
    trajs = loop.run(ids, msgs, seeds, spec)
    batch = trajectories_to_batch(trajs, list(range(len(letters))), spec.n, tok.pad_token_id)
    return {
        "trajs": [{"prompt": t.prompt, "ids": t.ids, "mask": t.mask, "logprobs": t.logprobs, "finish": t.finish,
                   "seed": t.seed, "sample": t.sample, "info": t.info()} for t in trajs],
        "batch_responses": [batch["responses"][i, : int(batch["response_len"][i])].tolist() for i in range(len(batch))],
        "batch_mask": [batch["response_mask"][i, : int(batch["response_len"][i])].tolist() for i in range(len(batch))],
        "loop_turns": loop.stats.turns, "requests": getattr(engine, "requests", None),
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

    eng.per_request_seed = False
    res["by_turns"] = {"uneven": by_turns(eng, tok, runner(), limits, *inputs(tok, share(list("bbaa"))),
                                          share([1, 2, 3, 4]), greedy)}
    eng.per_request_seed = True
    res["by_turns"]["seeded"] = by_turns(eng, tok, runner(), limits, *inputs(tok, share(list("abcd"))),
                                         share([11, 12, 13, 14]), sampled)

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
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
