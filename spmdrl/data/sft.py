"""SFT dataset for the warm start, in two forms per file.

prompt + response: a prompt column (chat messages or str) and a response column (str);
input_ids = chat_template(prompt, add_generation_prompt=True) + response + eos, and loss_mask is 1 exactly on
the response tokens and the eos.

messages: a column holding a whole conversation (system/user/assistant/tool messages) and optionally a tools
column (the tool schemas, a JSON string or a list of objects, passed to the chat template's `tools`);
input_ids = chat_template(messages, tools=tools), and loss_mask is 1 exactly on the tokens of the assistant
turns: each one's content and its end token, not the template's header before it nor what follows the end
token. The turns' boundaries come from rendering the conversation's prefixes, so the template must render
prefix-preserving (an earlier turn renders the same whether or not later turns follow); a row where it does
not is refused.

With a vision-language model (`vision`, data/images.VisionPrompts), a prompt + response file may carry the prompts'
images in an `image_key` column, as verl's multimodal RL rows do: each `<image>` placeholder of the prompt becomes
the image's tokens, and each item's pixel values and grids come with it (`__getitem__`'s "vision"). A conversation
file takes no images.

Tokenised once at construction into a flat array, like PromptDataset.
"""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from spmdrl.data import images, schema
from spmdrl.data.io import as_file_list, read_table
from spmdrl.data.prompts import as_messages, render_chat
from spmdrl.errors import ConfigError, DataError

_CHUNK_ROWS = 1024


