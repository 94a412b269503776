"""Batch-level sample selection and reward shaping used by DAPO: pure tensor functions."""
from __future__ import annotations

import torch
from torch import Tensor


def informative_groups(scores: Tensor, index: Tensor) -> Tensor:
    """Bool [B]: the samples whose group (same `index`) has scores that are not all equal.

    A group with max(score) == min(score) gets zero group-relative advantage for every sample, so it
    carries no policy-gradient signal (DAPO's dynamic sampling drops it). scores: [B] float, index: [B] int.
    """
    uniq, inv = torch.unique(index, return_inverse=True)
    s = scores.float()
    lo = torch.full((len(uniq),), float("inf")).scatter_reduce(0, inv, s, "amin")
    hi = torch.full((len(uniq),), float("-inf")).scatter_reduce(0, inv, s, "amax")
    return (hi > lo)[inv]


def overlong_penalty(length: Tensor, max_len: int, buffer: int, factor: float) -> Tensor:
    """DAPO soft overlong punishment per response, [B] from lengths [B]:

        0                                   if |y| <= max_len - buffer
        ((max_len - buffer) - |y|) / buffer  if max_len - buffer < |y| <= max_len   (down to -1)

    times `factor`; a response cut at the limit gets -factor.
    """
    return ((max_len - buffer - length.float()) / buffer).clamp(min=-1.0, max=0.0) * factor


def dynamic_sampling_quota(kept: int, target: int, n: int, dp: int) -> int:
    """Samples each of the dp ranks trains on after dynamic sampling.

    kept: informative samples held over all ranks; target: data.train_batch_size * n. The step trains on
    min(kept, target) rounded down to whole groups on every rank (a multiple of n * dp), split evenly:
    every rank runs the same number of micro-batches. 0 means not even one group per rank.
    """
    total = min(kept, target)
    return (total - total % (n * dp)) // dp
