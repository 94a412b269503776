"""Dynamic sampling's arithmetic: how many rollout rounds a step takes and which samples it trains on.

Trainer.step runs the rounds (rollout -> batch move -> reward); `SampleRounds` only says whether another round
is needed and, at the end, which samples of the rounds every training rank keeps.
"""
from __future__ import annotations

import torch

from spmdrl.algos.sampling import dynamic_sampling_quota, informative_groups
from spmdrl.batch import Batch
from spmdrl.data.prompts import PromptDataset
from spmdrl.dist.collectives import reduce_min, reduce_sum, take_global_rows
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.errors import SpmdrlError
from spmdrl.loop.scoring import Scorer


class SampleRounds:
    """One step's rollout rounds on a training rank.

    Without algorithm.filter_groups: one round, trained on whole (cut to the fewest samples any training rank
    holds, so that every rank runs the same forwards). With it, groups (same `uid`: one prompt draw) whose
    algorithm.filter_metric is all equal carry no GRPO signal and are dropped; rounds go on until the actor
    ranks together hold train_batch_size * n informative samples, or max_sample_rounds. The step trains on
    dynamic_sampling_quota samples per rank (whole groups, the same count on every rank), moved between ranks
    when some hold fewer. If that is 0 (not one informative group per rank), it trains on the last round
    unfiltered (its all-equal groups have zero advantage) and logs train/filter_fallback = 1."""

    def __init__(self, cfg, meshes: RoleMeshes, scorer: Scorer, dataset: PromptDataset):
        self.cfg, self.meshes, self.scorer, self.dataset = cfg, meshes, scorer, dataset
        self.actor_mesh = meshes["actor"]
        self.dynamic = cfg.algorithm.filter_groups
        self.target = cfg.data.train_batch_size * cfg.rollout.n
        self.index = 0  # rounds done so far: the next round's number
        self.kept: Batch | None = None  # the samples kept over the rounds
        self.last: Batch | None = None  # the last round as drawn (dynamic sampling's fallback)
        self.generated = 0
        self.counts = None  # (kept, generated) over the actor's dp ranks, after each round
        self.done = False

    def more(self) -> bool:
        """Whether the step needs another round (always a first one)."""
        return not self.done

    def add(self, batch: Batch) -> None:
        """A scored round: keep its informative groups (all of it without dynamic sampling)."""
        self.index += 1
        self.generated += len(batch)
        if self.dynamic:
            self.last = batch
            a = self.cfg.algorithm
            signal = batch["rule_scores"] if a.filter_metric == "rule_score" else batch["scores"]
            batch = batch.select(informative_groups(signal, batch["uid"]))
        self.kept = batch if self.kept is None else Batch.cat([self.kept, batch])
        if not self.dynamic:
            self.done = True
            return
        self.counts = reduce_sum(torch.tensor([float(len(self.kept)), float(self.generated)]),
                                 group=self.actor_mesh.group("dp"))
        self.done = self.counts[0] >= self.target or self.index >= self.cfg.algorithm.max_sample_rounds

    def batch(self, step: int) -> tuple[Batch, dict[str, float]]:
        """The samples this rank trains on, and dynamic sampling's metrics."""
        n = self.cfg.rollout.n
        if not self.dynamic:
            return self._first(self.kept, step, multiple=1), {}
        counts = self.counts
        per_rank = dynamic_sampling_quota(int(counts[0]), self.target, n, self.actor_mesh.dp_size)
        metrics = {"train/kept_sample_ratio": float(counts[0] / counts[1]), "train/sample_rounds": float(self.index),
                   "train/filter_fallback": float(per_rank == 0)}
        if per_rank == 0:  # no informative group on some rank: train on the last round as drawn
            return self._first(self.last, step, multiple=n), metrics
        kept = self.kept
        if int(reduce_min(len(kept), group=self.meshes.train_group)) >= per_rank:  # every rank has enough
            return kept.select(slice(0, per_rank)), metrics
        lo = self.actor_mesh.dp_offset(per_rank)
        kept = take_global_rows(kept, lo, lo + per_rank, group=self.actor_mesh.group("dp"))
        self.scorer.attach_meta(kept, self.dataset, self.actor_mesh)
        return kept, metrics

    def _first(self, batch: Batch, step: int, multiple: int) -> Batch:
        """The first k samples, k the fewest any training rank holds, rounded down to whole groups."""
        keep = int(reduce_min(len(batch), group=self.meshes.train_group))
        keep -= keep % multiple
        if keep == 0:
            raise SpmdrlError(f"step {step}: no samples left to train on (a hook dropped them all); check the hooks")
        return batch.select(slice(0, keep))
