"""SFT dataset for the warm start: prompt (chat messages or str) + response (str) per row.

input_ids = chat_template(prompt, add_generation_prompt=True) + response + eos; loss_mask is 1 exactly on
the response tokens and the eos. Tokenised once at construction into a flat array, like PromptDataset.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from spmdrl.data import schema
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
        self.truncation = truncation
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

        flats, lens, prompt_lens = [], [], []
        for path in self.files:
            table = read_table(path)
            self._validate(table, path)
            f, n, p = self._tokenize_file(table, path)
            flats.append(f)
            lens.append(n)
            prompt_lens.append(p)
        self._tokens = np.concatenate(flats)
        self.lengths = np.concatenate(lens)
        self.prompt_lengths = np.concatenate(prompt_lens)
        self._offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self._offsets[1:])
        if len(self) == 0:
            raise DataError(f"file {self.files[0]}: no SFT rows in {len(self.files)} file(s); add rows")

    def _validate(self, table: pa.Table, path) -> None:
        for name in (self.prompt_key, self.response_key):
            if name not in table.column_names:
                raise DataError(
                    f"file {path}: missing column {name!r} (SFT needs {self.prompt_key}, {self.response_key}; "
                    f"found {', '.join(table.column_names) or 'no columns'}); set the sft prompt/response keys"
                )
        schema.check_prompt_column(table, path, self.prompt_key)
        resp = table.column(self.response_key)
        if not schema.is_string_type(resp.type):
            raise schema.wrong_type_error(path, resp, self.response_key, "string")
        if resp.null_count:
            row, more = schema.first_row(np.asarray(resp.is_null(), dtype=bool))
            raise schema.row_error(path, row, self.response_key, f"is null{more}; fill in the response")

    def _tokenize_file(self, table: pa.Table, path):
        prompts, responses = table.column(self.prompt_key), table.column(self.response_key)
        eos = self.tokenizer.eos_token_id
        flats = [np.zeros(0, dtype=np.int32)]
        lens, plens = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
        for start in range(0, len(table), _CHUNK_ROWS):
            msgs = [as_messages(p) for p in prompts.slice(start, _CHUNK_ROWS).to_pylist()]
            texts = render_chat(self.tokenizer, msgs, path=path, start=start, column=self.prompt_key)
            p_ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
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
                chunk_plens.append(len(p))
            n = np.fromiter((len(x) for x in rows), dtype=np.int64, count=len(rows))
            flats.append(np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=int(n.sum())))
            lens.append(n)
            plens.append(np.asarray(chunk_plens, dtype=np.int64))
        return np.concatenate(flats), np.concatenate(lens), np.concatenate(plens)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"SFT index {i} out of range for {len(self)} rows")
        i %= len(self)
        ids = self._tokens[self._offsets[i]:self._offsets[i + 1]].tolist()
        p = int(self.prompt_lengths[i])
        return {"input_ids": ids, "loss_mask": [0] * p + [1] * (len(ids) - p)}

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