@dataclass
class SFTBatch:
    """Right-padded: input_ids, attention_mask, loss_mask, all LongTensor [B, L]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor


class SFTDataset:
    def __init__(
        self,
        files: str | list[str],
        tokenizer,
        max_length: int,
        prompt_key: str = "prompt",
        response_key: str = "response",
        truncation: str = "error",
        messages_key: str = "messages",
        tools_key: str = "tools",
        vision=None,
        image_key: str = images.IMAGE_KEY,
    ):
        if truncation not in ("error", "right"):
            raise ConfigError(f"sft truncation={truncation!r} is not one of error, right")
        if max_length <= 0:
            raise ConfigError(f"sft max_length={max_length} must be positive")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template; SFT prompts are rendered with it")
        if tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no eos token; SFT appends it to every response")
        self.files = as_file_list(files)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.prompt_key = prompt_key
        self.response_key = response_key
        self.messages_key = messages_key
        self.tools_key = tools_key
        self.truncation = truncation
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.vision, self.image_key = vision, image_key
        self._images: dict[int, tuple[list, str]] = {}  # row index -> (its image items, their base folder)

        flats, masks, lens = [], [], []
        for path in self.files:
            table = read_table(path)
            if messages_key in table.column_names:
                if vision is not None and image_key in table.column_names:
                    raise DataError(f"file {path}: images (column {image_key!r}) go with prompt + response rows; "
                                    f"a conversation file ({messages_key!r}) takes none: drop the column")
                f, m, n = self._tokenize_conversations(table, path)
            else:
                self._validate(table, path)
                f, m, n = self._tokenize_file(table, path, sum(len(x) for x in lens))
            flats.append(f)
            masks.append(m)
            lens.append(n)
        self._tokens = np.concatenate(flats)
        self._mask = np.concatenate(masks)
        self.lengths = np.concatenate(lens)
        self._offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self._offsets[1:])
        if len(self) == 0:
            raise DataError(f"file {self.files[0]}: no SFT rows in {len(self.files)} file(s); add rows")

    def _validate(self, table: pa.Table, path) -> None:
        for name in (self.prompt_key, self.response_key):
            if name not in table.column_names:
                raise DataError(
                    f"file {path}: missing column {name!r} (SFT needs {self.prompt_key} and {self.response_key}, or "
                    f"{self.messages_key}; found {', '.join(table.column_names) or 'no columns'}); set the sft "
                    "prompt/response/messages keys"
                )
        schema.check_prompt_column(table, path, self.prompt_key)
        resp = table.column(self.response_key)
        if not schema.is_string_type(resp.type):
            raise schema.wrong_type_error(path, resp, self.response_key, "string")
        if resp.null_count:
            row, more = schema.first_row(np.asarray(resp.is_null(), dtype=bool))
            raise schema.row_error(path, row, self.response_key, f"is null{more}; fill in the response")

    def _tokenize_file(self, table: pa.Table, path, first_index: int):
        prompts, responses = table.column(self.prompt_key), table.column(self.response_key)
        eos = self.tokenizer.eos_token_id
        with_images = self.vision is not None and self.image_key in table.column_names
        flats, masks, lens = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int8)], [np.zeros(0, dtype=np.int64)]
        for start in range(0, len(table), _CHUNK_ROWS):
            msgs = [as_messages(p) for p in prompts.slice(start, _CHUNK_ROWS).to_pylist()]
            if with_images:
                msgs, counts = zip(*(images.image_messages(m) for m in msgs)) if msgs else ((), ())
            texts = render_chat(self.tokenizer, list(msgs), path=path, start=start, column=self.prompt_key)
            p_ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            if with_images:
                p_ids = self._expand_images(p_ids, counts, table, path, start, first_index)
            r_texts = responses.slice(start, _CHUNK_ROWS).to_pylist()
            r_ids = self.tokenizer(r_texts, add_special_tokens=False)["input_ids"]
            rows, chunk_plens = [], []
            for i, (p, r) in enumerate(zip(p_ids, r_ids)):
                ids = p + r + [eos]
                if len(ids) > self.max_length:
                    if self.truncation == "error" or len(p) >= self.max_length:
                        raise schema.row_error(
                            path, start + i, self.response_key if len(p) < self.max_length else self.prompt_key,
                            f"prompt+response is {len(ids)} tokens (prompt {len(p)}), over sft max_length="
                            f"{self.max_length}; raise max_length, shorten the row"
                            + (", or set truncation=right" if len(p) < self.max_length else ""),
                        )
                    ids = ids[:self.max_length]
                rows.append(ids)
                chunk_plens.append(min(len(p), len(ids)))
            _append(flats, masks, lens, rows, [[0] * p + [1] * (len(ids) - p) for ids, p in zip(rows, chunk_plens)])
        return np.concatenate(flats), np.concatenate(masks), np.concatenate(lens)

    def _expand_images(self, p_ids, counts, table: pa.Table, path, start: int, first_index: int) -> list[list[int]]:
        """Each prompt's ids with its images' tokens; the rows' images (checked and decoded once here) are kept
        for __getitem__."""
        base = os.path.dirname(os.path.abspath(str(path)))
        items = table.column(self.image_key).slice(start, _CHUNK_ROWS).to_pylist()
        out = []
        for k, (ids, row_items, n) in enumerate(zip(p_ids, items, counts)):
            pics = images.row_images(path, start + k, self.image_key, row_items, n, base)
            if pics:
                ids = self.vision.expand(ids, self.vision.process(pics).image_grid_thw)
                self._images[first_index + start + k] = (list(row_items), base)
            out.append(ids)
        return out

    # ----- the messages form -----

    def _tokenize_conversations(self, table: pa.Table, path):
        key = self.messages_key
        col = table.column(key)
        if not schema.is_messages_type(col.type):
            raise schema.wrong_type_error(path, col, key, "a list of {role, content} chat messages")
        tools_col = table.column(self.tools_key) if self.tools_key in table.column_names else None
        flats, masks, lens = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int8)], [np.zeros(0, dtype=np.int64)]
        for start in range(0, len(table), _CHUNK_ROWS):
            convs = col.slice(start, _CHUNK_ROWS).to_pylist()
            tools = (tools_col.slice(start, _CHUNK_ROWS).to_pylist() if tools_col is not None
                     else [None] * len(convs))
            plans = [self._plan_conversation(c, t, path, start + i) for i, (c, t) in enumerate(zip(convs, tools))]
            texts = [t for full, turns in plans for t in (full, *itertools.chain.from_iterable(turns))]
            ids = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
            rows, row_masks = [], []
            for i, (full, turns) in enumerate(plans):
                full_ids = next(ids)
                mask = [0] * len(full_ids)
                for _ in turns:
                    before, after = next(ids), next(ids)
                    if full_ids[:len(before)] != before or full_ids[:len(after)] != after:
                        raise schema.row_error(
                            path, start + i, self.messages_key,
                            "the tokenizer splits the whole conversation differently at an assistant turn's "
                            "boundary than the turns before it, so the turn cannot be located by token",
                        )
                    a, b = len(before), len(after)
                    seg = full_ids[a:b]
                    ends = [j for j, t in enumerate(seg) if t == self.tokenizer.eos_token_id]
                    stop = a + ends[-1] + 1 if ends else b  # the turn's end token; the template's glue after it is 0
                    mask[a:stop] = [1] * (stop - a)
                if 1 not in mask:
                    raise schema.row_error(path, start + i, self.messages_key, "the chat template renders no tokens "
                                           "for its assistant messages, so there is nothing to train on")
                rows.append(full_ids)
                row_masks.append(mask)
            rows, row_masks = self._fit_conversations(rows, row_masks, path, start)
            _append(flats, masks, lens, rows, row_masks)
        return np.concatenate(flats), np.concatenate(masks), np.concatenate(lens)

    def _plan_conversation(self, conv, tools, path, row: int) -> tuple[str, list[tuple[str, str]]]:
        """The rendered conversation and, per assistant turn, the renderings before it (with the generation
        prompt) and up to its end. Checks each is a prefix of the whole (text); token prefixes are checked later."""
        key = self.messages_key
        if not conv:
            raise schema.row_error(path, row, key, "is null or has no messages; remove or fill the row")
        if any(m.get("role") is None for m in conv):
            raise schema.row_error(path, row, key, "a message has a null 'role'; set role to user/assistant/tool/...")
        conv = [{**m, "content": m.get("content") or ""} for m in conv]
        turns = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
        if not turns:
            raise schema.row_error(path, row, key, "has no assistant message, so nothing to train on; add one")
        tools = self._tools(tools, path, row)

        def render(msgs, gen=False):
            try:
                return self.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
            except Exception as e:
                raise schema.row_error(
                    path, row, key, f"the chat template rejects these messages ({type(e).__name__}: "
                    f"{' '.join(str(e).split())}); fix the messages",
                ) from e

        full = render(conv)
        pairs = []
        for i in turns:
            before, after = render(conv[:i], gen=True), render(conv[:i + 1])
            if not (after.startswith(before) and full.startswith(after)):
                raise schema.row_error(
                    path, row, key,
                    f"the chat template does not render this conversation prefix-preserving (the text up to "
                    f"message {i} changes when later messages follow), so the assistant turns cannot be located; "
                    "use a template that renders earlier turns unchanged",
                )
            pairs.append((before, after))
        return full, pairs

    def _tools(self, tools, path, row: int):
        if tools is None or tools == "":
            return None
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as e:
                raise schema.row_error(path, row, self.tools_key, f"is not valid JSON ({e.msg}); give a JSON list "
                                       "of tool schemas") from None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise schema.row_error(path, row, self.tools_key, "must be a list of tool schemas (objects) or a JSON "
                                   "string of one")
        return tools or None

    def _fit_conversations(self, rows, row_masks, path, start: int):
        for i, (ids, mask) in enumerate(zip(rows, row_masks)):
            if len(ids) <= self.max_length:
                continue
            first = mask.index(1)
            if self.truncation == "error" or first >= self.max_length:
                raise schema.row_error(
                    path, start + i, self.messages_key,
                    f"the conversation is {len(ids)} tokens (first assistant token at {first}), over sft "
                    f"max_length={self.max_length}; raise max_length, shorten the row"
                    + (", or set truncation=right" if first < self.max_length else ""),
                )
            rows[i], row_masks[i] = ids[:self.max_length], mask[:self.max_length]
        return rows, row_masks

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        """input_ids and loss_mask (lists), and vision: the row's images' VisionInputs, or None."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"SFT index {i} out of range for {len(self)} rows")
        i %= len(self)
        lo, hi = self._offsets[i], self._offsets[i + 1]
        vision = None
        if i in self._images:
            items, base = self._images[i]
            vision = self.vision.process([images.decode_image(item, base) for item in items])
        return {"input_ids": self._tokens[lo:hi].tolist(), "loss_mask": self._mask[lo:hi].tolist(), "vision": vision}

    def batch(self, indices) -> SFTBatch:
        rows = [self[int(i)] for i in indices]
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        loss = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[b, :n] = torch.as_tensor(r["input_ids"])
            attn[b, :n] = 1
            loss[b, :n] = torch.as_tensor(r["loss_mask"])
        return SFTBatch(ids, attn, loss)


def _append(flats: list, masks: list, lens: list, rows: list[list[int]], row_masks: list[list[int]]) -> None:
    n = np.fromiter((len(x) for x in rows), dtype=np.int64, count=len(rows))
    flats.append(np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=int(n.sum())))
    masks.append(np.fromiter(itertools.chain.from_iterable(row_masks), dtype=np.int8, count=int(n.sum())))
    lens.append(n)
