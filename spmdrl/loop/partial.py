"""Partial rollouts (rollout.partial = keep | recompute): the rollout engine stepped by the loop, colocated or on
the rollout ranks of an asynchronous split run (loop/split.py).

A step's rollout keeps `need + oversample` prompt groups (rollout.n requests each) generating (the next one is
admitted before the engine step after one finishes), steps the engine until `need` groups are complete (need: this
rank's share of data.train_batch_size), and returns those; the rest stay in the engine and go on after the weight
update, with the new weights. Each token carries the
weight version that sampled it (the engine's `weight_version`: the step whose update produced the weights). A group
whose tokens would lag the actor that trains on them by more than rollout.max_version_lag versions (split placement:
trainer.max_staleness) is aborted and its prompt queued again.

With multi_turn.enable a group is rollout.n trajectories of the agent loop (rollout/multi_turn.py): a trajectory's
next turn is admitted in the engine step after its tools returned, a trajectory carried over an update goes on
turn by turn with the new weights, and a group is complete when its trajectories have ended.

The schedule depends on the config and seed only (engine steps, never wall-clock time), and every rank of a rollout
TP group makes the same admissions (the engine checks them).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from spmdrl.rollout.base import RolloutOutput, SamplingSpec, sample_seed
from spmdrl.rollout.multi_turn import LoopStats


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

    def rollout(self, rows: list[int], step: int, version: int, trained_by: int | None = None
                ) -> tuple[list[Group], dict[str, float]]:
        """This step's complete groups (len(rows) of them, the oldest first) and the step's metrics. rows: this
        rank's newly drawn prompts; version: the weights the engine holds now; trained_by: the actor version that
        trains on these groups (colocated: `version`; split placement: the version before the update of the step
        the batch is for), from which a token's lag counts."""
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
        complete = lambda: [g for g in self.groups.values() if len(g.done) == self.spec.n]  # noqa: E731
        steps = generated = 0  # engine steps, and tokens of this step's version in requests finished in them
        stepping = 0.0  # seconds in the engine's steps
        def admit(count: int) -> None:
            for _ in range(count):
                if not self.queue:
                    self._draw(next(self.sampler))
                self._admit(*self.queue.pop(0))

        admit(cap - len(self.groups))  # groups held complete count: they are the next step's first
        while len(done := complete()) < need:
            admit(cap - (len(self.groups) - len(done)))  # a group finished: the next one starts at once
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
                self.groups[int(uid)].done[int(j)] = c
            steps += 1
        out = sorted(complete(), key=lambda g: g.uid)[:need]
        for g in out:
            self._forget(g.uid)
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


def groups_output(groups: list[Group], n: int) -> tuple[RolloutOutput, list[list[int]]]:
    """The groups' samples as a RolloutOutput (prompt-major) and each sample's per-token versions."""
    comps = [g.done[j] for g in groups for j in range(n)]
    routes = [c.routes for c in comps]
    out = RolloutOutput([c.token_ids for c in comps], [c.logprobs for c in comps], [c.finish_reason for c in comps],
                        routes if any(r is not None for r in routes) else None)
    return out, [c.versions for c in comps]
