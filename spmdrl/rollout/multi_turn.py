"""The agent loop: multi-turn rollouts with tool calls on any RolloutEngine, on its request-level interface.

Every turn of a trajectory is one request (prompt + everything so far, re-prefilled; vLLM's prefix cache keeps that
cheap, except on CPU with route capture, where every turn recomputes the history). The loop steps the engine; when
a turn's request finishes, at the model's stop token (EOS) or at the tool-call stop string (`</tool_call>`), its
calls are run and the trajectory's next turn is admitted before the next engine step: a trajectory never waits for
the other trajectories' turns, only for its own tools. The calls of the turns that ended in one engine step are run
together, once per TP group, on its first rank, by a ToolRunner, and the results are broadcast to the group's other
ranks; then the chat template's glue (the end of the assistant message the model did not sample, the tool
messages, the next generation prompt; rollout/chat.py) is appended as token ids with mask 0, and the next turn is
admitted. The engine does not step while the tools run.

Token-in, token-out: a trajectory's ids are exactly the sampled ids plus the glue ids; nothing the model
sampled is re-tokenized. Limits: multi_turn.max_turns, max_calls_per_turn (the runner's: further calls get an
error result), max_tool_response_tokens (a longer result is cut; tool_text), and the response budget
(data.max_response_length): a turn's request may sample at most what is left of it, and a trajectory whose next
glue would not leave room for one more token ends before it; both are flagged `truncated`.

Group-uniform by construction: every rank of a TP group holds the same trajectories (the same sampled ids, the
same broadcast tool results), and its engine finishes the same requests at the same engine step, so every rank
makes the same admissions at the same step (the engine checks each admission). At every engine step where turns
end, the group also checks the loop's own decisions (one all-reduce of a digest of which trajectories ended,
answered or called tools) and raises a clear error instead of hanging in vLLM if the ranks ever disagree.
Different rollout DP groups are independent: they may take different numbers of turns and meet again only after
the rollout.

The loop can be drained (`run`: every trajectory to its end, what a synchronous rollout does) or driven by a
caller that steps the engine itself and hands the loop its completions (`admit` and `advance`): partial rollouts
(loop/partial.py) keep trajectories in flight across weight updates that way, each token tagged with the weight
version that sampled it (`Trajectory.versions`).

Routes: with an engine that records the experts it routed each position to (routing replay), each trajectory
keeps, per position, the routes of the first turn that computed it (Trajectory.add_turn_routes).

Seeds: with per-request seeding (the engine's `per_request_seed`), the request of sample j of a prompt in turn t is
seeded by sample_seed(turn_seed(prompt seed, j, t), 0), so a trajectory depends only on its own seeds (TP=1 and
TP=2 sample the same ones) and it samples what a turn-by-turn loop calling `generate` once per turn would. Without
it, the requests draw from the engine's stream, which `run` seeds once from the prompts' seeds (call_seed).
"""
from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass, replace

