"""Black-box agent rollouts ([agent]): n agent sessions per prompt, each an agent program pointed at the rollout
group's endpoint, each session's final branch one trajectory of the batch.

On the leader rank of each rollout TP group: the endpoint (agents/endpoint.py) and `agent.sessions` threads that
each run one session at a time in a worker process (agents/worker.py), killed with everything it started when it
returns or its time (`agent.timeout_s`) runs out. On every rank of the group: `serve` steps the engine; at every
tick the leader broadcasts the admissions and aborts the endpoint received, so every rank admits, aborts and steps
the same requests (the engine checks it); once every session has ended and nothing is in flight the leader says
so in the same broadcast and the group leaves the loop together. The trajectories are then broadcast from the
leader: every rank of the group returns the same batch.

The session's reward: the agent's return value when it returns one, else the last reward it posted to the endpoint
(`POST <base_url>/reward`), else None (the run's reward function scores the transcript).

A session that fails (the agent crashed, ran past its timeout, returned something unusable) keeps its reward at 0
and trains nothing (its loss mask is 0); one line in the log says why.
"""
from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass, field, replace

from spmdrl.agents.capture import ChatRender, Session
from spmdrl.agents.endpoint import Endpoint, Limits
from spmdrl.agents.worker import MODULE
from spmdrl.dist.collectives import broadcast_from_leader, is_group_leader
from spmdrl.errors import SpmdrlError
from spmdrl.rollout.base import SamplingSpec, call_seed
from spmdrl.rollout.trajectory import Trajectory
from spmdrl.process.workers import kill_worker, recv, send, spawn_worker

logger = logging.getLogger("spmdrl.agents")
TICK_S = 0.02  # how long the leader waits for a request when nothing is in flight, before the next broadcast


@dataclass(frozen=True)
class AgentSpec:
    """How to run one session: kind "python" (entry 'file.py:run') or "command" (a shell command)."""

    kind: str
    target: str
    sessions: int = 4
    timeout_s: float = 120.0
    limits: Limits = field(default_factory=Limits)
    fmt: str = "hermes"
    port: int = 0


@dataclass
class AgentStats:
    """The last rollout's (on the leader; zeros elsewhere): what Generator reports (LoopStats' fields, plus the
    agent metrics in `extra`)."""

    turns: int = 0
    generate_s: float = 0.0
    tools_s: float = 0.0
    other_s: float = 0.0
    extra: dict = field(default_factory=dict)


def serve(engine, group, endpoint: Endpoint | None, finished, stats: AgentStats | None = None) -> None:
    """Step `engine` until `finished()` (asked on the leader only) and nothing is in flight. Every rank of `group`
    calls this; `endpoint` is the leader's (None elsewhere). Admissions the engine refuses fail their request."""
    leader = endpoint is not None
    while True:
        msg = None
        if leader:
            if engine.in_flight == 0:
                endpoint.admissions.wake.wait(TICK_S)
            new, aborts = endpoint.admissions.take()
            msg = (new, aborts, not new and engine.in_flight == 0 and finished())
        new, aborts, done = broadcast_from_leader(msg, group)
        if done:
            return
        t0 = time.perf_counter()
        for rid, context, spec in new:
            try:
                engine.admit([rid], [context], spec, [None])
            except SpmdrlError as e:  # every rank refuses alike (the same admission, the same checks)
                if leader:
                    endpoint.admissions.fail(rid, e)
        if aborts:
            for c in engine.abort(aborts):
                if leader:
                    endpoint.admissions.deliver(c)
        if engine.in_flight:  # the leader also hears of running requests' new tokens (streamed replies)
            for c in engine.step(partial=leader):
                if leader:
                    endpoint.admissions.deliver(c)
        if stats is not None:
            stats.generate_s += time.perf_counter() - t0


