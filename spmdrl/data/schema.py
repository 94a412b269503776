"""verl's prompt-data schema, so users can bring the parquet files they already have.

One row per prompt:
    data_source   str                          selects the reward function
    prompt        list<{role: str, content: str}>  chat messages (a plain str is also accepted)
    ability       str                          optional, informational ("math")
    reward_model  {style: str, ground_truth: str}  ground_truth goes to the reward function
    extra_info    struct / map                 optional, passed to the reward function as a dict
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spmdrl.errors import DataError

DATA_SOURCE = "data_source"
PROMPT = "prompt"
ABILITY = "ability"
REWARD_MODEL = "reward_model"
GROUND_TRUTH = "ground_truth"
EXTRA_INFO = "extra_info"
REQUIRED = (DATA_SOURCE, PROMPT, REWARD_MODEL)

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
REWARD_MODEL_TYPE = pa.struct([("style", pa.string()), (GROUND_TRUTH, pa.string())])


def row_error(path, row: int, column: str, what: str) -> DataError:
    """The one-line error every row-level data problem uses."""
    return DataError(f"file {path}: row {row}, column {column!r}: {what}")


def is_string_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)


def is_list_type(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def is_messages_type(t: pa.DataType) -> bool:
    """list<struct<role: str, content: str, ...>>; extra message fields (tool calls, names) are allowed."""
    if not is_list_type(t) or not pa.types.is_struct(t.value_type):
        return False
    fields = {t.value_type.field(i).name: t.value_type.field(i).type for i in range(t.value_type.num_fields)}
    return all(k in fields and (is_string_type(fields[k]) or pa.types.is_null(fields[k])) for k in ("role", "content"))


def _is_scalar_type(t: pa.DataType) -> bool:
    return is_string_type(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) \
        or pa.types.is_decimal(t)


def first_row(mask: np.ndarray) -> tuple[int, str]:
    """(first True row, ' (and N more rows)' or '')."""
    rows = np.flatnonzero(mask)
    more = f" (and {len(rows) - 1} more rows)" if len(rows) > 1 else ""
    return int(rows[0]), more


def wrong_type_error(path, col: pa.ChunkedArray, name: str, expected: str) -> DataError:
    valid = np.asarray(col.is_valid())
    row = int(np.flatnonzero(valid)[0]) if valid.any() else 0
    value = repr(col[row].as_py())
    value = value if len(value) <= 60 else value[:57] + "..."
    return row_error(
        path, row, name,
        f"has arrow type {col.type}, expected {expected} (value {value}); rewrite the column in the verl schema",
    )


def _null_mask(col: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(col.is_null(), dtype=bool)


def validate_table(table: pa.Table, path, *, prompt_key: str = PROMPT) -> None:
    """Check a table is in the verl schema: required columns, their types, no null/empty required values.

    Raises DataError naming the file, the first offending row and the column.
    """
    names = table.column_names
    required = (DATA_SOURCE, prompt_key, REWARD_MODEL)
    for name in required:
        if name not in names:
            hint = "set data.prompt_key or " if name == prompt_key else ""
            raise DataError(
                f"file {path}: missing column {name!r} (verl schema needs {', '.join(required)}; "
                f"found {', '.join(names) or 'no columns'}); {hint}convert the file to the verl schema"
            )

    ds = table.column(DATA_SOURCE)
    if not is_string_type(ds.type):
        raise wrong_type_error(path, ds, DATA_SOURCE, "string")
    if ds.null_count:
        row, more = first_row(_null_mask(ds))
        raise row_error(path, row, DATA_SOURCE, f"is null{more}; every row needs a data_source naming its reward")

    check_prompt_column(table, path, prompt_key)

    rm = table.column(REWARD_MODEL)
    if not pa.types.is_struct(rm.type) or rm.type.get_field_index(GROUND_TRUTH) < 0:
        raise wrong_type_error(path, rm, REWARD_MODEL, "struct {style: string, ground_truth: string}")
    gt = pc.struct_field(rm, GROUND_TRUTH)
    if not _is_scalar_type(gt.type) and not pa.types.is_null(gt.type):
        raise wrong_type_error(path, gt, f"{REWARD_MODEL}.{GROUND_TRUTH}", "a string (or number)")
    missing = _null_mask(rm) | _null_mask(gt)
    if missing.any():
        row, more = first_row(missing)
        raise row_error(
            path, row, f"{REWARD_MODEL}.{GROUND_TRUTH}",
            f"is null{more}; every row needs the ground truth its reward function checks against",
        )

    if ABILITY in names and not (is_string_type(table.column(ABILITY).type) or
                                 pa.types.is_null(table.column(ABILITY).type)):
        raise wrong_type_error(path, table.column(ABILITY), ABILITY, "string")
    if EXTRA_INFO in names:
        t = table.column(EXTRA_INFO).type
        if not (pa.types.is_struct(t) or pa.types.is_map(t) or pa.types.is_null(t)):
            raise wrong_type_error(path, table.column(EXTRA_INFO), EXTRA_INFO, "a struct (dict) or map")


def check_prompt_column(table: pa.Table, path, prompt_key: str) -> None:
    """A prompt is a non-empty list of {role, content} messages, or a non-empty string. Vectorised."""
    col = table.column(prompt_key)
    if is_string_type(col.type):
        text = col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col
        empty = _null_mask(col) | ~np.asarray(pc.fill_null(pc.utf8_length(pc.utf8_trim_whitespace(text)), 0)
                                             .to_numpy(zero_copy_only=False) > 0)
    elif is_messages_type(col.type):
        arr = col.combine_chunks()
        n_msgs = np.asarray(pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False))
        flat = pc.list_flatten(arr)
        content = pc.struct_field(flat, "content")
        if pa.types.is_null(content.type):
            nonempty = np.zeros(len(flat), dtype=np.int64)
        else:
            lengths = pc.utf8_length(pc.utf8_trim_whitespace(content))
            nonempty = np.asarray(pc.fill_null(lengths, 0).to_numpy(zero_copy_only=False)) > 0
        parents = np.asarray(pc.list_parent_indices(arr).to_numpy(zero_copy_only=False))
        filled = np.bincount(parents, weights=nonempty, minlength=len(arr)) if len(arr) else np.zeros(0)
        empty = _null_mask(col) | (n_msgs == 0) | (filled == 0)
        role = pc.struct_field(flat, "role")
        if role.null_count:
            bad = np.zeros(len(arr), dtype=bool)
            bad[parents[np.asarray(role.is_null(), dtype=bool)]] = True
            row, more = first_row(bad)
            raise row_error(path, row, prompt_key, f"a message has a null 'role'{more}; set role to user/system/...")
    else:
        raise wrong_type_error(path, col, prompt_key, "a list of {role, content} chat messages or a string")
    if empty.any():
        row, more = first_row(empty)
        raise row_error(
            path, row, prompt_key,
            f"prompt is empty (null, no messages, or all message contents empty){more}; remove or fill the row",
        )


def write_verl_parquet(rows: list[dict], path, extra_info_type: pa.DataType | None = None) -> str:
    """Write rows (dicts with the verl columns) to parquet with the canonical column types."""
    import pyarrow.parquet as pq

    fields = [
        (DATA_SOURCE, pa.string()),
        (PROMPT, pa.list_(MESSAGE_TYPE)),
        (ABILITY, pa.string()),
        (REWARD_MODEL, REWARD_MODEL_TYPE),
    ]
    if extra_info_type is not None:
        fields.append((EXTRA_INFO, extra_info_type))
    schema = pa.schema(fields)
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path)
    return str(path)
