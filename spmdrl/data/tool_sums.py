"""A synthetic task the tiny model solves only with a tool: "1234567+89012+345678=" -> "1669257".

The operands (2-3 of them, 5-7 digits each by default) are too long for the tiny model to add digit by digit;
with the calculator it only has to copy: the numbers into a call, the tool's result into its answer. The
demonstrations for the SFT warm start are whole conversations in the Hermes call format:

    user       1234567+89012+345678=
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "1234567+89012+345678"}}</tool_call>
    tool       1669257
    assistant  1669257

Problems are drawn without replacement by a seeded RNG; the first n_val form the validation split and the rest
train (and the SFT rows), so the splits are disjoint and every file is a function of the arguments.
"""
from __future__ import annotations

import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

from spmdrl.data import schema
from spmdrl.errors import ConfigError

DATA_SOURCE = "synthetic/tool_sum"
TOOL = "calculator"
_TOOLS_KWARGS_TYPE = pa.struct([(TOOL, pa.struct([("create_kwargs", pa.struct([("ground_truth", pa.string())]))]))])
_EXTRA_INFO_TYPE = pa.struct([
    ("split", pa.string()), ("index", pa.int64()), ("terms", pa.list_(pa.int64())), ("tools", pa.list_(pa.string())),
    ("tools_kwargs", _TOOLS_KWARGS_TYPE),
])
SFT_SCHEMA = pa.schema([("messages", pa.list_(schema.MESSAGE_TYPE)), ("tools", pa.string())])


def calculator():
    """The built-in calculator tool: its schema goes to the chat template, its output is the demonstrations' tool
    turn (so they show exactly what the rollout's tool returns)."""
    from spmdrl.tools.builtin import calculator_tool

    return calculator_tool()


def problems(n: int, *, seed: int, terms: tuple[int, int] = (2, 3), digits: tuple[int, int] = (5, 7)
             ) -> list[tuple[int, ...]]:
    """`n` distinct tuples of operands: a count in [terms], each operand with a digit count in [digits] (uniform,
    no leading zero). Prefix-stable: the first k problems do not depend on n."""
    (t_lo, t_hi), (d_lo, d_hi) = terms, digits
    if not 2 <= t_lo <= t_hi:
        raise ConfigError(f"terms={t_lo}..{t_hi}: need 2 <= min_terms <= max_terms")
    if not 1 <= d_lo <= d_hi:
        raise ConfigError(f"digits={d_lo}..{d_hi}: need 1 <= min_digits <= max_digits")
    per_term = 10 ** d_hi - (10 ** (d_lo - 1) if d_lo > 1 else 0)
    space = sum(per_term ** t for t in range(t_lo, t_hi + 1))
    if n > space // 2:
        raise ConfigError(f"{n} distinct problems requested from about {space} possible; lower n_train/n_val "
                          "or allow more terms/digits")
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        k = rng.randint(t_lo, t_hi)
        nums = []
        for _ in range(k):
            d = rng.randint(d_lo, d_hi)
            nums.append(rng.randrange(10 ** (d - 1) if d > 1 else 0, 10 ** d))
        key = tuple(nums)
        if key in seen:
            continue
        seen.add(key)
        out.append(key)
    return out


def question(terms: tuple[int, ...]) -> str:
    return "+".join(str(t) for t in terms) + "="


def answer(terms: tuple[int, ...]) -> str:
    return str(sum(terms))


def tool_call_text(terms: tuple[int, ...]) -> str:
    """The assistant's call, in the Hermes format the rollout parses."""
    call = {"name": TOOL, "arguments": {"expression": "+".join(str(t) for t in terms)}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def conversation(terms: tuple[int, ...], tool=None) -> list[dict]:
    """One demonstration: user question, assistant call, the calculator's result, assistant answer."""
    tool = tool or calculator()
    result = tool.fn(expression="+".join(str(t) for t in terms))
    return [
        {"role": "user", "content": question(terms)},
        {"role": "assistant", "content": tool_call_text(terms)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": answer(terms)},
    ]


def _row(terms: tuple[int, ...], split: str, index: int) -> dict:
    truth = answer(terms)
    return {
        schema.DATA_SOURCE: DATA_SOURCE,
        schema.PROMPT: [{"role": "user", "content": question(terms)}],
        schema.ABILITY: "arith",
        schema.REWARD_MODEL: {"style": "rule", schema.GROUND_TRUTH: truth},
        # verl's per-sample tool fields: the tools this row uses, and tools_kwargs keyed by tool name
        schema.EXTRA_INFO: {"split": split, "index": index, "terms": list(terms), "tools": [TOOL],
                            "tools_kwargs": {TOOL: {"create_kwargs": {"ground_truth": truth}}}},
    }


def make_tool_sums(
    out_dir: str, *, n_train: int = 4096, n_val: int = 256, n_sft: int | None = None, seed: int = 0,
    terms: tuple[int, int] = (2, 3), digits: tuple[int, int] = (5, 7),
) -> dict[str, str]:
    """Write train.parquet and val.parquet (verl schema) and sft.parquet (a `messages` conversation and the
    `tools` schemas as a JSON string per row, from the train side of the split). Returns {name: path}."""
    n_sft = n_train if n_sft is None else n_sft
    every = problems(n_val + max(n_train, n_sft), seed=seed, terms=terms, digits=digits)
    val, rest = every[:n_val], every[n_val:]
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    for split, part in (("train", rest[:n_train]), ("val", val)):
        written[split] = schema.write_verl_parquet(
            [_row(t, split, i) for i, t in enumerate(part)], os.path.join(out_dir, f"{split}.parquet"),
            extra_info_type=_EXTRA_INFO_TYPE,
        )
    tool = calculator()
    tools = json.dumps([tool.schema()])
    table = pa.Table.from_pylist([{"messages": conversation(t, tool), "tools": tools} for t in rest[:n_sft]],
                                 schema=SFT_SCHEMA)
    written["sft"] = os.path.join(out_dir, "sft.parquet")
    pq.write_table(table, written["sft"])
    return written
