"""Weight sync, actor -> rollout: full tensors gathered from the FSDP2/TP shards in buckets and streamed into
the engine's weight loader, which slices them into its own TP layout. At most one bucket is alive."""
from __future__ import annotations

import time

import torch


def sync_weights(actor, rollout, *, bucket_mb: int, dtype: torch.dtype | None = None) -> dict[str, float]:
    t0 = time.perf_counter()
    nbytes = 0
    rollout.wake_up()
    for bucket in actor.iter_full_params(bucket_mb << 20, dtype):
        rollout.update_weights(bucket)
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        del bucket
    rollout.finish_weight_update()  # vLLM: finalize the layerwise reload (repack CPU weights, reset prefix cache)
    return {"timing/weight_sync_s": time.perf_counter() - t0, "perf/weight_sync_mb": nbytes / 2**20}
