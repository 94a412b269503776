"""Partial rollouts (rollout.partial = keep | recompute): the rollout engine stepped by the loop, colocated or on
the rollout ranks of an asynchronous split run (loop/split.py).

A step's rollout keeps `need + oversample` prompt groups (rollout.n requests each) generating (the next one is
admitted before the engine step after one finishes), steps the engine until `need` groups are complete (need: this
rank's share of data.train_batch_size), and returns those in the order they completed (asynchronous split streams
each engine step's newly complete ones to the training ranks at once: `stream`); the rest stay in the engine and go on after the weight
update, with the new weights. Each token carries the
weight version that sampled it (the engine's `weight_version`: the step whose update produced the weights). A group
whose tokens would lag the actor that trains on them by more than rollout.max_version_lag versions (split placement:
trainer.max_staleness) is aborted and its prompt queued again.

With multi_turn.enable a group is rollout.n trajectories of the agent loop (rollout/multi_turn.py): a trajectory's
next turn is admitted in the engine step after its tools returned, a trajectory carried over an update goes on
turn by turn with the new weights, and a group is complete when its trajectories have ended.

The schedule depends on the config and seed only (engine steps, never wall-clock time), and every rank of a rollout
TP group makes the same admissions (the engine checks them).

Checkpoints (exact resume with requests in flight). A checkpoint suspends every unfinished request (`suspend`): it is
taken out of the engine with what it generated so far (tokens, rollout log-probs, per-token versions, and the routes
the CPU route recorder captured), and the next rollout admits it again as a continuation: prompt + tokens so far,
max_tokens less what it has, its prefix cache dropped first, and with rollout.per_request_seed the seed
`continuation_seed(its sample seed, tokens so far)` (else the step's shared stream, as any request). When it finishes,
its completion is what it had plus what the continuation generated. The run that goes on after saving and a run
resumed from that checkpoint both do exactly this, from the same state (`state_tensors` / `load_state_tensors`: the
groups in flight with their prompts, seeds, admission versions and finished samples, the requests' tokens so far,
the queue of drawn prompts, the draw count, the weight versions and this rank's prompt sampler), so the resumed run
is bitwise the uninterrupted one. Multi-turn: a trajectory in flight is always in a turn (tools run between engine
steps), so the turn's request is what is suspended (AgentLoop.suspend / resume: the continuation's prompt is
everything so far plus the turn's tokens so far, its seed continuation_seed(the turn's seed, tokens so far)), and
the checkpoint also holds every trajectory of the groups in flight (ids, mask, log-probs, versions, routes, turns
with their calls and tool results, messages) and the loop's request count. What a checkpoint step changes: a continuation is prefilled with the weights held
at the checkpoint, so with rollout.partial = keep the requests carried over a checkpoint step have their keys and
values recomputed (recompute's behaviour, at checkpoint steps only); a stop string that straddles the suspension
point is not seen (the continuation checks the text it generates); the sampling noise after the suspension is the
continuation's; and on GPUs (vLLM reports routes when a request finishes, not when it is aborted) a continuation's
routes for the positions before the suspension are those its prefill computed. With checkpoint.save_every_min the
suspension points follow the clock, so only checkpoint.save_freq's saves keep two runs of one config equal.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from spmdrl.errors import CheckpointError
from spmdrl.rollout.base import Completion, RolloutOutput, SamplingSpec, continuation_seed, joined, sample_seed
from spmdrl.rollout.multi_turn import LoopStats
from spmdrl.rollout.trajectory import pack_texts, trajectory_from_state, trajectory_state, unpack_texts

FINISH = ("stop", "length", "abort")  # finish reasons as saved (their index)


@dataclass
class Group:
    """One prompt draw: its rollout.n requests, admitted together."""

    uid: int
    row: int
    prompt: list[int]
    seed: int
    version: int  # the weight version when it was admitted
    done: dict = field(default_factory=dict)  # sample index -> Completion (multi-turn: Trajectory)
    trajs: list = field(default_factory=list)  # multi-turn: its trajectories, in sample order
    so_far: dict = field(default_factory=dict)  # sample index -> what a suspended request had generated (Completion)

    def finish(self, j: int, c: Completion) -> None:
        """Sample j finished as `c`; a continuation's completion is joined to what the request had before."""
        self.done[j] = joined(self.so_far.pop(j, None), c)


