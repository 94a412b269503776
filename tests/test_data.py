"""spmdrl.data: verl-schema prompt files, SFT files, converters. Real files written with pyarrow."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spmdrl.data import PromptDataset, SFTDataset, left_pad, validate_table
from spmdrl.data.gsm8k import convert_gsm8k
from spmdrl.data.prompts import truncate
from spmdrl.data.synthetic import make_arith, make_sft_parquet
from spmdrl.errors import ConfigError, DataError
from spmdrl.rewards import default_compute_score
from spmdrl.tiny import build_tokenizer

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def verl_row(content="1+2=", gt="3", source="synthetic/arith", **extra_info):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "arith",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"index": 0, **extra_info},
    }


def write(path, rows_or_table):
    table = rows_or_table if isinstance(rows_or_table, pa.Table) else pa.Table.from_pylist(rows_or_table)
    pq.write_table(table, path)
    return str(path)


def one_line(err, *needles):
    msg = str(err.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, (n, msg)
    return msg


def chat_ids(tok, content):
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


# ----- PromptDataset: happy paths -----

def test_prompt_dataset_tokenizes_and_batches(tmp_path, tok):
    path = write(tmp_path / "a.parquet", [verl_row("1+2=", "3", a=1), verl_row("10+20=", "30", a=10)])
    ds = PromptDataset(path, tok, max_prompt_length=64)
    assert len(ds) == 2
    assert ds.prompt_ids(1) == chat_ids(tok, "10+20=")
    assert ds._tokens.dtype == np.int32
    b = ds.batch([1, 0])
    assert b.input_ids == [chat_ids(tok, "10+20="), chat_ids(tok, "1+2=")]
    assert b.data_source == ["synthetic/arith"] * 2
    assert b.ground_truth == ["30", "3"]
    assert b.extra_info == [{"index": 0, "a": 10}, {"index": 0, "a": 1}]
    assert b.raw_prompt[0] == [{"role": "user", "content": "10+20="}]
    assert b.index == [1, 0] and len(b) == 2


def test_multiple_files_jsonl_and_json_array(tmp_path, tok):
    p1 = write(tmp_path / "a.parquet", [verl_row("1+1=", "2")])
    p2 = tmp_path / "b.jsonl"
    p2.write_text("\n".join(json.dumps(verl_row(c, g)) for c, g in [("2+2=", "4"), ("3+3=", "6")]) + "\n")
    p3 = tmp_path / "c.json"
    p3.write_text(json.dumps([verl_row("4+4=", "8")]))
    ds = PromptDataset([p1, str(p2), str(p3)], tok, max_prompt_length=64)
    assert len(ds) == 4
    b = ds.batch([3, 0, 2, 1])
    assert b.ground_truth == ["8", "2", "6", "4"]
    assert b.input_ids[0] == chat_ids(tok, "4+4=")
    assert ds.source(2) == (str(p2), 1)


def test_string_prompt_numeric_ground_truth_no_extra_info(tmp_path, tok):
    table = pa.table({
        "data_source": ["synthetic/arith"],
        "prompt": ["5+5="],
        "reward_model": [{"style": "rule", "ground_truth": 10}],
    })
    path = write(tmp_path / "s.parquet", table)
    ds = PromptDataset(path, tok, max_prompt_length=64)
    b = ds.batch([0])
    assert b.input_ids[0] == chat_ids(tok, "5+5=")
    assert b.ground_truth == ["10"] and b.extra_info == [{}]
    assert b.raw_prompt == [[{"role": "user", "content": "5+5="}]]
    raw = PromptDataset(path, tok, max_prompt_length=64, apply_chat_template=False)
    assert raw.prompt_ids(0) == tok("5+5=")["input_ids"]


def test_custom_prompt_key(tmp_path, tok):
    row = verl_row("7+1=", "8")
    row["question"] = row.pop("prompt")
    path = write(tmp_path / "k.parquet", [row])
    ds = PromptDataset(path, tok, max_prompt_length=64, prompt_key="question")
    assert ds.prompt_ids(0) == chat_ids(tok, "7+1=")


# ----- truncation / filtering -----

@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(tmp_path, tok, mode):
    long_text = "abcdefghijklmnopqrstuvwxyz" * 3
    path = write(tmp_path / "t.parquet", [verl_row("1+2="), verl_row(long_text), verl_row("3+4=")])
    frame = chat_ids(tok, "")  # the template alone: its start and its generation prompt
    limit = 40
    room = limit - len(frame)  # characters of content that fit (a character tokenizer)
    ds = PromptDataset(path, tok, max_prompt_length=limit, truncation=mode)
    got = ds.prompt_ids(1)
    kept = {
        "left": long_text[-room:],
        "right": long_text[:room],
        "middle": long_text[:room // 2] + long_text[-(room - room // 2):],
    }[mode]
    # the content is cut, the template's ends stay (right truncation once cut off `<|im_start|>assistant`)
    assert got == chat_ids(tok, kept) and len(got) == limit
    tail = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    tail = tail[tail.index("x") + 1:]
    assert tok.decode(got).endswith(tail), tok.decode(got)
    assert ds.prompt_ids(0) == chat_ids(tok, "1+2=") and ds.prompt_ids(2) == chat_ids(tok, "3+4=")
    assert ds.num_truncated == 1


def test_truncate_helper():
    ids = np.arange(10)
    assert truncate(ids, 4, "left").tolist() == [6, 7, 8, 9]
    assert truncate(ids, 4, "right").tolist() == [0, 1, 2, 3]
    assert truncate(ids, 5, "middle").tolist() == [0, 1, 7, 8, 9]
    assert truncate(ids, 20, "left").tolist() == ids.tolist()


def test_overlong_error(tmp_path, tok):
    path = write(tmp_path / "o.parquet", [verl_row("1+2="), verl_row("x" * 100), verl_row("y" * 100)])
    n = len(chat_ids(tok, "x" * 100))
    with pytest.raises(DataError) as e:
        PromptDataset(path, tok, max_prompt_length=30)
    msg = one_line(e, path, "row 1", "'prompt'", n, "30", "data.truncation", "data.filter_overlong")
    assert "1 more" in msg


def test_filter_overlong(tmp_path, tok):
    path = write(tmp_path / "f.parquet", [verl_row("x" * 100, "0"), verl_row("1+2=", "3"), verl_row("y" * 100, "1")])
    ds = PromptDataset(path, tok, max_prompt_length=30, filter_overlong=True)
    assert len(ds) == 1 and ds.num_filtered == 2
    assert ds.batch([0]).ground_truth == ["3"] and ds.source(0) == (path, 1)
    with pytest.raises(DataError) as e:
        PromptDataset(path, tok, max_prompt_length=5, filter_overlong=True)
    one_line(e, path, "no prompts left")


def test_bad_config(tmp_path, tok):
    path = write(tmp_path / "a.parquet", [verl_row()])
    with pytest.raises(ConfigError):
        PromptDataset(path, tok, max_prompt_length=10, truncation="sideways")
    with pytest.raises(ConfigError):
        PromptDataset(path, tok, max_prompt_length=0)


# ----- bad inputs: one-line errors naming file, row, column -----

def test_missing_file(tmp_path, tok):
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(DataError) as e:
        PromptDataset(missing, tok, max_prompt_length=10)
    one_line(e, missing, "not found")


def test_unsupported_suffix(tmp_path, tok):
    p = tmp_path / "a.csv"
    p.write_text("a,b\n")
    with pytest.raises(DataError) as e:
        PromptDataset(str(p), tok, max_prompt_length=10)
    one_line(e, p, ".csv")


@pytest.mark.parametrize("column", ["data_source", "prompt", "reward_model"])
def test_missing_column(tmp_path, tok, column):
    rows = [verl_row()]
    del rows[0][column]
    path = write(tmp_path / "m.parquet", rows)
    with pytest.raises(DataError) as e:
        PromptDataset(path, tok, max_prompt_length=10)
    one_line(e, path, f"missing column '{column}'", "verl schema needs data_source, prompt, reward_model")


def test_wrong_types(tmp_path, tok):
    base = verl_row()
    cases = {
        "prompt": pa.table({"data_source": ["x"], "prompt": [5], "reward_model": [base["reward_model"]]}),
        "data_source": pa.table({
            "data_source": [1], "prompt": [base["prompt"]], "reward_model": [base["reward_model"]]}),
        "reward_model": pa.table({"data_source": ["x"], "prompt": [base["prompt"]], "reward_model": ["3"]}),
        "reward_model.ground_truth": pa.table({
            "data_source": ["x"], "prompt": [base["prompt"]], "reward_model": [{"ground_truth": [1, 2]}]}),
        "extra_info": pa.table({
            "data_source": ["x"], "prompt": [base["prompt"]], "reward_model": [base["reward_model"]],
            "extra_info": [3]}),
        "prompt ": pa.table({  # messages without 'content'
            "data_source": ["x"], "prompt": [[{"role": "user", "text": "hi"}]],
            "reward_model": [base["reward_model"]]}),
    }
    for column, table in cases.items():
        path = write(tmp_path / f"w{len(column)}.parquet", table)
        with pytest.raises(DataError) as e:
            PromptDataset(path, tok, max_prompt_length=10)
        one_line(e, path, "row 0", f"column '{column.strip()}'", "expected")


@pytest.mark.parametrize("prompt", [[], [{"role": "user", "content": "  "}, {"role": "system", "content": ""}], None])
def test_empty_prompt(tmp_path, tok, prompt):
    bad = verl_row()
    bad["prompt"] = prompt
    path = write(tmp_path / "e.parquet", pa.Table.from_pylist(
        [verl_row(), verl_row(), bad],
        schema=pa.schema([("data_source", pa.string()),
                          ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                          ("ability", pa.string()),
                          ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
                          ("extra_info", pa.struct([("index", pa.int64())]))])))
    with pytest.raises(DataError) as e:
        PromptDataset(path, tok, max_prompt_length=64)
    one_line(e, path, "row 2", "column 'prompt'", "empty")


def test_empty_string_prompt(tmp_path, tok):
    table = pa.table({"data_source": ["x", "x"], "prompt": ["1+1=", " "],
                      "reward_model": [{"ground_truth": "2"}, {"ground_truth": "2"}]})
    path = write(tmp_path / "es.parquet", table)
    with pytest.raises(DataError) as e:
        PromptDataset(path, tok, max_prompt_length=64)
    one_line(e, path, "row 1", "column 'prompt'", "empty")


def test_null_values(tmp_path, tok):
    rows = [verl_row(), verl_row()]
    rows[1]["data_source"] = None
    path = write(tmp_path / "n1.parquet", rows)
    with pytest.raises(DataError) as e:
        PromptDataset(path, tok, max_prompt_length=64)
    one_line(e, path, "row 1", "column 'data_source'", "null")

    rows = [verl_row(), verl_row(), verl_row()]
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = write(tmp_path / "n2.parquet", rows)
    with pytest.raises(DataError) as e:
        PromptDataset(path, tok, max_prompt_length=64)
    one_line(e, path, "row 2", "column 'reward_model.ground_truth'", "null")


def test_chat_template_rejection_names_row(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    rows = [verl_row(), verl_row()]
    rows[1]["prompt"] = [{"role": "tool", "content": "x"}]
    path = write(tmp_path / "c.parquet", rows)
    with pytest.raises(DataError) as e:
        PromptDataset(path, tok, max_prompt_length=64)
    one_line(e, path, "row 1", "column 'prompt'", "no tool turns")


def test_validate_table_direct():
    table = pa.Table.from_pylist([verl_row()])
    validate_table(table, "mem.parquet")
    with pytest.raises(DataError) as e:
        validate_table(table.drop_columns(["prompt"]), "mem.parquet")
    one_line(e, "mem.parquet", "missing column 'prompt'")


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == torch.long


# ----- SFT -----

def test_sft_dataset_loss_mask(tmp_path, tok):
    table = pa.table({"prompt": [[{"role": "user", "content": "1+2="}], None], "response": ["3", "12"]})
    table = table.set_column(0, "prompt", pa.array(["1+2=", "5+7="]))  # str prompts are accepted too
    path = write(tmp_path / "sft.parquet", table)
    ds = SFTDataset(path, tok, max_length=64)
    item = ds[1]
    p = chat_ids(tok, "5+7=")
    assert item["input_ids"] == p + tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert item["loss_mask"] == [0] * len(p) + [1, 1, 1]
    b = ds.batch([0, 1])
    assert b.input_ids.shape == b.loss_mask.shape == b.attention_mask.shape
    assert b.loss_mask[0].sum() == 2 and b.attention_mask[0].sum() == len(ds[0]["input_ids"])


def test_sft_errors(tmp_path, tok):
    path = write(tmp_path / "s1.parquet", pa.table({"prompt": ["a"], "answer": ["b"]}))
    with pytest.raises(DataError) as e:
        SFTDataset(path, tok, max_length=64)
    one_line(e, path, "missing column 'response'")

    path = write(tmp_path / "s2.parquet", pa.table({"prompt": ["a", "b"], "response": ["x", None]}))
    with pytest.raises(DataError) as e:
        SFTDataset(path, tok, max_length=64)
    one_line(e, path, "row 1", "column 'response'", "null")

    path = write(tmp_path / "s3.parquet", pa.table({"prompt": ["a", "b"], "response": ["x", "y" * 100]}))
    with pytest.raises(DataError) as e:
        SFTDataset(path, tok, max_length=40)
    one_line(e, path, "row 1", "column 'response'", "max_length=40")
    assert len(SFTDataset(path, tok, max_length=40, truncation="right")[1]["input_ids"]) == 40

    path = write(tmp_path / "s4.parquet", pa.table({"prompt": ["a", ""], "response": ["x", "y"]}))
    with pytest.raises(DataError) as e:
        SFTDataset(path, tok, max_length=40)
    one_line(e, path, "row 1", "column 'prompt'", "empty")


# ----- GSM8K converter -----

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A car costs 1,200 dollars twice. Total?", "answer": "2*1200=2400\n#### 2,400"},
]


def test_gsm8k_round_trip(tmp_path, tok):
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in GSM8K_ROWS) + "\n")
    out = convert_gsm8k(str(src), str(tmp_path / "out"))
    assert list(out) == ["train"] and out["train"].endswith("train.parquet")
    table = pq.read_table(out["train"])
    validate_table(table, out["train"])
    rows = table.to_pylist()
    assert rows[1]["data_source"] == "openai/gsm8k" and rows[1]["ability"] == "math"
    assert rows[1]["reward_model"] == {"style": "rule", "ground_truth": "2400"}
    assert rows[0]["prompt"] == [{"role": "user", "content": GSM8K_ROWS[0]["question"] +
                                  " Let's think step by step and output the final answer after \"####\"."}]
    assert rows[1]["extra_info"] == {"split": "train", "index": 1, **GSM8K_ROWS[1]}
    ds = PromptDataset(out["train"], tok, max_prompt_length=256)
    b = ds.batch([0, 1])
    assert b.ground_truth == ["7", "2400"]
    assert default_compute_score(b.data_source[1], "so #### 2,400", b.ground_truth[1], b.extra_info[1]) == 1.0


def test_gsm8k_directory(tmp_path):
    d = tmp_path / "gsm8k" / "main"
    d.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), d / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS[:1]), d / "test-00000-of-00001.parquet")
    out = convert_gsm8k(str(tmp_path / "gsm8k"), str(tmp_path / "out"))
    assert sorted(out) == ["test", "train"]
    assert pq.read_table(out["test"]).num_rows == 1
    assert pq.read_table(out["test"]).column("extra_info").to_pylist()[0]["split"] == "test"


def test_gsm8k_bad_rows(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps(GSM8K_ROWS[0]) + "\n" + json.dumps({"question": "q", "answer": "no final"}) + "\n")
    with pytest.raises(DataError) as e:
        convert_gsm8k(str(src), str(tmp_path / "out"))
    one_line(e, src, "row 1", "column 'answer'", "####")

    src2 = tmp_path / "test.jsonl"
    src2.write_text(json.dumps({"q": "x", "answer": "#### 1"}) + "\n")
    with pytest.raises(DataError) as e:
        convert_gsm8k(str(src2), str(tmp_path / "out"))
    one_line(e, src2, "missing column 'question'")

    src3 = tmp_path / "val.jsonl"
    src3.write_text(json.dumps({"question": " ", "answer": "#### 1"}) + "\n")
    with pytest.raises(DataError) as e:
        convert_gsm8k(str(src3), str(tmp_path / "out"))
    one_line(e, src3, "row 0", "column 'question'")

    with pytest.raises(DataError) as e:
        convert_gsm8k(str(tmp_path / "missing.jsonl"), str(tmp_path / "out"))
    one_line(e, "missing.jsonl", "not found")


# ----- synthetic task -----

def test_arith_deterministic_and_disjoint(tmp_path, tok):
    a = make_arith(str(tmp_path / "a"), n_train=300, n_val=50, seed=3)
    b = make_arith(str(tmp_path / "b"), n_train=300, n_val=50, seed=3)
    c = make_arith(str(tmp_path / "c"), n_train=300, n_val=50, seed=4)
    ta, tb, tc = (pq.read_table(x["train"]) for x in (a, b, c))
    assert ta.equals(tb) and not ta.equals(tc)
    va = pq.read_table(a["val"])
    validate_table(ta, a["train"])
    prompts = lambda t: {r[0]["content"] for r in t.column("prompt").to_pylist()}  # noqa: E731
    assert len(prompts(ta)) == 300 and len(prompts(va)) == 50 and not prompts(ta) & prompts(va)
    row = ta.slice(0, 1).to_pylist()[0]
    info = row["extra_info"]
    assert row["prompt"][0]["content"] == f"{info['a']}+{info['b']}="
    assert row["reward_model"]["ground_truth"] == str(info["a"] + info["b"])
    assert row["data_source"] == "synthetic/arith"
    # The validation split does not depend on n_train.
    d = make_arith(str(tmp_path / "d"), n_train=10, n_val=50, seed=3)
    assert pq.read_table(d["val"]).equals(va)
    ds = PromptDataset(a["train"], tok, max_prompt_length=32)
    b0 = ds.batch([0])
    assert default_compute_score(b0.data_source[0], b0.ground_truth[0], b0.ground_truth[0], b0.extra_info[0]) == 1.0


def test_arith_ops_and_limits(tmp_path):
    out = make_arith(str(tmp_path), n_train=40, n_val=10, digits=1, ops="+-*", seed=1)
    for r in pq.read_table(out["train"]).to_pylist():
        a, b, op = r["extra_info"]["a"], r["extra_info"]["b"], r["extra_info"]["op"]
        assert int(r["reward_model"]["ground_truth"]) == {"+": a + b, "-": a - b, "*": a * b}[op]
    with pytest.raises(ConfigError):
        make_arith(str(tmp_path), n_train=100, n_val=10, digits=1)
    with pytest.raises(ConfigError):
        make_arith(str(tmp_path), n_train=1, n_val=1, ops="/")


def test_sft_parquet_matches_task(tmp_path, tok):
    out = make_arith(str(tmp_path), n_train=100, n_val=20, seed=0)
    sft = make_sft_parquet(str(tmp_path), n=50, n_val=20, seed=0)
    rows = pq.read_table(sft).to_pylist()
    val_prompts = {r[0]["content"] for r in pq.read_table(out["val"]).column("prompt").to_pylist()}
    assert not {r["prompt"][0]["content"] for r in rows} & val_prompts
    a, b = rows[0]["prompt"][0]["content"].rstrip("=").split("+")
    assert rows[0]["response"] == str(int(a) + int(b))
    ds = SFTDataset(sft, tok, max_length=32)
    assert len(ds) == 50 and sum(ds[0]["loss_mask"]) == len(rows[0]["response"]) + 1
