"""The token batch every training engine's forward heads take: prompt + response sequences, padded or packed
(spmdrl.engines.packing), with the positions of the response tokens; built by `pack_sequences`."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBatch:
    """Prompt + response token sequences for one forward, padded or packed (spmdrl.engines.packing).

    Padded: input_ids [B, L], one sequence per row right-padded to the longest; mask [B, L] (1 on real tokens);
    position_ids [B, L] = 0..L-1. Packed (cu_seqlens set): input_ids [1, T], every sequence's tokens one after
    another; position_ids [1, T] restart at 0 at each sequence; cu_seqlens int32 [n + 1] the sequence
    boundaries and max_seqlen the longest; mask None (no mask tensor). Row-packed reference layout (mask
    [N, 1, L, L] bool, block-diagonal causal, several sequences per row): see packing.pack_rows.
    resp_row [B] = the row holding sequence b (None: row b); resp_pos [B, R] = index in the row of the hidden
    state that predicts response token j of sequence b (its start + prompt_len - 1 + j); resp_ids [B, R];
    resp_mask [B, R]. routes (rollout routing replay): int64 [N, L, layers, top_k], the experts the rollout engine
    routed each token of input_ids to, -1 where it routed none (padding, a sequence's last token); None without
    replay. pixel_values [patches, D] and image_grid_thw [images, 3] (a vision-language model's batch): the images
    of its sequences, in sequence order, as the image processor made them (data/images.py); such a batch is always
    padded rows (pack_sequences).
    """

    input_ids: torch.Tensor
    mask: torch.Tensor | None
    position_ids: torch.Tensor
    resp_pos: torch.Tensor
    resp_ids: torch.Tensor
    resp_mask: torch.Tensor
    resp_row: torch.Tensor | None = None  # None: row b holds sequence b
    cu_seqlens: torch.Tensor | None = None  # packed: int32 [n + 1]
    max_seqlen: int = 0  # packed: the longest sequence
    routes: torch.Tensor | None = None  # replay: [N, L, layers, top_k], -1 = none
    pixel_values: torch.Tensor | None = None  # images of the sequences, in order: [patches, D]
    image_grid_thw: torch.Tensor | None = None  # [images, 3]

    def to(self, device) -> "TokenBatch":
        return TokenBatch(*(
            v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for v in (getattr(self, f) for f in self.__dataclass_fields__)
        ))

    @property
    def attention_mask(self) -> torch.Tensor:
        """The batch's mask for an attention that takes masks: `mask`, or for a packed batch its dense
        [1, 1, T, T] block-diagonal causal mask, built on each call (the megatron engine reads it; the FSDP2
        engine never builds it under its default attention)."""
        if self.mask is None and self.cu_seqlens is not None:
            from spmdrl.engines.packing import block_causal_mask, seq_ids

            return block_causal_mask(seq_ids(self.cu_seqlens)[None])
        return self.mask

    def rows(self) -> torch.Tensor:
        """[B, 1] row index of each sequence, for indexing hidden states [N, L, H] with resp_pos."""
        if self.resp_row is None:
            return torch.arange(self.resp_ids.shape[0], device=self.resp_pos.device)[:, None]
        return self.resp_row[:, None]


def pack_sequences(
    prompts: list[torch.Tensor], responses: list[torch.Tensor], pad_id: int, *, packed: bool = False, row_len: int = 0,
    routes: list[torch.Tensor] | None = None, vision: list | None = None,
) -> TokenBatch:
    """Build a TokenBatch from ragged prompt and response token tensors (1-D int64 each): one right-padded
    sequence per row; with `packed`, all sequences in one row with cu_seqlens (packing.pack_varlen), or with
    `packed` and row_len > 0 the row-packed reference layout, whole sequences first-fit into rows of row_len
    tokens with a block-diagonal causal mask (packing.pack_rows). routes: per sequence, the rollout's routes
    [len(prompt) + len(response), layers, top_k] (-1 = none), laid out like input_ids in TokenBatch.routes.
    vision: per sequence, its images' inputs (an object with pixel_values and image_grid_thw, data/images.py) or
    None; with any images the batch is padded rows whatever `packed` says (a vision-language model's 3-D rotary
    positions are computed by the model from each row's image tokens and grids, which packing cannot express)."""
    if vision is not None and any(v is not None for v in vision):
        if packed:
            _log_padded_once()
        tb = _pack(prompts, responses, pad_id, False, 0)
        mine = [v for v in vision if v is not None]
        tb.pixel_values = torch.cat([v.pixel_values for v in mine])
        tb.image_grid_thw = torch.cat([v.image_grid_thw for v in mine]).long()
        if routes is not None:
            tb.routes = _place(tb, [len(p) for p in prompts], routes)
        return tb
    tb = _pack(prompts, responses, pad_id, packed, row_len)
    if routes is not None:
        tb.routes = _place(tb, [len(p) for p in prompts], routes)
    return tb


_padded_logged = False


def _log_padded_once() -> None:
    global _padded_logged
    if not _padded_logged:
        _padded_logged = True
        import logging

        logging.getLogger("spmdrl").info(
            "micro-batches with images are laid out as padded rows, not packed: the model computes each row's 3-D "
            "rotary positions from its image tokens and grids")


def _place(tb: TokenBatch, prompt_lens: list[int], routes: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence tensors [len_i, ...] laid out like tb.input_ids ([N, L, ...], -1 elsewhere): sequence b starts
    in row rows()[b] at column resp_pos[b, 0] + 1 - prompt_len[b], in every layout."""
    starts = (tb.resp_pos[:, 0] + 1 - torch.tensor(prompt_lens, dtype=torch.long)).tolist()
    out = torch.full((*tb.input_ids.shape, *routes[0].shape[1:]), -1, dtype=torch.long)
    for row, start, seq in zip(tb.rows()[:, 0].tolist(), starts, routes):
        out[row, start: start + len(seq)] = seq
    return out


def _pack(prompts: list[torch.Tensor], responses: list[torch.Tensor], pad_id: int, packed: bool,
          row_len: int) -> TokenBatch:
    B = len(prompts)
    plen = torch.tensor([len(p) for p in prompts])
    rlen = torch.tensor([len(r) for r in responses])
    R = max(int(rlen.max()), 1)
    resp_ids = torch.full((B, R), pad_id, dtype=torch.long)
    for i, r in enumerate(responses):
        resp_ids[i, : len(r)] = r
    ar_R = torch.arange(R)
    resp_mask = (ar_R[None, :] < rlen[:, None]).long()
    if packed and row_len:
        from spmdrl.engines.packing import pack_rows

        input_ids, mask, position_ids, resp_pos, row_of = pack_rows(prompts, responses, pad_id, R, row_len)
        return TokenBatch(input_ids, mask, position_ids, resp_pos, resp_ids, resp_mask, row_of)
    if packed:
        from spmdrl.engines.packing import pack_varlen

        input_ids, position_ids, cu, max_len, resp_pos = pack_varlen(prompts, responses, R)
        return TokenBatch(input_ids, None, position_ids, resp_pos, resp_ids, resp_mask,
                          torch.zeros(B, dtype=torch.long), cu, max_len)
    L = int((plen + rlen).max())
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p)] = p
        input_ids[i, len(p): len(p) + len(r)] = r
    ar_L = torch.arange(L)
    attention_mask = (ar_L[None, :] < (plen + rlen)[:, None]).long()
    resp_pos = (plen[:, None] - 1 + ar_R[None, :]).clamp(max=L - 1)
    position_ids = ar_L.expand(B, L).contiguous()
    return TokenBatch(input_ids, attention_mask, position_ids, resp_pos, resp_ids, resp_mask)


def relayout(b: TokenBatch, *, packed: bool, row_len: int = 0) -> TokenBatch:
    """A batch of packed sequences in one row (cu_seqlens) in another layout (pack_sequences' packed / row_len:
    padded rows, or rows of row_len tokens with dense masks): the same sequences, response ids and response
    mask, on b's device."""
    cu = b.cu_seqlens.tolist()
    ids = b.input_ids[0].cpu()
    start = (b.resp_pos[:, 0].cpu() + 1).tolist()  # first response token of each sequence
    prompts = [ids[a: s] for a, s in zip(cu, start)]
    resps = [ids[s: e] for s, e in zip(start, cu[1:])]
    routes = None if b.routes is None else [b.routes[0, a: e].cpu() for a, e in zip(cu, cu[1:])]
    out = pack_sequences(prompts, resps, 0, packed=packed, row_len=row_len, routes=routes)
    out.resp_ids, out.resp_mask = b.resp_ids, b.resp_mask
    return out.to(b.input_ids.device)


def dense_rows(b: TokenBatch) -> TokenBatch:
    """A packed (cu_seqlens) batch in the row-packed reference layout: its sequences first-fit into rows of
    max_seqlen tokens with the dense block-diagonal causal mask (what model.attn_implementation = "sdpa" runs).
    The same sequences, response ids and mask; on b's device."""
    return relayout(b, packed=True, row_len=b.max_seqlen)
