"""The turn-synchronous agent loop: multi-turn rollouts with tool calls on any RolloutEngine.

Per turn, a rollout TP group makes ONE `engine.generate` call for all its trajectories still running (each is
prompt + everything so far, re-prefilled; vLLM's prefix cache keeps that cheap, except on CPU with route capture,
where every turn recomputes the history). A turn ends at the model's stop token (EOS) or at the tool-call stop
string (`</tool_call>`). The calls in the turn's text are run once
per TP group, on its first rank, by a ToolRunner, and the results are broadcast to the group's other ranks;
then the chat template's glue (the end of the assistant message the model did not sample, the tool messages,
the next generation prompt; rollout/chat.py) is appended as token ids with mask 0, and the next turn starts.

Token-in, token-out: a trajectory's ids are exactly the sampled ids plus the glue ids; nothing the model
sampled is re-tokenized. Limits: multi_turn.max_turns, max_calls_per_turn (the runner's: further calls get an
error result), max_tool_response_tokens (a longer result is cut; tool_text), and the response budget (data.max_response_length): a turn
is cut where the budget ends and a trajectory whose next glue would not leave room for one more token ends
before it; both are flagged `truncated`.

Group-uniform by construction: every rank of a TP group holds the same trajectories (the same sampled ids, the
same broadcast tool results), so every loop condition is the same on all of them. Before each turn the group
checks it (one all-reduce of the active count and a digest of the active trajectories) and raises a clear error
instead of hanging in vLLM if the ranks ever disagree. Different rollout DP groups are independent: they may take
different numbers of turns and meet again only after the rollout.

Routes: with an engine that records the experts it routed each position to (routing replay), each trajectory
keeps, per position, the routes of the first turn that computed it (Trajectory.add_turn_routes).

Seeds: the request of sample j of a prompt in turn t is seeded by turn_seed(prompt seed, j, t), so with
rollout.per_request_seed a trajectory depends only on its own seeds (TP=1 and TP=2 sample the same ones).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace

from spmdrl.dist.collectives import broadcast_from_leader, group_agrees, is_group_leader
from spmdrl.errors import SpmdrlError
from spmdrl.rollout.base import RolloutEngine, SamplingSpec, sample_seed
from spmdrl.rollout.chat import ChatGlue, tool_message
from spmdrl.rollout.trajectory import Trajectory, Turn
from spmdrl.tools.base import ToolResult, ToolRunner
from spmdrl.tools.parse import parse_tool_calls, stop_strings


def turn_seed(prompt_seed: int, j: int, turn: int) -> int:
    """The seed of sample j's request in turn `turn` (63 bits, the same on every rank)."""
    return sample_seed(sample_seed(prompt_seed, j), turn + 1)


MAX_CHARS_PER_TOKEN = 32
"""A tool result is cut to max_tool_response_tokens times this many characters before it is tokenized (a 10 MB
result would otherwise be tokenized whole to keep its first tokens)."""
_ZWSP = "\u200b"


def tool_text(text: str, tokenizer, max_tokens: int) -> str:
    """A tool result as the policy sees it: at most `max_tokens` tokens, and every added token of the tokenizer
    written in it (<|im_end|>, <|im_start|>, <tool_call>, ...) broken by a zero-width space after its first
    character, so it tokenizes as plain text: a result cannot end its own message and forge a turn."""
    text = text[: max_tokens * MAX_CHARS_PER_TOKEN]
    for special in sorted(tokenizer.get_added_vocab(), key=len, reverse=True):
        if len(special) > 1 and special in text:
            text = text.replace(special, special[0] + _ZWSP + special[1:])
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int = 4
    max_tool_response_tokens: int = 256
    max_response_tokens: int = 512
    """The budget of every token after the prompt (model, tool and glue): data.max_response_length."""


@dataclass
class LoopStats:
    """Where the time of the last `run` went, on this rank: generation, tools (on the TP group's first rank; the
    others wait in the broadcast), and the rest (parsing, rendering the glue, the checks)."""

    turns: int = 0
    generate_s: float = 0.0
    tools_s: float = 0.0
    other_s: float = 0.0