from spmdrl.dist.collectives import broadcast_from_leader, group_agrees, is_group_leader
from spmdrl.errors import SpmdrlError
from spmdrl.rollout.base import (Completion, RolloutEngine, SamplingSpec, call_seed, continuation_seed, joined,
                                 sample_seed)
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
    """engine: this rank's rollout engine; glue: the chat-template glue (with the tool schemas); runner: runs the
    calls (used on the TP group's first rank only); tp_group: the rollout TP group (None: one rank)."""

    def __init__(self, engine: RolloutEngine, glue: ChatGlue, runner: ToolRunner, limits: TurnLimits, *,
                 fmt: str = "hermes", tp_group=None):
        self.engine, self.glue, self.runner, self.limits = engine, glue, runner, limits
        self.fmt, self.tp_group = fmt, tp_group
        self.tokenizer = glue.tokenizer
        self.stats = LoopStats()
        self.requests = 0  # request ids issued: the same sequence on every rank of the TP group
        self.steps = 0  # engine steps this loop handed completions of (the agreement check names them)
        self._live: dict[str, tuple[Trajectory, SamplingSpec]] = {}  # request id -> its trajectory and sampling
        self._held: list[Completion] = []  # finished while `run` stepped the engine, not run's: the next advance's
        self._prefix: dict[str, Completion] = {}  # a continuation's request id -> its turn's tokens before a suspension

    def trajectories(self, prompts: list[list[int]], messages: list[list[dict]], seeds: list[int], n: int,
                     tool_kwargs: list[dict] | None = None) -> list[Trajectory]:
        """n fresh trajectories per prompt, prompt-major. messages: each prompt's chat messages (what its ids were
        rendered from); tool_kwargs: per-prompt keyword arguments for the tools (verl's extra_info.tools_kwargs)."""
        kwargs = tool_kwargs or [{} for _ in prompts]
        return [Trajectory(prompt=list(p), messages=[dict(m) for m in msgs], seed=s, sample=j, tool_kwargs=kw or {})
                for p, msgs, s, kw in zip(prompts, messages, seeds, kwargs) for j in range(n)]

    def run(self, prompts: list[list[int]], messages: list[list[dict]], seeds: list[int], spec: SamplingSpec,
            tool_kwargs: list[dict] | None = None) -> list[Trajectory]:
        """spec.n trajectories per prompt, prompt-major (as RolloutEngine.generate orders samples), each run to its
        end: admit the first turns, then step the engine until every trajectory has ended."""
        trajs = self.trajectories(prompts, messages, seeds, spec.n, tool_kwargs)
        self.stats = LoopStats()
        if not self.seeded:
            self.engine.reseed(call_seed(seeds))
        # requests admitted before (a partial rollout's, in flight across steps) are another caller's here: what
        # they finish meanwhile is held for the next advance
        outer, self._live, held = self._live, {}, []
        try:
            self.admit(trajs, spec)
            while any(not t.done for t in trajs):
                t0 = time.perf_counter()
                done = self.engine.step()
                self.stats.generate_s += time.perf_counter() - t0
                held += self.advance(done)[1]
        finally:
            self._live = outer
            self._held += held
        return trajs

    @property
    def seeded(self) -> bool:
        """Whether each request is seeded by its trajectory's seeds (the engine's per_request_seed)."""
        return bool(getattr(self.engine, "per_request_seed", False))

    def admit(self, trajs: list[Trajectory], spec: SamplingSpec) -> None:
        """Admit the next turn of each of `trajs` (fresh ones: their first) with `spec` (its n is ignored; a
        request samples at most what is left of the response budget)."""
        self._admit([(t, spec) for t in trajs])

    def _admit(self, pending: list[tuple[Trajectory, SamplingSpec]]) -> None:
        lim = self.limits
        reqs = []  # (request id, prompt, seed, the request's spec)
        for t, spec in pending:
            rid = self._new_request(t, spec)
            stop = list(dict.fromkeys([*spec.stop, *stop_strings(self.fmt)]))
            seed = sample_seed(turn_seed(t.seed, t.sample, len(t.turns)), 0) if self.seeded else None
            reqs.append((rid, t.prompt + t.ids, seed, replace(spec, n=1, stop=stop,
                                                                max_tokens=lim.max_response_tokens - len(t.ids))))
        for _, run in itertools.groupby(reqs, key=lambda r: r[3]):  # one admit per run of equal specs, in order
            rids, prompts, seeds, specs = zip(*run)
            self.engine.admit(list(rids), list(prompts), specs[0], list(seeds))

    def _new_request(self, t: Trajectory, spec: SamplingSpec) -> str:
        rid = f"turn:{self.requests}"
        self.requests += 1
        self._live[rid] = (t, spec)
        return rid

    def advance(self, completions: list[Completion]) -> tuple[list[Trajectory], list[Completion]]:
        """Take one engine step's completions: those of this loop's requests end a turn of their trajectory; a
        trajectory that called tools gets their results and its next turn is admitted. Returns the trajectories
        that ended and the completions that were not this loop's."""
        completions, self._held = self._held + completions, []
        mine = [c for c in completions if c.id in self._live]
        others = [c for c in completions if c.id not in self._live]
        if not mine:
            return [], others
        t0 = time.perf_counter()
        self.steps += 1
        ended, calling = [], []
        for c in mine:
            t, spec = self._live.pop(c.id)
            c = joined(self._prefix.pop(c.id, None), c)
            sampled_end = self._end_turn(t, c, spec)
            if t.done:
                ended.append(t)
            else:
                calling.append((t, spec, sampled_end))
        self._check_agreement([*ended, *(t for t, _, _ in calling)], len(calling))
        t1 = time.perf_counter()
        results = self._run_tools([t for t, _, _ in calling])
        t2 = time.perf_counter()
        pending = []
        for (t, spec, sampled_end), res in zip(calling, results):
            self._append_results(t, res, sampled_end)
            if t.done:  # the glue left no room for another turn
                ended.append(t)
            else:
                pending.append((t, spec))
        self._admit(pending)
        self.stats.tools_s += t2 - t1
        self.stats.other_s += (t1 - t0) + (time.perf_counter() - t2)
        return ended, others

    def abort(self, trajs: list[Trajectory]) -> None:
        """Take back the requests of `trajs` still in flight (the trajectories are dropped, not finished)."""
        gone = {id(t) for t in trajs}
        rids = [rid for rid, (t, _) in self._live.items() if id(t) in gone]
        self.engine.abort(rids)
        for rid in rids:
            del self._live[rid]
            self._prefix.pop(rid, None)

    # ---- checkpoints: a turn in flight suspended and continued (loop/partial.py) --------------------------------
    def suspend(self, trajs: list[Trajectory]) -> dict[int, Completion]:
        """Take the requests of `trajs` out of the engine: id(trajectory) -> what its current turn generated so far
        (finish reason "abort"; joined to an earlier suspension's tokens), or the turn's completion when it finished
        while `run` stepped the engine (held for the next `advance`). `resume` admits them again."""
        want = {id(t) for t in trajs}
        rids = [rid for rid, (t, _) in self._live.items() if id(t) in want]
        held = [c for c in self._held if c.id in rids]
        self._held = [c for c in self._held if c.id not in rids]
        done = {c.id for c in held}
        out = {}
        for c in held + self.engine.abort([r for r in rids if r not in done]):  # every TP rank aborts alike
            t, _ = self._live.pop(c.id)
            out[id(t)] = joined(self._prefix.pop(c.id, None), c)
        return out

    def resume(self, t: Trajectory, so_far: Completion, spec: SamplingSpec) -> None:
        """Go on with a suspended turn of `t`: a finished one is held for the next `advance`; an unfinished one is
        admitted as a continuation (its prompt + everything so far + the turn's tokens so far, the rest of the
        budget, with per-request seeds `continuation_seed(the turn's seed, tokens so far)`), and its completion is
        joined to `so_far` when it finishes."""
        rid = self._new_request(t, spec)
        if so_far.finish_reason != "abort":
            self._held.append(replace(so_far, id=rid))
            return
        self._prefix[rid] = so_far
        n = len(so_far.token_ids)
        stop = list(dict.fromkeys([*spec.stop, *stop_strings(self.fmt)]))
        seed = continuation_seed(sample_seed(turn_seed(t.seed, t.sample, len(t.turns)), 0), n) if self.seeded else None
        self.engine.admit([rid], [t.prompt + t.ids + list(so_far.token_ids)],
                          replace(spec, n=1, stop=stop, max_tokens=self.limits.max_response_tokens - len(t.ids) - n),
                          [seed])

    def state(self) -> list[int]:
        """The request and engine-step counts (a checkpoint saves them, so that request ids go on alike)."""
        return [self.requests, self.steps]

    def load_state(self, state: list[int]) -> None:
        self.requests, self.steps = (int(x) for x in state)

    def _end_turn(self, t: Trajectory, c: Completion, spec: SamplingSpec) -> str:
        """A turn's completion into its trajectory: its tokens, log-probs, versions and routes, its text and calls,
        and whether the trajectory ended (t.finish). Returns the sampled end of the turn as text (for the glue)."""
        lim = self.limits
        ids, lps, reason = list(c.token_ids), list(c.logprobs), c.finish_reason
        t.ids += ids
        t.mask += [1] * len(ids)
        t.logprobs += lps if lps else [0.0] * len(ids)
        t.versions += list(c.versions)
        if c.routes is not None:  # routing replay (rollout/routes.py)
            t.add_turn_routes(c.routes)
        stop_ids = set(spec.stop_token_ids) | ({self.tokenizer.eos_token_id} - {None})
        end = ids[-1] if ids and reason == "stop" and ids[-1] in stop_ids else None
        text = self.tokenizer.decode(ids[:-1] if end is not None else ids, skip_special_tokens=False)
        calls = parse_tool_calls(text, self.fmt) if reason == "stop" else []
        t.turns.append(Turn(text=text, calls=calls))
        t.messages.append({"role": "assistant", "content": text})
        self.stats.turns = max(self.stats.turns, len(t.turns))
        if reason == "length" or len(t.ids) >= lim.max_response_tokens and calls:
            t.finish = "length"
        elif not calls:
            t.finish = "answer"
        elif len(t.turns) == lim.max_turns:
            t.finish = "turn_limit"
        return "" if end is None else self.tokenizer.decode([end], skip_special_tokens=False)

    def rollout(self, pb, seeds: list[int], spec: SamplingSpec) -> list[Trajectory]:
        """`run` over a PromptBatch: its ids, messages and per-row tool kwargs (extra_info.tools_kwargs)."""
        kwargs = [(e or {}).get("tools_kwargs") or {} for e in pb.extra_info]
        return self.run(pb.input_ids, pb.raw_prompt, seeds, spec, kwargs)

    def _check_agreement(self, trajs: list[Trajectory], calling: int) -> None:
        """Every rank of the TP group must end the same turns in an engine step and send the same trajectories to
        the tools: a rank that skips a broadcast or an admission its peers make hangs the group."""
        mine = [(t.seed, t.sample, len(t.ids), t.finish) for t in trajs]
        digest = int.from_bytes(hashlib.blake2b(repr(mine).encode(), digest_size=8).digest(), "little")
        if not group_agrees([self.steps, len(mine), calling, digest], self.tp_group):
            turn = min(len(t.turns) for t in trajs)
            raise SpmdrlError(
                f"multi-turn rollout, turn {turn} (engine step {self.steps} of the loop): the ranks of a rollout TP "
                f"group disagree on which trajectories ended a turn and which called tools ({len(mine)} ended a turn, "
                f"{calling} called tools here); they must issue the same requests or vLLM hangs: check that every "
                "rank gets the same prompts, seeds and tool results")

    def _run_tools(self, trajs: list[Trajectory]) -> list[list[ToolResult]]:
        """The calls of the turns that just ended: run on the TP group's first rank, broadcast to the others."""
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
        t.versions += t.versions[-1:] * len(glue)  # glue is no model's: it goes with the turn before it
        t.messages += msgs
        turn.appended = True
