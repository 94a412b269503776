"""Convert a geometry-QA dataset in Geometry3K's layout (hiyouga/geometry3k on the Hugging Face hub: `problem`,
`answer` and an `images` list per row) to verl's multimodal parquet.

Each row becomes a prompt with the problem's text (its `<image>` placeholders kept where the diagram goes) and an
instruction to reason and put the final answer in \\boxed{}; the images column is copied unchanged (verl's
{"bytes", "path"} items), the answer is the ground truth of the `hiyouga/geometry3k` reward (rewards/geo3k.py).
A row that cannot be trained on stops the conversion with one line naming the file, the row and the column.
"""
from __future__ import annotations

import os
import re

import pyarrow as pa
import pyarrow.parquet as pq

from spmdrl.data import images, schema
from spmdrl.data.io import SUPPORTED_SUFFIXES, read_table
from spmdrl.errors import DataError

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = ("Reason step by step inside <think> </think> first, then give the final answer in \\boxed{}.")
SPLITS = ("train", "validation", "test")
COLUMNS = ("problem", "answer", "images")
_IMAGE_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
_EXTRA_INFO_TYPE = pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()),
                              ("question", pa.string())])


def _split_of(name: str) -> str | None:
    m = re.match(r"(train|validation|val|test)(?![a-z])", os.path.basename(name).lower())
    if m is None:
        return None
    return "validation" if m.group(1) == "val" else m.group(1)


def _split_files(input_path: str) -> dict[str, list[str]]:
    """{split: files}: one file (its split from its name, else "train"), or the train*/validation*/test* files of a
    directory or of its data/ folder (the hub's layout)."""
    if os.path.isfile(input_path):
        return {_split_of(input_path) or "train": [input_path]}
    if not os.path.isdir(input_path):
        raise DataError(f"file {input_path}: not found; pass a Geometry3K parquet file or a directory of them")
    for d in (input_path, os.path.join(input_path, "data")):
        found: dict[str, list[str]] = {}
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            split = _split_of(name)
            if split and name.lower().endswith(SUPPORTED_SUFFIXES) and os.path.isfile(os.path.join(d, name)):
                found.setdefault(split, []).append(os.path.join(d, name))
        if found:
            return found
    raise DataError(f"file {input_path}: no train/validation/test files (.parquet/.jsonl named train*, validation*, "
                    "test*) in it or in its data/ folder; pass a file or a directory holding them")


def _rows(path: str, split: str, start_index: int) -> list[dict]:
    table = read_table(path)
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"file {path}: missing column {missing[0]!r} (a geometry-QA file needs "
                        f"{', '.join(COLUMNS)}; found {', '.join(table.column_names) or 'no columns'})")
    for name in ("problem", "answer"):
        if not schema.is_string_type(table.column(name).type):
            raise schema.wrong_type_error(path, table.column(name), name, "string")
    base = os.path.dirname(os.path.abspath(path))
    out = []
    cols = [table.column(c).to_pylist() for c in COLUMNS]
    for i, (problem, answer, items) in enumerate(zip(*cols)):
        if not problem or not problem.strip():
            raise schema.row_error(path, i, "problem", "is empty or null; remove the row or fill it in")
        if answer is None or not str(answer).strip():
            raise schema.row_error(path, i, "answer", "is empty or null; remove the row or fill it in")
        items = list(items or [])
        if not items:
            raise schema.row_error(path, i, "images", "has no image; a geometry problem comes with its diagram")
        text = problem if images.PLACEHOLDER in problem else images.PLACEHOLDER * len(items) + problem
        images.row_images(path, i, "images", items, text.count(images.PLACEHOLDER), base)  # decodes, or names the row
        out.append({
            schema.DATA_SOURCE: DATA_SOURCE,
            schema.PROMPT: [{"role": "user", "content": f"{text} {INSTRUCTION}"}],
            schema.ABILITY: "math",
            schema.REWARD_MODEL: {"style": "rule", schema.GROUND_TRUTH: str(answer).strip()},
            schema.EXTRA_INFO: {"split": split, "index": start_index + i, "answer": str(answer), "question": problem},
            "images": [_item(x, base) for x in items],
        })
    return out


def _item(x, base: str) -> dict:
    """verl's image item: the encoded file's bytes (a path is read, so the output does not depend on the input's
    folder)."""
    if isinstance(x, dict) and x.get("bytes") is not None:
        return {"bytes": bytes(x["bytes"]), "path": x.get("path")}
    path = x.get("path") if isinstance(x, dict) else x
    if isinstance(path, (bytes, bytearray, memoryview)):
        return {"bytes": bytes(path), "path": None}
    full = path if os.path.isabs(path) else os.path.join(base, path)
    with open(full, "rb") as f:
        return {"bytes": f.read(), "path": path}


def convert_geo3k(input_path: str, out_dir: str) -> dict[str, str]:
    """Write `{split}.parquet` (verl's multimodal schema) for every split found; returns {split: path}. A problem
    without an `<image>` placeholder gets one per image in front of its text (Geometry3K's own rows have one)."""
    by_split = _split_files(os.fspath(input_path))
    os.makedirs(out_dir, exist_ok=True)
    fields = [(schema.DATA_SOURCE, pa.string()), (schema.PROMPT, pa.list_(schema.MESSAGE_TYPE)),
              (schema.ABILITY, pa.string()), (schema.REWARD_MODEL, schema.REWARD_MODEL_TYPE),
              (schema.EXTRA_INFO, _EXTRA_INFO_TYPE), ("images", _IMAGE_TYPE)]
    written = {}
    for split, paths in by_split.items():
        rows: list[dict] = []
        for path in paths:
            rows.extend(_rows(path, split, len(rows)))
        written[split] = os.path.join(out_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema(fields)), written[split])
    return written