class Slot:
    """One of a rollout group's `agent.sessions` slots: a worker process that runs the slot's sessions one after
    another (agents/worker.py), replaced after a session that ran past its time or killed it.

    `ready` starts it from the rank's main thread, before a rollout's session threads: a worker dies with the
    thread that started it (PR_SET_PDEATHSIG follows the thread), and the session threads end with the rollout."""

    def __init__(self):
        self.proc = None

    def ready(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:  # died with the thread of a replacement
            self.close()
        if self.proc is None:
            self.proc = spawn_worker(MODULE, [])

    def close(self) -> None:
        if self.proc is not None:
            kill_worker(self.proc)
            self.proc = None


def run_session(spec: AgentSpec, slot: Slot, base_url: str, api_key: str, sample: dict) -> tuple[dict | None, str]:
    """One agent session in `slot`'s worker process: (its outcome, '') or (None, why it failed)."""
    if slot.proc is None:  # replaced after this rollout's earlier session (it lives as long as this thread)
        slot.proc = spawn_worker(MODULE, [])
    proc = slot.proc
    try:
        send(proc.stdin, (spec.kind, spec.target, sample, {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}))
        reply = recv(proc.stdout.fileno(), time.monotonic() + spec.timeout_s)
    except TimeoutError:
        slot.close()  # the worker and everything the session started
        return None, f"ran past agent.timeout_s = {spec.timeout_s:g}s and was stopped"
    except (OSError, EOFError) as e:
        slot.close()
        return None, f"its process failed ({type(e).__name__})"
    if reply is None:
        slot.close()
        return None, f"its process died (exit status {proc.returncode})"
    status, value = reply
    return (value, "") if status == "ok" else (None, value)


class AgentRollout:
    """The [agent] rollout of one rollout TP group: `rollout(batch, seeds, spec)` (loop/generate.py sample)."""

    def __init__(self, engine, tokenizer, spec: AgentSpec, *, max_prompt_tokens: int, max_response_tokens: int,
                 tp_group=None, secret: str | None = None):
        self.engine, self.spec, self.tp_group = engine, spec, tp_group
        self.tokenizer = tokenizer
        self.max_prompt_tokens, self.max_response_tokens = max_prompt_tokens, max_response_tokens
        self.stats = AgentStats()
        self.endpoint = None
        self.base_url = ""
        self._rounds = 0
        self.branches: list[list[Trajectory]] = []
        self.slots = [Slot() for _ in range(spec.sessions)]  # the leader's session workers, kept between rollouts
        """After `rollout`: per session (in the order of its trajectories) its other branches (loop/generate.py
        trains them with agent.train_branches = "all")."""
        if is_group_leader(tp_group):
            self.secret = secret or secrets.token_urlsafe(24)
            self.endpoint = Endpoint(ChatRender(tokenizer), SamplingSpec(), set(), self.secret, fmt=spec.fmt,
                                     limits=spec.limits, max_prompt_tokens=max_prompt_tokens,
                                     max_response_tokens=max_response_tokens)
            self.base_url = self.endpoint.start(spec.port)
            logger.info("agent endpoint on %s (loopback only)", self.base_url)

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        if self.endpoint is not None:
            self.endpoint.stop()

    def rollout(self, pb, seeds: list[int], spec: SamplingSpec) -> list[Trajectory]:
        """spec.n sessions per prompt of `pb` (a PromptBatch), prompt-major; one trajectory each."""
        self.stats = stats = AgentStats()
        self._rounds += 1
        samples = [(i, j) for i in range(len(pb)) for j in range(spec.n)]
        self.engine.reseed(call_seed(seeds))
        ep = self.endpoint
        if ep is None:
            serve(self.engine, self.tp_group, None, None, stats)
            trajs, self.branches, stats.extra = broadcast_from_leader(None, self.tp_group)
            return trajs
        stop_ids = set(spec.stop_token_ids) | ({self.tokenizer.eos_token_id} - {None})
        ep.spec, ep.stop_ids = replace(spec, n=1), stop_ids
        ep.admissions.drop_stale()
        results: list = [None] * len(samples)
        sessions: list[Session] = []
        for i, j in samples:
            sessions.append(Session(ep.render, max_prompt_tokens=self.max_prompt_tokens,
                                    max_response_tokens=self.max_response_tokens, fmt=self.spec.fmt, sample=j))
        pending = list(range(len(samples)))
        lock = threading.Lock()
        left = [len(samples)]

        def worker(slot: Slot) -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    k = pending.pop(0)
                i, j = samples[k]
                sid = f"r{self._rounds}-{k}"
                sample = {"index": int(pb.index[i]), "sample": j, "messages": pb.raw_prompt[i],
                          "data_source": pb.data_source[i], "ground_truth": pb.ground_truth[i],
                          "extra_info": pb.extra_info[i]}
                ep.open_session(sid, sessions[k], self.spec.timeout_s)
                try:
                    value, why = run_session(self.spec, slot, f"{self.base_url}/sessions/{sid}/v1", self.secret,
                                            sample)
                except Exception as e:  # spawning failed: this session fails, the rollout goes on
                    value, why = None, f"could not start ({type(e).__name__}: {e})"
                st = ep.close_session(sid)
                if why:
                    logger.warning("agent session %s (prompt %d, sample %d) failed: %s", sid, int(pb.index[i]), j, why)
                results[k] = (value, why, st.calls, len(st.errors), st.reward)
                with lock:
                    left[0] -= 1

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(self.slots[n],), daemon=True, name=f"spmdrl-agent-{n}")
                   for n in range(min(self.spec.sessions, len(samples)))]
        for slot in self.slots[: len(threads)]:
            slot.ready()
        for t in threads:
            t.start()
        faults0 = ep.faults
        serve(self.engine, self.tp_group, ep, lambda: left[0] == 0, stats)
        for t in threads:
            t.join()
        trajs = [self._trajectory(pb, i, j, s, r) for (i, j), s, r in zip(samples, sessions, results)]
        self.branches = [self._other_branches(s, t) for s, t in zip(sessions, trajs)]
        stats.turns = max((len(t.turns) for t in trajs), default=0)
        stats.other_s = max(0.0, time.perf_counter() - t0 - stats.generate_s)
        stats.extra = {
            "agent/sessions": float(len(trajs)),
            "agent/failed_sessions": float(sum(1 for r in results if r[1])),
            "agent/calls": float(sum(r[2] for r in results)),
            "agent/branches": float(sum(len(s.trajectories()) for s in sessions)),
            "agent/endpoint_errors": float(ep.faults - faults0),
        }
        return broadcast_from_leader((trajs, self.branches, stats.extra), self.tp_group)[0]

    @staticmethod
    def _other_branches(session: Session, final: Trajectory) -> list[Trajectory]:
        """The session's branches other than its final one (`final`, its row of the batch), each with the session's
        outcome (its reward, the transcript its agent returned, else its own messages) and its own tokens; none for
        a failed session (it trains nothing)."""
        if final.finish == "error":
            return []
        returned = final.agent.get("transcript") is not final.messages  # _trajectory's fallback: the final's own
        out = []
        for k, t in enumerate(session.trajectories()[:-1]):
            t.seed, t.sample, t.finish = 0, final.sample, t.finish or "answer"
            t.agent = {**final.agent, "branch": k + 1, "transcript": final.agent["transcript"] if returned else t.messages}
            out.append(t)
        return out

    def _trajectory(self, pb, i: int, j: int, session: Session, result) -> Trajectory:
        """The session's final branch with its reward; a placeholder (one masked EOS) when it sampled nothing."""
        value, why, _, _, posted = result
        trajs = session.trajectories()
        if trajs:
            t = trajs[-1]
        else:
            eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
            t = Trajectory(prompt=list(pb.input_ids[i]), messages=[dict(m) for m in pb.raw_prompt[i]], seed=0, sample=j,
                           ids=[eos], mask=[0], logprobs=[0.0], versions=[self.engine.weight_version])
        t.seed, t.sample = 0, j
        if why:
            t.finish, t.mask = "error", [0] * len(t.ids)
            t.agent = {"reward": 0.0, "error": why, "branches": len(trajs), "transcript": t.messages}
        else:
            t.finish = t.finish or "answer"
            reward = value["reward"] if value["reward"] is not None else posted  # returned, else posted
            t.agent = {"reward": reward if reward is None or math.isfinite(reward) else 0.0, "branches": len(trajs)}
            t.agent["transcript"] = value["transcript"] if value["transcript"] is not None else t.messages
        return t
