"""Validation: accuracy per data source on the validation set, with its own sampling settings."""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from spmdrl.data.prompts import PromptDataset
from spmdrl.dist.collectives import reduce_mean, reduce_sum
from spmdrl.dist.meshes import RoleMesh
from spmdrl.hooks import StageHooks
from spmdrl.loop.build import Specs
from spmdrl.loop.generate import request_seeds, sample
from spmdrl.loop.generations import GenerationLog
from spmdrl.loop.memory import MemoryLifecycle
from spmdrl.loop.scoring import Scorer
from spmdrl.rollout.multi_turn import AgentLoop

log = logging.getLogger("spmdrl")


class Validator:
    """Generates on the rollout ranks (rollout: this rank's rollout engine, None where it holds none) and sums
    the scores over every rank. In split placement it runs between steps, where no transfer is pending and the
    rollout ranks hold the last weights (loop/split.py)."""

    def __init__(self, cfg, mesh: RoleMesh, dataset: PromptDataset, rollout, memory: MemoryLifecycle, specs: Specs,
                 scorer: Scorer, hooks: StageHooks, pad_id: int, agent: AgentLoop | None = None,
                 generations: GenerationLog | None = None):
        """agent: the multi-turn loop (multi_turn.enable): validation rolls out with it too. generations: where
        the scored samples go to be shown (logging.log_generations) and dumped (logging.dump_rollouts)."""
        self.cfg, self.mesh, self.dataset, self.rollout, self.memory = cfg, mesh, dataset, rollout, memory
        self.specs, self.scorer, self.hooks, self.pad_id, self.agent = specs, scorer, hooks, pad_id, agent
        self.generations = generations
        # the same sorted list on every rank: it orders the all-reduce
        self.sources = sorted(set(dataset.batch(list(range(len(dataset)))).data_source))

    @torch.no_grad()
    def run(self, step: int) -> dict[str, float]:
        """Accuracy per data source, reduced over all ranks. Validation batches stay in the rollout layout:
        each rollout dp rank takes a contiguous part of the set."""
        r, ds = self.mesh, self.dataset
        t0 = time.perf_counter()
        rows = list(r.dp_range(len(ds))) if r.active else []  # split: the training ranks only join the sums
        sources = self.sources
        sums = torch.zeros(2 * len(sources) + 2, dtype=torch.float64)  # accuracy, count per source; reward, count
        hook_metrics: dict[str, float] = {}
        self.memory.for_rollout()  # stays awake: the next step's rollout follows
        vbs = self.cfg.data.val_batch_size
        chunk = max(1, r.dp_ceil(vbs)) if vbs else max(1, len(rows))
        for start in range(0, len(rows), chunk):
            part = rows[start: start + chunk]
            seeds = request_seeds(self.cfg.trainer.seed + 1, 0, part[0], len(part))
            batch = sample(self.rollout, self.agent, ds, part, self.specs.val, seeds, self.pad_id)
            self.scorer.attach_meta(batch, ds, r)
            self.scorer.score(batch, r, shaping=False)
            if self.generations is not None:
                self.generations.record(step, "val", batch, r)
            for k, v in self.hooks("on_validation", step, batch).items():  # mean over chunks
                hook_metrics[k] = hook_metrics.get(k, 0.0) + v * len(part) / len(rows)
            w = r.leader_weight()  # the tp group holds the same samples: count them once
            for s, src in zip(batch["accuracy"].tolist(), batch.meta["data_source"]):
                k = sources.index(src)
                sums[k] += s * w
                sums[len(sources) + k] += w
            sums[-2] += float(batch["scores"].sum()) * w
            sums[-1] += len(batch) * w
        sums = reduce_sum(sums)
        acc = {f"val/source_accuracy/{src}": float(sums[k] / max(sums[len(sources) + k], 1)) for k, src in enumerate(sources)}
        acc["val/accuracy"] = sum(acc.values()) / len(acc)
        if self.scorer.accuracy_fn is not None:  # the custom reward's own mean, beside the rule accuracy
            acc["val/reward_mean"] = float(sums[-2] / max(sums[-1], 1))
        acc.update(reduce_mean(hook_metrics, weight=r.leader_weight() if r.active else 0.0))
        acc["timing/validation_s"] = time.perf_counter() - t0
        if dist.get_rank() == 0:
            log.info("validation: %s", ", ".join(f"{k}={v:.3f}" for k, v in acc.items()))
        if self.generations is not None:
            self.generations.flush(step, "val")
        return acc
