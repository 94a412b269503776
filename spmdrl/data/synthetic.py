"""A synthetic verifiable task a tiny character-level model can learn: "12+34=" -> "46".

Problems are drawn without replacement from the space (op, a, b) by a seeded RNG; the first n_val form
the validation split, the rest train, so the splits are disjoint and the files are a function of the seed.
"""
from __future__ import annotations

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

from spmdrl.data import schema
from spmdrl.errors import ConfigError

DATA_SOURCE = "synthetic/arith"
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_EXTRA_INFO_TYPE = pa.struct([
    ("split", pa.string()), ("index", pa.int64()), ("a", pa.int64()), ("b", pa.int64()), ("op", pa.string()),
])


def _problems(n: int, *, seed: int, digits: int, ops: str) -> list[tuple[str, int, int]]:
    if digits < 1:
        raise ConfigError(f"digits={digits} must be at least 1")
    bad = [o for o in ops if o not in _OPS]
    if not ops or bad:
        raise ConfigError(f"ops={ops!r}: each op must be one of {''.join(_OPS)}")
    ops = "".join(dict.fromkeys(ops))
    base = 10**digits
    space = len(ops) * base * base
    if n > space:
        raise ConfigError(
            f"{n} distinct problems requested but only {space} exist with digits={digits}, ops={ops!r}; "
            "lower n_train/n_val or raise digits"
        )
    # Rejection sampling keeps the stream prefix-stable: the first n_val problems do not depend on n_train.
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        k = rng.randrange(space)
        if k in seen:
            continue
        seen.add(k)
        op, rest = divmod(k, base * base)
        a, b = divmod(rest, base)
        out.append((ops[op], a, b))
    return out


def _row(op: str, a: int, b: int, split: str, index: int) -> dict:
    return {
        schema.DATA_SOURCE: DATA_SOURCE,
        schema.PROMPT: [{"role": "user", "content": f"{a}{op}{b}="}],
        schema.ABILITY: "arith",
        schema.REWARD_MODEL: {"style": "rule", schema.GROUND_TRUTH: str(_OPS[op](a, b))},
        schema.EXTRA_INFO: {"split": split, "index": index, "a": a, "b": b, "op": op},
    }


def make_arith(
    out_dir: str, *, n_train: int = 4096, n_val: int = 256, seed: int = 0, digits: int = 2, ops: str = "+",
) -> dict[str, str]:
    """Write train.parquet and val.parquet (verl schema); returns {"train": path, "val": path}."""
    problems = _problems(n_val + n_train, seed=seed, digits=digits, ops=ops)
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    for split, part in (("val", problems[:n_val]), ("train", problems[n_val:])):
        rows = [_row(op, a, b, split, i) for i, (op, a, b) in enumerate(part)]
        written[split] = schema.write_verl_parquet(
            rows, os.path.join(out_dir, f"{split}.parquet"), extra_info_type=_EXTRA_INFO_TYPE
        )
    return {"train": written["train"], "val": written["val"]}


def make_sft_parquet(
    out_dir: str, *, n: int = 2048, n_val: int = 256, seed: int = 0, digits: int = 2, ops: str = "+",
    filename: str = "sft.parquet",
) -> str:
    """Write prompt/response rows for the SFT warm start; response is just the answer ("46").

    With the same seed/n_val/digits/ops as make_arith, the rows come from the train side of the split,
    so they never overlap the validation set.
    """
    problems = _problems(n_val + n, seed=seed, digits=digits, ops=ops)[n_val:]
    table = pa.Table.from_pylist(
        [{"prompt": [{"role": "user", "content": f"{a}{op}{b}="}], "response": str(_OPS[op](a, b))}
         for op, a, b in problems],
        schema=pa.schema([("prompt", pa.list_(schema.MESSAGE_TYPE)), ("response", pa.string())]),
    )
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, filename)
    pq.write_table(table, path)
    return path
