"""Deterministic, resumable prompt sampler for data-parallel ranks.

Every rank builds the same permutation from (seed, epoch), takes the step's global batch from it and keeps
its own contiguous slice. The position is two integers, so a checkpoint restores the exact stream.
"""
from __future__ import annotations

import math

import torch

from spmdrl.dist.layout import contiguous_share, splits_evenly
from spmdrl.errors import CheckpointError, ConfigError


def epoch_permutation(num_prompts: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    if not shuffle:
        return torch.arange(num_prompts)
    g = torch.Generator()
    # Mix seed and epoch so (seed, epoch+1) never equals (seed+1, epoch).
    g.manual_seed((seed * 0x9E3779B1 + epoch * 0x85EBCA77 + 1) % (2**63))
    return torch.randperm(num_prompts, generator=g)


class DistributedPromptSampler:
    """Yields, per step, this rank's prompt indices (its contiguous 1/dp_size of the step's batch). Never ends:
    after the last step of an epoch the next epoch starts with a new permutation."""

    def __init__(
        self,
        num_prompts: int,
        *,
        dp_rank: int,
        dp_size: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if batch_size <= 0 or not splits_evenly(batch_size, dp_size):
            raise ConfigError(
                f"global prompt batch size {batch_size} is not a positive multiple of the data-parallel size "
                f"{dp_size}; set data.train_batch_size to a multiple of {dp_size}"
            )
        if num_prompts <= 0 or (drop_last and num_prompts < batch_size):
            raise ConfigError(
                f"{num_prompts} prompts cannot fill one batch of {batch_size} with drop_last; "
                "add prompts or lower data.train_batch_size"
            )
        self.num_prompts = num_prompts
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.batch_size = batch_size
        self.per_rank = len(contiguous_share(batch_size, dp_size, dp_rank))
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.step_in_epoch = 0
        self._perm: torch.Tensor | None = None
        self._perm_epoch = -1

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_prompts // self.batch_size
        return math.ceil(self.num_prompts / self.batch_size)

    def _permutation(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            perm = epoch_permutation(self.num_prompts, self.seed, self.epoch, self.shuffle)
            if not self.drop_last:
                # Fill the last batch from the start of the permutation so every rank gets a full slice.
                total = self.steps_per_epoch * self.batch_size
                perm = perm.repeat(math.ceil(total / self.num_prompts))[:total]
            self._perm, self._perm_epoch = perm, self.epoch
        return self._perm

    def global_batch(self) -> list[int]:
        """The whole step's prompts (all ranks), without advancing."""
        start = self.step_in_epoch * self.batch_size
        return self._permutation()[start:start + self.batch_size].tolist()

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        batch = self.global_batch()
        share = contiguous_share(len(batch), self.dp_size, self.dp_rank)
        mine = batch[share.start:share.stop]
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return mine

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        try:
            epoch, step, seed = int(state["epoch"]), int(state["step_in_epoch"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"sampler state {state!r} needs integer epoch, step_in_epoch, seed") from e
        if step > self.steps_per_epoch or epoch < 0 or step < 0:
            raise CheckpointError(
                f"sampler state step_in_epoch={step} does not fit {self.steps_per_epoch} steps per epoch; "
                "the dataset or batch size changed since the checkpoint"
            )
        self.seed, self.epoch, self.step_in_epoch = seed, epoch, step
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self._perm_epoch = -1
