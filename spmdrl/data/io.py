"""Reading dataset files into arrow tables: parquet, JSON lines, or a JSON array."""
from __future__ import annotations

import json
import os

import pyarrow as pa

from spmdrl.errors import DataError

SUPPORTED_SUFFIXES = (".parquet", ".jsonl", ".json")


def as_file_list(files: str | os.PathLike | list | tuple) -> list[str]:
    """One path or a list of paths -> a non-empty list of str paths."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [os.fspath(f) for f in files]
    if not paths:
        raise DataError("no data files given; set data.train_files / data.val_files to one or more paths")
    return paths


def count_rows(paths: list[str]) -> int:
    """Rows in the data files (a parquet file's from its footer, without reading the columns)."""
    total = 0
    for path in paths:
        if path.lower().endswith(".parquet") and os.path.isfile(path):
            import pyarrow.parquet as pq

            try:
                total += pq.ParquetFile(path).metadata.num_rows
                continue
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"file {path}: cannot be read as parquet ({_one_line(e)}); check the file") from e
        total += read_table(path).num_rows
    return total


def read_table(path: str) -> pa.Table:
    """Read one data file. The table stays columnar: nothing is converted to Python objects here."""
    if not os.path.exists(path):
        raise DataError(f"file {path}: not found; check the data file paths in the config")
    if os.path.isdir(path):
        raise DataError(f"file {path}: is a directory; list the .parquet/.jsonl files inside it instead")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataError(
            f"file {path}: unsupported file type {suffix or '(none)'!r}; use {', '.join(SUPPORTED_SUFFIXES)}"
        )
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        return _read_json(path)
    except DataError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"file {path}: cannot be read as {suffix[1:]} ({_one_line(e)}); check the file") from e


def check_utf8(path: str, chunk_bytes: int = 64 << 20) -> None:
    """A DataError naming the row (line) and byte of the first invalid UTF-8 in text file `path`: pyarrow reads
    such bytes into string columns unchecked, and they fail much later, far from the file."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = line = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                pos = max(e.start, 0)  # within this chunk (a sequence split across chunks ends up in the next)
                row = line + chunk.count(b"\n", 0, pos) + 1
                raise DataError(f"file {path}: row {row} (byte {offset + pos}) is not valid UTF-8 ({e.reason}: "
                                f"{chunk[e.start:e.end]!r}); fix or re-encode the file as UTF-8") from None
            if not chunk:
                return
            offset += len(chunk)
            line += chunk.count(b"\n")


def _read_json(path: str) -> pa.Table:
    import pyarrow.json as pj

    check_utf8(path)
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):
        # A JSON array (pandas/HF `to_json(orient="records")`); pyarrow only reads JSON lines.
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
        if not all(isinstance(r, dict) for r in rows):
            raise DataError(f"file {path}: a JSON array file must hold one object per row")
        return pa.Table.from_pylist(rows)
    return pj.read_json(path)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]
