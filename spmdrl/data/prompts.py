"""Prompt dataset for RL: verl-schema files in, pre-tokenised prompts out.

Every prompt is tokenised once at construction (chat template applied in batches) and stored as one flat
int32 token array plus row offsets. The other columns stay in arrow tables and become Python objects only
for the rows of a requested batch.
"""
from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from spmdrl.data import images, schema
from spmdrl.data.io import as_file_list, read_table
from spmdrl.errors import ConfigError, DataError

logger = logging.getLogger("spmdrl")

TRUNCATION_MODES = ("error", "left", "right", "middle")
_CHUNK_ROWS = 1024


@dataclass
class PromptBatch:
    """The prompts of one batch, unpadded; `index` holds their dataset indices."""

    input_ids: list[list[int]]
    data_source: list[str]
    ground_truth: list[str]
    extra_info: list[dict]
    raw_prompt: list[list[dict]]
    index: list[int]
    vision: list | None = None  # per prompt its images' VisionInputs (data/images.py), None for a text prompt


    def __len__(self) -> int:
        return len(self.input_ids)


def truncate(ids: np.ndarray, max_length: int, mode: str) -> np.ndarray:
    """Keep `max_length` tokens: the last ones (left), the first ones (right) or both ends (middle)."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[len(ids) - max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        tail = max_length - head
        return np.concatenate([ids[:head], ids[len(ids) - tail:]])
    raise ValueError(f"truncation mode {mode!r} does not cut")


class PromptDataset:
    def __init__(
        self,
        files: str | list[str],
        tokenizer,
        *,
        max_prompt_length: int,
        truncation: str = "error",
        filter_overlong: bool = False,
        prompt_key: str = schema.PROMPT,
        apply_chat_template: bool = True,
        tools: list[dict] | None = None,
        vision=None,
        image_key: str = images.IMAGE_KEY,
    ):
        """tools: tool schemas the chat template renders into every prompt (`tools=`; multi-turn rollouts).
        vision: a vision-language model's images.VisionPrompts; each row's images (column `image_key`, verl's
        multimodal schema) then go into its prompt (data/images.py)."""
        if truncation not in TRUNCATION_MODES:
            raise ConfigError(f"data.truncation={truncation!r} is not one of {', '.join(TRUNCATION_MODES)}")
        if max_prompt_length <= 0:
            raise ConfigError(f"data.max_prompt_length={max_prompt_length} must be positive")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the tokenizer has no chat template; use an instruct model's tokenizer "
                "or set data.apply_chat_template=false"
            )
        self.files = as_file_list(files)
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.filter_overlong = filter_overlong
        self.prompt_key = prompt_key
        self.apply_chat_template = apply_chat_template
        self.tools = list(tools) if tools else None
        self.vision = vision
        self.image_key = image_key
        self.num_filtered = 0
        self.num_truncated = 0
        self._image_tokens: dict[tuple[str, int], int] = {}  # (file, row) -> its image tokens (rows with images)

        self._tables: list[pa.Table] = []
        flats, lengths, file_of, row_of = [], [], [], []
        for f, path in enumerate(self.files):
            table = read_table(path)
            schema.validate_table(table, path, prompt_key=prompt_key)
            if vision is not None and image_key not in table.column_names:
                raise DataError(f"file {path}: no column {image_key!r} with the prompts' images (found "
                                f"{', '.join(table.column_names)}); set data.image_key to the images column")
            self._tables.append(self._keep_columns(table))
            flat, lens = self._tokenize_file(table, path)
            flat, lens, rows = self._fit_lengths(flat, lens, path, table)
            flats.append(flat)
            lengths.append(lens)
            file_of.append(np.full(len(rows), f, dtype=np.int32))
            row_of.append(rows)

        self._tokens = np.concatenate(flats).astype(np.int32, copy=False)
        self.lengths = np.concatenate(lengths).astype(np.int64, copy=False)
        self._offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self._offsets[1:])
        self._file_of = np.concatenate(file_of)
        self._row_of = np.concatenate(row_of)
        if self.num_filtered:
            logger.info(
                "filtered %d prompts longer than data.max_prompt_length=%d; %d remain",
                self.num_filtered, max_prompt_length, len(self),
            )
        if self.num_truncated:
            logger.info(
                "truncated %d of %d prompts to data.max_prompt_length=%d (data.truncation=%s%s)",
                self.num_truncated, len(self), max_prompt_length, truncation,
                ", inside the last message: the chat template's ends are kept" if apply_chat_template else "",
            )
        if len(self) == 0:
            raise DataError(
                f"file {self.files[0]}: no prompts left (read {len(self.files)} file(s), "
                f"{self.num_filtered} filtered as over-long); add rows or raise data.max_prompt_length"
            )

    # ----- construction -----

    def _keep_columns(self, table: pa.Table) -> pa.Table:
        """Only what a batch needs, with ground truth already as strings."""
        cols = {
            schema.DATA_SOURCE: table.column(schema.DATA_SOURCE).cast(pa.string()),
            "prompt": table.column(self.prompt_key),
            schema.GROUND_TRUTH: pc.struct_field(table.column(schema.REWARD_MODEL), schema.GROUND_TRUTH)
            .cast(pa.string()),
        }
        if schema.EXTRA_INFO in table.column_names:
            cols[schema.EXTRA_INFO] = table.column(schema.EXTRA_INFO)
        if self.vision is not None:
            cols[images.IMAGE_KEY] = table.column(self.image_key)
        return pa.table(cols)

    def _tokenize_file(self, table: pa.Table, path) -> tuple[np.ndarray, np.ndarray]:
        if self.vision is not None:
            return self._tokenize_with_images(table, path)
        col = table.column(self.prompt_key)
        flats, lens = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int64)]
        for start in range(0, len(col), _CHUNK_ROWS):
            msgs = [as_messages(p) for p in col.slice(start, _CHUNK_ROWS).to_pylist()]
            texts = self._render(msgs, path, start)
            ids = self.tokenizer(texts, add_special_tokens=not self.apply_chat_template)["input_ids"]
            n = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
            flats.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(n.sum())))
            lens.append(n)
        return np.concatenate(flats), np.concatenate(lens)

    def _tokenize_with_images(self, table: pa.Table, path) -> tuple[np.ndarray, np.ndarray]:
        """Each row's prompt with its images' tokens (images.VisionPrompts); a row whose images do not match its
        placeholders or do not decode is a row error; the image tokens of a row are counted in self._image_tokens."""
        if not self.apply_chat_template:
            raise ConfigError("data.apply_chat_template = false with images: the image placeholders become image "
                              "parts of the chat messages, which only a chat template renders; set it to true")
        col, items = table.column(self.prompt_key), table.column(self.image_key)
        base = os.path.dirname(os.path.abspath(str(path)))
        flats, lens = [np.zeros(0, dtype=np.int32)], []
        for start in range(0, len(col), _CHUNK_ROWS):
            convs = [images.image_messages(as_messages(p)) for p in col.slice(start, _CHUNK_ROWS).to_pylist()]
            texts = render_chat(self.tokenizer, [c for c, _ in convs], path=path, start=start, column=self.prompt_key,
                                tools=self.tools)
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            for k, (row_items, (_, n)) in enumerate(zip(items.slice(start, _CHUNK_ROWS).to_pylist(), convs)):
                row = start + k
                pics = images.row_images(path, row, self.image_key, row_items, n, base)
                x = ids[k]
                if pics:
                    grid = self.vision.process(pics).image_grid_thw
                    x = self.vision.expand(x, grid)
                    self._image_tokens[(str(path), row)] = sum(self.vision.tokens_per_image(grid))
                flats.append(np.asarray(x, dtype=np.int32))
                lens.append(len(x))
        return np.concatenate(flats), np.asarray(lens, dtype=np.int64)

    def _render(self, msgs: list[list[dict]], path, start: int) -> list[str]:
        if not self.apply_chat_template:
            return ["\n".join(m["content"] for m in conv) for conv in msgs]
        return render_chat(self.tokenizer, msgs, path=path, start=start, column=self.prompt_key, tools=self.tools)

    def _fit_lengths(self, flat: np.ndarray, lens: np.ndarray, path, table: pa.Table | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Apply data.truncation / data.filter_overlong. Returns (tokens, lengths, kept source rows)."""
        limit = self.max_prompt_length
        over = lens > limit
        rows = np.arange(len(lens), dtype=np.int64)
        if not over.any():
            return flat, lens, rows
        offsets = np.concatenate([[0], np.cumsum(lens)])
        if self.filter_overlong:
            self.num_filtered += int(over.sum())
            keep = np.repeat(~over, lens)
            return flat[keep], lens[~over], rows[~over]
        with_images = [int(r) for r in np.flatnonzero(over) if (str(path), int(r)) in self._image_tokens]
        if with_images:  # cutting would cut an image's tokens: refused whatever data.truncation says
            r = with_images[0]
            raise schema.row_error(
                path, r, self.image_key,
                f"prompt is {int(lens[r])} tokens, {self._image_tokens[(str(path), r)]} of them image tokens, over "
                f"data.max_prompt_length={limit}; raise data.max_prompt_length, send smaller images, or set "
                "data.filter_overlong=true",
            )
        if self.truncation == "error":
            bad = np.flatnonzero(over)
            more = f" ({len(bad) - 1} more rows are too long)" if len(bad) > 1 else ""
            raise schema.row_error(
                path, int(bad[0]), self.prompt_key,
                f"prompt is {int(lens[bad[0]])} tokens, over data.max_prompt_length={limit}{more}; "
                "set data.truncation to left/right/middle, data.filter_overlong=true, "
                "or raise data.max_prompt_length",
            )
        self.num_truncated += int(over.sum())
        pieces, new_lens = [], lens.copy()
        col = table.column(self.prompt_key) if table is not None and self.apply_chat_template else None
        for r in np.flatnonzero(over):
            ids = None
            if col is not None:
                ids = self._truncate_inside(as_messages(col[int(r)].as_py()), limit)
            if ids is None:
                ids = truncate(flat[offsets[r]:offsets[r + 1]], limit, self.truncation)
            pieces.append((r, ids))
            new_lens[r] = len(ids)
        out, prev = [], 0
        for r, ids in pieces:
            out.append(flat[offsets[prev]:offsets[r]])
            out.append(ids)
            prev = r + 1
        out.append(flat[offsets[prev]:])
        return np.concatenate(out), new_lens, rows

    def _truncate_inside(self, conv: list[dict], limit: int) -> np.ndarray | None:
        """The rendered prompt with only the last message's content cut (data.truncation's side), so the chat
        template's start and its generation prompt (e.g. `<|im_start|>assistant`) stay; None when the
        template's own tokens leave no room."""
        marker = "\ue000spmdrl-cut\ue000"
        framed = [*conv[:-1], {**conv[-1], "content": marker}]
        text = self.tokenizer.apply_chat_template(framed, tools=self.tools, tokenize=False, add_generation_prompt=True)
        if text.count(marker) != 1:
            return None
        head, tail = text.split(marker)
        head_ids, tail_ids, body = (self.tokenizer(t, add_special_tokens=False)["input_ids"]
                                    for t in (head, tail, conv[-1]["content"]))
        room = limit - len(head_ids) - len(tail_ids)
        if room <= 0:
            return None
        body = truncate(np.asarray(body, dtype=np.int32), room, self.truncation)
        return np.concatenate([np.asarray(head_ids, dtype=np.int32), body, np.asarray(tail_ids, dtype=np.int32)])

    # ----- access -----

    def __len__(self) -> int:
        return len(self.lengths)

    def prompt_ids(self, i: int) -> list[int]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"prompt index {i} out of range for {len(self)} prompts")
        i %= len(self)
        return self._tokens[self._offsets[i]:self._offsets[i + 1]].tolist()

    def source(self, i: int) -> tuple[str, int]:
        """(file, row in that file) of dataset index i."""
        return self.files[self._file_of[i]], int(self._row_of[i])

    def batch(self, indices) -> PromptBatch:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"prompt indices must be in [0, {len(self)}), got {idx.min()}..{idx.max()}")
        n = len(idx)
        data_source, ground_truth = [None] * n, [None] * n
        extra_info, raw_prompt = [None] * n, [None] * n
        vision = [None] * n
        files = self._file_of[idx]
        for f in np.unique(files):
            pos = np.flatnonzero(files == f)
            sub = self._tables[f].take(pa.array(self._row_of[idx[pos]]))
            ds = sub.column(schema.DATA_SOURCE).to_pylist()
            gt = sub.column(schema.GROUND_TRUTH).to_pylist()
            pr = sub.column("prompt").to_pylist()
            has_extra = schema.EXTRA_INFO in sub.column_names
            ei = sub.column(schema.EXTRA_INFO).to_pylist() if has_extra else [None] * len(pos)
            pics = sub.column(images.IMAGE_KEY).to_pylist() if self.vision is not None else None
            for j, p in enumerate(pos):
                data_source[p], ground_truth[p] = ds[j], gt[j]
                raw_prompt[p], extra_info[p] = as_messages(pr[j]), _as_dict(ei[j])
                if pics is not None and pics[j]:
                    path = self.files[f]
                    decoded = [images.decode_image(item, os.path.dirname(os.path.abspath(str(path))))
                               for item in pics[j]]
                    vision[p] = self.vision.process(decoded)
        return PromptBatch(
            input_ids=[self.prompt_ids(int(i)) for i in idx],
            data_source=data_source,
            ground_truth=ground_truth,
            extra_info=extra_info,
            raw_prompt=raw_prompt,
            index=idx.tolist(),
            vision=vision if self.vision is not None else None,
        )


