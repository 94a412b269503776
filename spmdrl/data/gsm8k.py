"""Convert the original GSM8K files (question, answer ending in "#### n") to verl-schema parquet.

    python -m spmdrl.data.gsm8k path/to/gsm8k out_dir
"""
from __future__ import annotations

import os
import re

import pyarrow as pa

from spmdrl.data import schema
from spmdrl.data.io import SUPPORTED_SUFFIXES, read_table
from spmdrl.errors import DataError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
SPLITS = ("train", "test")
_FINAL = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*$")
_EXTRA_INFO_TYPE = pa.struct([
    ("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string()),
])


def _split_of(path: str) -> str:
    stem = os.path.basename(path).split(".")[0]
    m = re.match(r"(train|test|validation|val)(?![a-z])", stem, re.IGNORECASE)
    return m.group(1).lower() if m else stem


def _find_split_files(directory: str) -> dict[str, list[str]]:
    """train*/test* data files in `directory` or, for the HF layout, `directory/main`."""
    for d in (directory, os.path.join(directory, "main")):
        if not os.path.isdir(d):
            continue
        found: dict[str, list[str]] = {}
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if os.path.isfile(path) and name.lower().endswith(SUPPORTED_SUFFIXES) and _split_of(name) in SPLITS:
                found.setdefault(_split_of(name), []).append(path)
        if found:
            return found
    raise DataError(
        f"file {directory}: no train/test GSM8K files (.parquet/.jsonl/.json named train*/test*) in it "
        "or in its main/ folder; pass a file or a directory holding them"
    )


def _convert_rows(path: str, split: str, start_index: int) -> list[dict]:
    table = read_table(path)
    for name in ("question", "answer"):
        if name not in table.column_names:
            raise DataError(
                f"file {path}: missing column {name!r} (GSM8K needs question, answer; found "
                f"{', '.join(table.column_names) or 'no columns'}); pass the original GSM8K files"
            )
        if not schema.is_string_type(table.column(name).type):
            raise schema.wrong_type_error(path, table.column(name), name, "string")
    rows = []
    questions, answers = table.column("question").to_pylist(), table.column("answer").to_pylist()
    for i, (q, a) in enumerate(zip(questions, answers)):
        if not q or not q.strip():
            raise schema.row_error(path, i, "question", "is empty or null; remove the row or fill it in")
        m = _FINAL.search(a or "")
        if m is None:
            shown = repr((a or "")[-40:])
            raise schema.row_error(
                path, i, "answer",
                f"does not end in '#### <number>' (ends {shown}); fix the row or remove it",
            )
        rows.append({
            schema.DATA_SOURCE: DATA_SOURCE,
            schema.PROMPT: [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
            schema.ABILITY: "math",
            schema.REWARD_MODEL: {"style": "rule", schema.GROUND_TRUTH: m.group(1).replace(",", "")},
            schema.EXTRA_INFO: {"split": split, "index": start_index + i, "answer": a, "question": q},
        })
    return rows


def convert_gsm8k(input_path: str, out_dir: str) -> dict[str, str]:
    """Write `{split}.parquet` for every split found; returns {split: written path}."""
    input_path = os.fspath(input_path)
    if os.path.isdir(input_path):
        by_split = _find_split_files(input_path)
    elif os.path.exists(input_path):
        by_split = {_split_of(input_path): [input_path]}
    else:
        raise DataError(f"file {input_path}: not found; pass a GSM8K file or a directory with train/test files")
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    for split, paths in by_split.items():
        rows: list[dict] = []
        for path in paths:
            rows.extend(_convert_rows(path, split, len(rows)))
        written[split] = schema.write_verl_parquet(
            rows, os.path.join(out_dir, f"{split}.parquet"), extra_info_type=_EXTRA_INFO_TYPE
        )
    return written


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input_path", help="a GSM8K .parquet/.jsonl file, or a directory with train/test files")
    parser.add_argument("out_dir")
    args = parser.parse_args()
    for split, path in convert_gsm8k(args.input_path, args.out_dir).items():
        print(f"{split}: {path}")