class AgentLoop:
    """engine: this rank's rollout engine; glue: the chat-template glue (with the tool schemas); runner: runs a
    turn's calls (used on the TP group's first rank only); tp_group: the rollout TP group (None: one rank)."""

    def __init__(self, engine: RolloutEngine, glue: ChatGlue, runner: ToolRunner, limits: TurnLimits, *,
                 fmt: str = "hermes", tp_group=None):
        self.engine, self.glue, self.runner, self.limits = engine, glue, runner, limits
        self.fmt, self.tp_group = fmt, tp_group
        self.tokenizer = glue.tokenizer
        self.stats = LoopStats()

    def run(self, prompts: list[list[int]], messages: list[list[dict]], seeds: list[int], spec: SamplingSpec,
            tool_kwargs: list[dict] | None = None) -> list[Trajectory]:
        """spec.n trajectories per prompt, prompt-major (as RolloutEngine.generate orders samples). messages: each
        prompt's chat messages (what its ids were rendered from); tool_kwargs: per-prompt keyword arguments for
        the tools (verl's extra_info.tools_kwargs)."""
        lim = self.limits
        kwargs = tool_kwargs or [{} for _ in prompts]
        trajs = [Trajectory(prompt=list(p), messages=[dict(m) for m in msgs], seed=s, sample=j, tool_kwargs=kw or {})
                 for p, msgs, s, kw in zip(prompts, messages, seeds, kwargs) for j in range(spec.n)]
        stop_ids = set(spec.stop_token_ids) | ({self.tokenizer.eos_token_id} - {None})
        base = replace(spec, n=1, stop=list(dict.fromkeys([*spec.stop, *stop_strings(self.fmt)])))
        self.stats = stats = LoopStats()
        for turn in range(lim.max_turns):
            t0 = time.perf_counter()
            active = [t for t in trajs if not t.done]
            self._check_agreement(turn, trajs, "are still running")
            if not active:
                break
            stats.turns += 1
            left = [lim.max_response_tokens - len(t.ids) for t in active]
            tspec = replace(base, max_tokens=max(left))
            t1 = time.perf_counter()
            out = self.engine.generate([t.prompt + t.ids for t in active], tspec,
                                       [turn_seed(t.seed, t.sample, turn) for t in active])
            t2 = time.perf_counter()
            calling = []
            for k, t in enumerate(active):
                ids, lps, reason = list(out.response_ids[k]), list(out.logprobs[k]), out.finish_reason[k]
                if len(ids) > left[k]:  # the request ran with the longest budget of the turn: cut to this one's
                    ids, lps, reason = ids[: left[k]], lps[: left[k]], "length"
                t.ids += ids
                t.mask += [1] * len(ids)
                t.logprobs += lps if lps else [0.0] * len(ids)
                if out.routed_experts is not None:  # routing replay (rollout/routes.py)
                    t.add_turn_routes(out.routed_experts[k])
                end = ids[-1] if ids and reason == "stop" and ids[-1] in stop_ids else None
                text = self.tokenizer.decode(ids[:-1] if end is not None else ids, skip_special_tokens=False)
                calls = parse_tool_calls(text, self.fmt) if reason == "stop" else []
                t.turns.append(Turn(text=text, calls=calls))
                t.messages.append({"role": "assistant", "content": text})
                if reason == "length" or len(t.ids) >= lim.max_response_tokens and calls:
                    t.finish = "length"
                elif not calls:
                    t.finish = "answer"
                elif turn == lim.max_turns - 1:
                    t.finish = "turn_limit"
                else:
                    calling.append((t, "" if end is None else self.tokenizer.decode([end], skip_special_tokens=False)))
            t3 = time.perf_counter()
            self._check_agreement(turn, [t for t, _ in calling], "called tools")
            results = self._run_tools([t for t, _ in calling])
            t4 = time.perf_counter()
            for (t, sampled_end), res in zip(calling, results):
                self._append_results(t, res, sampled_end)
            stats.generate_s += t2 - t1
            stats.tools_s += t4 - t3
            stats.other_s += (t1 - t0) + (t3 - t2) + (time.perf_counter() - t4)
        return trajs

    def rollout(self, pb, seeds: list[int], spec: SamplingSpec) -> list[Trajectory]:
        """`run` over a PromptBatch: its ids, messages and per-row tool kwargs (extra_info.tools_kwargs)."""
        kwargs = [(e or {}).get("tools_kwargs") or {} for e in pb.extra_info]
        return self.run(pb.input_ids, pb.raw_prompt, seeds, spec, kwargs)

    def _check_agreement(self, turn: int, trajs: list[Trajectory], what: str) -> None:
        """Every rank of the TP group must hold the same running trajectories (before a turn's generate) and the
        same calling ones (before its tools): a rank that skips a step its peers take hangs the group."""
        mine = [(t.seed, t.sample, len(t.ids)) for t in trajs if not t.done or what == "called tools"]
        digest = int.from_bytes(hashlib.blake2b(repr(mine).encode(), digest_size=8).digest(), "little")
        if not group_agrees([turn, len(mine), digest], self.tp_group):
            raise SpmdrlError(
                f"multi-turn rollout, turn {turn + 1}: the ranks of a rollout TP group disagree on which trajectories "
                f"{what} ({len(mine)} here); they must issue the same requests or vLLM hangs: check that every rank "
                "gets the same prompts, seeds and tool results")

    def _run_tools(self, trajs: list[Trajectory]) -> list[list[ToolResult]]:
        """The calls of this turn: run on the TP group's first rank, broadcast to the others."""
        if not trajs:
            return []
        calls = [t.turns[-1].calls for t in trajs]  # the runner caps the calls per turn
        results = None
        if is_group_leader(self.tp_group):
            results = self.runner.run(calls, [t.tool_kwargs for t in trajs])
        results = broadcast_from_leader(results, self.tp_group)  # checked after: every rank raises alike
        if len(results) != len(calls) or any(len(r) != len(c) for r, c in zip(results, calls)):
            raise SpmdrlError("the tool runner returned a different number of results than calls; every call "
                              "needs exactly one ToolResult")
        return results

    def _append_results(self, t: Trajectory, results: list[ToolResult], sampled_end: str) -> None:
        """The turn's results as glue ids (mask 0), or the end of the trajectory when they do not fit."""
        lim = self.limits
        cut = [replace(r, text=tool_text(r.text, self.tokenizer, lim.max_tool_response_tokens)) for r in results]
        turn = t.turns[-1]
        turn.results = cut
        history = t.messages[:-1]  # before this turn's assistant message
        msgs = [tool_message(r.text, r.name) for r in cut]
        glue = self.glue.glue_ids(history, turn.text, msgs, sampled_end)
        if len(t.ids) + len(glue) >= lim.max_response_tokens:  # no room for the next turn
            t.finish = "length"
            return
        t.ids += glue
        t.mask += [0] * len(glue)
        t.logprobs += [0.0] * len(glue)
        t.messages += msgs
        turn.appended = True