def render_chat(tokenizer, msgs: list[list[dict]], *, path, start: int, column: str,
                tools: list[dict] | None = None) -> list[str]:
    """Chat template over a batch of conversations (generation prompt added, `tools` rendered when given); names
    the row it rejects."""
    try:
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception:
        pass
    for i, conv in enumerate(msgs):
        try:
            tokenizer.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise schema.row_error(
                path, start + i, column,
                f"the chat template rejects these messages ({type(e).__name__}: {' '.join(str(e).split())}); "
                "fix the messages or set data.apply_chat_template=false",
            ) from e
    raise DataError(f"file {path}: rows {start}..{start + len(msgs) - 1}: the chat template failed on the batch")


def as_messages(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{**m, "content": m.get("content") or ""} for m in prompt]


def _as_dict(extra) -> dict:
    if extra is None:
        return {}
    if isinstance(extra, list):  # arrow map -> list of (key, value)
        return dict(extra)
    return extra


def left_pad(list_of_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists for generation: (ids LongTensor [B, L], attention_mask LongTensor [B, L])."""
    if not list_of_ids:
        raise ValueError("left_pad needs at least one sequence")
    width = max(len(x) for x in list_of_ids)
    ids = torch.full((len(list_of_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(list_of_ids), width), dtype=torch.long)
    for b, x in enumerate(list_of_ids):
        if len(x):
            ids[b, width - len(x):] = torch.as_tensor(x, dtype=torch.long)
            mask[b, width - len(x):] = 1
    return ids, mask
