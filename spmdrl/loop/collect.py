"""The collect stage: a training rank's batch for one step. Rollout (or, in split placement, receiving the
rollout ranks' batch) -> the batch moved to the actor layout -> reward, repeated while dynamic sampling still
lacks informative groups."""
from __future__ import annotations

import torch

from spmdrl.algos.sampling import dynamic_sampling_quota, informative_groups
from spmdrl.batch import Batch
from spmdrl.data.prompts import PromptDataset
from spmdrl.data.sampler import DistributedPromptSampler
from spmdrl.dist.collectives import redistribute, reduce_min, reduce_sum, take_global_rows
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.errors import SpmdrlError
from spmdrl.hooks import StageHooks
from spmdrl.loop.generate import Generator
from spmdrl.loop.scoring import Scorer
from spmdrl.loop.split import BatchStream
from spmdrl.loop.turn_metrics import trajectory_metrics
from spmdrl.metrics import StageTimer


class Collector:
    """generator: this rank's rollouts (colocated; None on a split layout's training ranks); stream: the batches
    the rollout ranks post (split placement; None colocated)."""

    def __init__(self, cfg, meshes: RoleMeshes, dataset: PromptDataset, sampler: DistributedPromptSampler,
                 generator: Generator | None, stream: BatchStream | None, scorer: Scorer, hooks: StageHooks,
                 tool_names: list[str] | None = None):
        """tool_names: the configured tools' names (multi_turn.enable; the keys of the per-tool metrics)."""
        self.cfg, self.meshes, self.dataset, self.sampler = cfg, meshes, dataset, sampler
        self.generator, self.stream, self.scorer, self.hooks = generator, stream, scorer, hooks
        self.actor_mesh = meshes["actor"]
        self.tool_names = list(tool_names or [])

    def collect(self, step: int, timer: StageTimer) -> tuple[Batch, dict[str, float]]:
        """This training rank's batch for `step`, scored, and the stage's metrics.

        With algorithm.filter_groups, groups (same `uid`: one prompt draw) whose algorithm.filter_metric is
        all equal carry no GRPO signal and are dropped; rounds go on until the actor ranks together hold
        train_batch_size * n informative samples, or max_sample_rounds. The step trains on
        dynamic_sampling_quota samples per rank (whole groups, the same count on every rank), moved between
        ranks when some hold fewer. If that is 0 (not one informative group per rank), it trains on the last
        round unfiltered (its all-equal groups have zero advantage) and logs train/filter_fallback = 1.
        """
        cfg = self.cfg
        n = cfg.rollout.n
        dyn = cfg.algorithm.filter_groups
        target = cfg.data.train_batch_size * n
        kept, last, metrics, rounds, generated = None, None, {}, 0, 0
        while True:
            rounds += 1
            batch = self.rollout_batch(step, rounds - 1, timer)
            if self.stream is None and self.generator is not None:  # the multi-turn loop's time split, summed
                for k, v in self.generator.take_metrics().items():
                    metrics[k] = metrics.get(k, 0.0) + v
            self.scorer.attach_meta(batch, self.dataset, self.actor_mesh)
            if "trajectory" in batch:  # multi-turn: turns, tool calls and failures, of the last round
                metrics.update(trajectory_metrics(batch, self.tool_names, self.actor_mesh))
            metrics.update(self.hooks("after_rollout", step, batch))
            with timer("reward"):
                metrics.update(self.scorer.score(batch, self.actor_mesh))
            metrics.update(self.hooks("after_reward", step, batch))
            self.scorer.place_token_scores(batch)
            generated += len(batch)
            if dyn:
                last = batch
                signal = batch["rule_scores"] if cfg.algorithm.filter_metric == "rule_score" else batch["scores"]
                batch = batch.select(informative_groups(signal, batch["uid"]))
            kept = batch if kept is None else Batch.cat([kept, batch])
            if not dyn:
                break
            counts = reduce_sum(torch.tensor([float(len(kept)), float(generated)]), group=self.actor_mesh.group("dp"))
            if counts[0] >= target or rounds >= cfg.algorithm.max_sample_rounds:
                break
        if not dyn:
            keep = int(reduce_min(len(kept), group=self.meshes.train_group))
            if keep == 0:
                raise SpmdrlError(f"step {step}: no samples left to train on (a hook dropped them all); check the hooks")
            return kept.select(slice(0, keep)), metrics
        per_rank = dynamic_sampling_quota(int(counts[0]), target, n, self.actor_mesh.dp_size)
        metrics["train/kept_sample_ratio"] = float(counts[0] / counts[1])
        metrics["train/sample_rounds"] = float(rounds)
        metrics["train/filter_fallback"] = float(per_rank == 0)
        if per_rank == 0:  # no informative group on some rank: train on the last round as drawn
            keep = int(reduce_min(len(last), group=self.meshes.train_group))
            keep -= keep % n
            if keep == 0:
                raise SpmdrlError(f"step {step}: no samples left to train on (a hook dropped them all); check the hooks")
            return last.select(slice(0, keep)), metrics
        if int(reduce_min(len(kept), group=self.meshes.train_group)) >= per_rank:  # every rank has enough: no communication
            return kept.select(slice(0, per_rank)), metrics
        lo = self.actor_mesh.dp_offset(per_rank)
        kept = take_global_rows(kept, lo, lo + per_rank, group=self.actor_mesh.group("dp"))
        self.scorer.attach_meta(kept, self.dataset, self.actor_mesh)
        return kept, metrics

    def rollout_batch(self, step: int, round_: int, timer: StageTimer) -> Batch:
        """This training rank's share of a rollout batch: generated here and moved to the actor layout, or, in
        split placement, received from the rollout ranks (loop/split.py)."""
        if self.stream is not None:
            with timer("wait_batch"):
                return self.stream.receive(step)
        with timer("rollout"):
            batch = self.generator.generate(next(self.sampler), step, round_)
        with timer("reshard_batch"):
            return redistribute(batch, self.meshes["rollout"], self.actor_mesh)