def sampled_versions(x) -> list[int]:
    """The weight versions of the tokens a model sampled in a finished request (Completion) or trajectory (the
    model tokens of a multi-turn Trajectory)."""
    mask = getattr(x, "mask", None)
    return x.versions if mask is None else [v for v, m in zip(x.versions, mask) if m]


def version_bound(cfg) -> int:
    """The most versions a trained token may lag the actor that trains on it: rollout.max_version_lag colocated,
    trainer.max_staleness in split placement (loop/split.py, asynchronous split)."""
    return cfg.trainer.max_staleness if cfg.placement.mode == "split" else cfg.rollout.max_version_lag


class PartialRollouts:
    """The groups in flight on this rank's rollout engine between steps, and the per-step rollout over them."""

    def __init__(self, cfg, rollout, dataset, sampler, spec: SamplingSpec, dp_offset, agent=None):
        r = cfg.rollout
        self.rollout_engine, self.dataset, self.sampler, self.spec = rollout, dataset, sampler, spec
        self.agent = agent  # the multi-turn loop (multi_turn.enable), else None
        self.owner: dict[int, int] = {}  # multi-turn: id(trajectory) -> its group's uid
        self.keep = r.partial == "keep"
        self.max_lag, self.oversample = version_bound(cfg), r.oversample
        self.per_request_seed, self.seed = r.per_request_seed, cfg.trainer.seed
        self.batch_size, self.dp_offset = cfg.data.train_batch_size, dp_offset
        self.one = SamplingSpec(**{**vars(spec), "n": 1})
        self.queue: list[tuple[int, int]] = []  # (uid, dataset row) drawn, not admitted
        self.groups: dict[int, Group] = {}  # admitted, by uid
        self.draws = 0
        self.version = 0
        self.suspended = False  # requests taken out at a checkpoint, admitted again by the next rollout

    def _draw(self, rows: list[int]) -> None:
        first = self.draws * self.batch_size + self.dp_offset(len(rows))  # unique over steps and rollout dp ranks
        self.queue += [(first + i, row) for i, row in enumerate(rows)]
        self.draws += 1

    def _admit(self, uid: int, row: int) -> None:
        prompt = self.dataset.prompt_ids(row)
        g = self.groups[uid] = Group(uid, row, prompt, (self.seed * 1_000_003 + uid) % (2**31 - 1), self.version)
        if self.agent is not None:
            pb = self.dataset.batch([row])
            kwargs = [(e or {}).get("tools_kwargs") or {} for e in pb.extra_info]
            g.trajs = self.agent.trajectories([prompt], pb.raw_prompt, [g.seed], self.spec.n, kwargs)
            self.owner.update({id(t): uid for t in g.trajs})
            self.agent.admit(g.trajs, self.one)
            return
        ids = [f"{uid}/{j}" for j in range(self.spec.n)]
        seeds = [sample_seed(g.seed, j) if self.per_request_seed else None for j in range(self.spec.n)]
        self.rollout_engine.admit(ids, [prompt] * self.spec.n, self.one, seeds)

    def rollout(self, rows: list[int], step: int, version: int, trained_by: int | None = None,
                stream: Callable[[list[Group], int], None] | None = None) -> tuple[list[Group], dict[str, float]]:
        """This step's batch: the first len(rows) groups to complete (those held complete from before first, then
        in the order they complete, by uid within one engine step), and the step's metrics. rows: this rank's newly
        drawn prompts; version: the weights the engine holds now; trained_by: the actor version that trains on these
        groups (colocated: `version`; split placement: the version before the update of the step the batch is
        for), from which a token's lag counts; stream: called with the batch's groups as they complete (those of
        one engine step together) and the count of engine steps so far, before the engine steps again."""
        t0, eng, need = time.perf_counter(), self.rollout_engine, len(rows)
        if self.agent is not None:
            self.agent.stats = LoopStats()
        trained_by = version if trained_by is None else trained_by
        if version != self.version:  # new weights since the last rollout
            self.version = eng.weight_version = version
            if not self.keep:
                eng.rebuild_kv()
        stale = sorted(u for u, g in self.groups.items() if trained_by - g.version > self.max_lag)
        if stale:
            if self.agent is not None:
                self.agent.abort([t for u in stale for t in self.groups[u].trajs])
            else:
                eng.abort([f"{u}/{j}" for u in stale for j in range(self.spec.n)])
            self.queue = [(u, self._forget(u).row) for u in stale] + self.queue
        self._draw(rows)
        cap = need + math.ceil(need * self.oversample)
        if not self.per_request_seed:
            eng.reseed((self.seed * 1_000_003 + step) % (2**31 - 1))
        if self.suspended:
            self._continue()
        complete = lambda: sorted((g for g in self.groups.values() if len(g.done) == self.spec.n),  # noqa: E731
                                  key=lambda g: g.uid)
        steps = generated = 0  # engine steps, and tokens of this step's version in requests finished in them
        stepping = 0.0  # seconds in the engine's steps
        out: list[Group] = []  # the batch: the first `need` groups to complete, in that order (uid within a step)

        def admit(count: int) -> None:
            for _ in range(count):
                if not self.queue:
                    self._draw(next(self.sampler))
                self._admit(*self.queue.pop(0))

        def deliver(groups: list[Group]) -> None:  # complete groups join the batch (and go out at once, streamed)
            groups = groups[: need - len(out)]
            for g in groups:
                self._forget(g.uid)
            out.extend(groups)
            if groups and stream is not None:
                stream(groups, steps)

        admit(cap - len(self.groups))  # groups held complete count: they are the next step's first
        deliver(complete())
        while len(out) < need:
            admit(cap - (len(self.groups) - len(complete())))  # a group finished: the next one starts at once
            t1 = time.perf_counter()
            finished = eng.step()
            stepping += time.perf_counter() - t1
            generated += sum(v == version for c in finished for v in c.versions)
            if self.agent is not None:  # the turns that ended: tools run, next turns admitted, trajectories ended
                ended, finished = self.agent.advance(finished)
                for t in ended:
                    self.groups[self.owner[id(t)]].done[t.sample] = t
            for c in finished:
                uid, j = c.id.split("/")
                self.groups[int(uid)].finish(int(j), c)
            steps += 1
            deliver(complete())
        carried = len(self.groups) * self.spec.n  # requests left for the next step: unfinished, or in an unfinished group
        lags = torch.tensor([trained_by - v for g in out for x in g.done.values() for v in sampled_versions(x)],
                            dtype=torch.float64)
        elapsed = time.perf_counter() - t0
        metrics = {"rollout/requests_carried_over": float(carried), "rollout/requests_aborted_stale": float(len(stale) * self.spec.n),
                   "rollout/engine_steps": float(steps), "rollout/generated_tokens_per_s": generated / max(elapsed, 1e-9)}
        if len(lags):
            metrics.update({"rollout/version_lag_min": float(lags.min()), "rollout/version_lag_mean": float(lags.mean()),
                            "rollout/version_lag_max": float(lags.max())})
        if self.agent is not None:  # the loop's time split: engine steps, tools, the rest
            self.agent.stats.generate_s += stepping
        return out, metrics

    def _forget(self, uid: int) -> Group:
        g = self.groups.pop(uid)
        for t in g.trajs:
            del self.owner[id(t)]
        return g

    # ---- checkpoints: the requests in flight suspended, saved, restored and continued (see the module doc) -------
    def suspend(self) -> None:
        """At a checkpoint: take every unfinished request out of the engine with what it generated so far (multi-turn:
        the current turn's request of every trajectory in flight); the next rollout admits each again as a
        continuation."""
        if self.agent is not None:
            trajs = [t for _, g in sorted(self.groups.items()) for t in g.trajs
                     if not t.done and t.sample not in g.so_far]
            got = self.agent.suspend(trajs)
            for t in trajs:
                self.groups[self.owner[id(t)]].so_far[t.sample] = got[id(t)]
            self.suspended = True
            return
        if self.suspended:  # taken out already, no rollout since: none of them is in the engine
            return
        # every unfinished request is in the engine, a continuation of an earlier suspension too (its tokens before
        # that stay in so_far until it finishes or is suspended again: `finish` joins them)
        ids = [f"{u}/{j}" for u, g in sorted(self.groups.items()) for j in range(self.spec.n) if j not in g.done]
        for c in self.rollout_engine.abort(ids):
            uid, j = (int(x) for x in c.id.split("/"))
            g = self.groups[uid]
            if c.finish_reason == "abort":
                g.finish(j, c)  # joined to an earlier suspension's tokens, if any
                g.so_far[j] = g.done.pop(j)
            else:  # finished while a generate call (validation) stepped the engine
                g.finish(j, c)
        self.suspended = True

    def _continue(self) -> None:
        """Admit the suspended requests again (uid, then sample order): prompt + tokens so far, the rest of
        max_tokens, from an empty prefix cache (multi-turn: the turn's continuation, AgentLoop.resume)."""
        self.suspended = False
        eng = self.rollout_engine
        eng.forget_prefixes()  # nothing is in flight: both runs start from an empty cache
        for u, g in sorted(self.groups.items()):
            for j, p in sorted(g.so_far.items()):
                if self.agent is not None:
                    self.agent.resume(g.trajs[j], g.so_far.pop(j), self.one)
                    continue
                seed = continuation_seed(sample_seed(g.seed, j), len(p.token_ids)) if self.per_request_seed else None
                spec = replace(self.one, max_tokens=self.one.max_tokens - len(p.token_ids))
                eng.admit([f"{u}/{j}"], [g.prompt + p.token_ids], spec, [seed])

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything the next rollouts depend on, as flat tensors (safetensors: no pickle), after `suspend`
        (multi-turn: also every trajectory of the groups in flight, ended or not, and the loop's request count)."""
        samples = [(g.uid, j, kind, c) for g in sorted(self.groups.values(), key=lambda g: g.uid)
                   for kind, d in ((0, g.done), (1, g.so_far)) for j, c in sorted(d.items())
                   if kind or self.agent is None]  # multi-turn: the trajectories go apart (_trajectory_tensors)
        sampler = self.sampler.state_dict()
        ints = lambda xs, width: torch.tensor(xs, dtype=torch.long).reshape(-1, width)  # noqa: E731
        groups = sorted(self.groups.values(), key=lambda g: g.uid)
        out = {
            "state": torch.tensor([self.draws, self.version, self.rollout_engine.weight_version, sampler["epoch"],
                                   sampler["step_in_epoch"], sampler["seed"], int(self.suspended)], dtype=torch.long),
            "queue": ints([[u, r] for u, r in self.queue], 2),
            "groups": ints([[g.uid, g.row, g.seed, g.version, len(g.prompt)] for g in groups], 5),
            "prompts": torch.tensor([t for g in groups for t in g.prompt], dtype=torch.long),
            "samples": ints([[u, j, kind, FINISH.index(c.finish_reason), len(c.token_ids),
                              -1 if c.routes is None else len(c.routes)] for u, j, kind, c in samples], 6),
            "tokens": torch.tensor([t for *_, c in samples for t in c.token_ids], dtype=torch.long),
            "logprobs": torch.tensor([x for *_, c in samples for x in c.logprobs], dtype=torch.float64),
            "versions": torch.tensor([v for *_, c in samples for v in c.versions], dtype=torch.long),
        }
        routes = [torch.as_tensor(np.asarray(c.routes)) for *_, c in samples if c.routes is not None]
        if routes:
            out["routes"] = torch.cat(routes)
        if self.agent is not None:
            out.update(self._trajectory_tensors(groups))
        return {f"partial/{k}": v.contiguous() for k, v in out.items()}

    def _trajectory_tensors(self, groups: list[Group]) -> dict[str, torch.Tensor]:
        """Multi-turn: each group's trajectories (uid, then sample order) as JSON (ids, mask, versions, turns with
        their calls and results, messages, finish), their log-probs (float64) and routes, and the loop's counts."""
        trajs = [t for g in groups for t in g.trajs]
        out = {"trajectories": pack_texts([json.dumps(trajectory_state(t)) for t in trajs]),
               "trajectory_logprobs": torch.tensor([x for t in trajs for x in t.logprobs], dtype=torch.float64),
               "agent": torch.tensor(self.agent.state(), dtype=torch.long)}
        routes = [torch.as_tensor(t.routes) for t in trajs if t.routes is not None]
        if routes:
            out["trajectory_routes"] = torch.cat(routes)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Restore what `state_tensors` saved (a resumed run; `where` names the checkpoint file in errors)."""
        t = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("partial/")}
        try:
            draws, version, weight_version, epoch, step_in_epoch, seed, suspended = t["state"].tolist()
            groups, prompts, samples = t["groups"].tolist(), t["prompts"].tolist(), t["samples"].tolist()
            tokens, logprobs, versions = t["tokens"].tolist(), t["logprobs"].tolist(), t["versions"].tolist()
            queue = [tuple(q) for q in t["queue"].tolist()]
            routes = t.get("routes")
        except KeyError as e:
            raise CheckpointError(f"{where}: the partial rollouts' state lacks {e.args[0]!r} (a damaged checkpoint)") from None
        self.sampler.load_state_dict({"epoch": epoch, "step_in_epoch": step_in_epoch, "seed": seed})
        self.draws, self.version, self.queue, self.suspended = draws, version, queue, bool(suspended)
        self.rollout_engine.weight_version = weight_version
        self.groups, self.owner, at = {}, {}, 0
        for uid, row, gseed, gversion, plen in groups:
            self.groups[uid] = Group(uid, row, prompts[at: at + plen], gseed, gversion)
            at += plen
        at = r_at = 0
        for uid, j, kind, reason, length, rlen in samples:
            r = None
            if rlen >= 0:
                r, r_at = routes[r_at: r_at + rlen].numpy(), r_at + rlen
            c = Completion(f"{uid}/{j}", tokens[at: at + length], logprobs[at: at + length] if logprobs else [],
                           versions[at: at + length], FINISH[reason], r)
            at += length
            (self.groups[uid].so_far if kind else self.groups[uid].done)[j] = c
        if self.agent is not None:
            self._load_trajectories(t, where)

    def _load_trajectories(self, t: dict[str, torch.Tensor], where: str) -> None:
        """Multi-turn: the groups' trajectories back (`_trajectory_tensors`); ended ones are their groups' done."""
        try:
            states = [json.loads(x) for x in unpack_texts(t["trajectories"])] if len(t["trajectories"]) else []
            logprobs, counts = t["trajectory_logprobs"].tolist(), t["agent"].tolist()
            routes = t.get("trajectory_routes")
        except KeyError as e:
            raise CheckpointError(f"{where}: the partial rollouts' state lacks {e.args[0]!r}, the multi-turn "
                                  "trajectories in flight (saved by a single-turn run, or damaged)") from None
        self.agent.load_state(counts)
        at = r_at = 0
        by_sample = iter(states)
        for uid, g in sorted(self.groups.items()):
            for j in range(self.spec.n):
                st = next(by_sample)
                r = None
                if st["routes"] is not None:
                    r, r_at = routes[r_at: r_at + st["routes"]].numpy(), r_at + st["routes"]
                traj = trajectory_from_state(st, g.prompt, logprobs[at: at + len(st["ids"])], r)
                at += len(st["ids"])
                g.trajs.append(traj)
                self.owner[id(traj)] = uid
                if traj.done:
                    g.done[j] = traj


def groups_output(groups: list[Group], n: int) -> tuple[RolloutOutput, list[list[int]]]:
    """The groups' samples as a RolloutOutput (prompt-major) and each sample's per-token versions."""
    comps = [g.done[j] for g in groups for j in range(n)]
    routes = [c.routes for c in comps]
    out = RolloutOutput([c.token_ids for c in comps], [c.logprobs for c in comps], [c.finish_reason for c in comps],
                        routes if any(r is not None for r in routes) else None)
    return out, [c.versions for c in comps]
