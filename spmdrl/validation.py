"""Validation: accuracy per data source on the validation set, with its own sampling settings."""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from spmdrl.dist.collectives import reduce_mean, reduce_sum
from spmdrl.metrics import StageTimer
from spmdrl.stages import request_seeds

log = logging.getLogger("spmdrl")


class Validation:
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Accuracy per data source, reduced over all ranks. Validation batches stay in the rollout layout:
        each rollout dp rank takes a contiguous part of the set."""
        r, ds = self.rollout_mesh, self.val_ds
        t0 = time.perf_counter()
        if self.split and r.active:  # split placement: the weights the training ranks posted last
            self.stream.load_due_weights(StageTimer())
        rows = list(r.dp_range(len(ds))) if r.active else []  # split: the training ranks only join the sums
        sources = self.val_sources
        sums = torch.zeros(2 * len(sources), dtype=torch.float64)
        hook_metrics: dict[str, float] = {}
        self.memory.for_rollout()  # stays awake: the next step's rollout follows
        vbs = self.cfg.data.val_batch_size
        chunk = max(1, r.dp_ceil(vbs)) if vbs else max(1, len(rows))
        for start in range(0, len(rows), chunk):
            part = rows[start: start + chunk]
            prompts = [ds.prompt_ids(i) for i in part]
            seeds = request_seeds(self.cfg.trainer.seed + 1, 0, part[0], len(part))
            out = self.rollout.generate(prompts, self.specs.val, seeds)
            batch = self.to_batch(prompts, part, out, self.specs.val.n)
            self.attach_meta(batch, ds, mesh=r)
            self.compute_reward(batch, shaping=False, mesh=r)
            for k, v in self.run_hooks("on_validation", self.global_step, batch).items():  # mean over chunks
                hook_metrics[k] = hook_metrics.get(k, 0.0) + v * len(part) / len(rows)
            w = r.leader_weight()  # the tp group holds the same samples: count them once
            for s, src in zip(batch["scores"].tolist(), batch.meta["data_source"]):
                k = sources.index(src)
                sums[k] += s * w
                sums[len(sources) + k] += w
        sums = reduce_sum(sums)
        acc = {f"val/accuracy/{src}": float(sums[k] / max(sums[len(sources) + k], 1)) for k, src in enumerate(sources)}
        acc["val/accuracy"] = sum(acc.values()) / len(acc)
        acc.update(reduce_mean(hook_metrics, weight=r.leader_weight() if r.active else 0.0))
        acc["timing/validation_s"] = time.perf_counter() - t0
        if dist.get_rank() == 0:
            log.info("validation: %s", ", ".join(f"{k}={v:.3f}" for k, v in acc.items()))
        return acc
