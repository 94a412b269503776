"""Where a TokenBatch's valid response tokens are, as integer indices computed on the host.

The log-prob heads read hidden states at the valid response positions only (the lm_head never runs on prompt
or padding positions). Selecting them with a boolean mask on the device would read the mask's count back to the
host (its result's size is data), a wait for the device once per micro-batch; ResponseIndex.of computes the
positions from the caller's CPU TokenBatch instead, so the device only gathers and scatters with known sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ResponseIndex:
    """n = valid response tokens of a TokenBatch of B sequences in N rows of L positions.

    hidden  [n] into the hidden states flattened to [N * L, H] (batch_first: row * L + pos) or, for
            sequence-first hidden states [L, N, H], to [L * N, H] (pos * N + row)
    labels  [n] the response token ids at those positions
    out     [n] into [B * R] (resp_mask's True positions, row-major): where each result goes back
    shape   (B, R)"""

    hidden: torch.Tensor
    labels: torch.Tensor
    out: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def of(cls, tb, *, batch_first: bool = False) -> "ResponseIndex":
        n_rows, width = tb.input_ids.shape
        sel = tb.resp_mask.bool().reshape(-1)
        out = sel.nonzero().squeeze(1)  # on the host: the TokenBatch comes from micro_batches on the CPU
        flat = tb.rows() * width + tb.resp_pos if batch_first else tb.resp_pos * n_rows + tb.rows()
        return cls(flat.reshape(-1)[out], tb.resp_ids.reshape(-1)[out], out, tuple(tb.resp_ids.shape))

    @property
    def n(self) -> int:
        return self.out.shape[0]

    def to(self, device) -> "ResponseIndex":
        return ResponseIndex(self.hidden.to(device, non_blocking=True), self.labels.to(device, non_blocking=True),
                             self.out.to(device, non_blocking=True), self.shape)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[n] values at the valid response positions -> [B, R], zero elsewhere."""
        out = values.new_zeros(self.shape)  # returned as the base tensor, not a view (FSDP2 warns on views)
        out.view(-1).index_copy_(0, self.out, values)
        return out
