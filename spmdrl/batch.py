"""The batch that flows through the stages of a step: tensors with a leading sample dim, plus metadata.

Samples of a prompt are adjacent (prompt-major, n per prompt) and stay on one rank, so group statistics
(GRPO, RLOO) need no communication. Only tensors cross ranks; per-sample metadata (data_source, ground
truth, text) is re-derived locally from `index` (the prompt's dataset row), never pickled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    """tensors: name -> Tensor[B, ...]; meta: name -> list of B Python values (local only)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if len(self) and value.shape[0] != len(self):
            raise ValueError(f"tensor {key!r} has {value.shape[0]} rows, the batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def select(self, idx: torch.Tensor | slice | list[int]) -> "Batch":
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
        else:
            rows = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        if isinstance(idx, torch.Tensor) and idx.dtype == torch.bool:
            rows = idx.nonzero().flatten().tolist()
        t_idx = torch.tensor(rows, dtype=torch.long)
        return Batch(
            {k: v.index_select(0, t_idx) for k, v in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.meta.items()},
        )

    def keep_(self, idx: torch.Tensor | slice | list[int]) -> "Batch":
        """In place: keep only the rows `idx` (as in `select`) of every tensor and meta list; returns self.
        For code that shares this Batch object and must see the rows dropped (user hooks)."""
        kept = self.select(idx)
        self.tensors, self.meta = kept.tensors, kept.meta
        return self

    def split(self, size: int) -> list["Batch"]:
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def cat(batches: list["Batch"]) -> "Batch":
        first = batches[0]
        tensors = {}
        for k in first.tensors:
            parts = [b.tensors[k] for b in batches]
            if parts[0].dim() == 2:  # ragged second dim (responses): pad to the widest
                width = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
            tensors[k] = torch.cat(parts)
        return Batch(tensors, {k: [x for b in batches for x in b.meta[k]] for k in first.meta})
