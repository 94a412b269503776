"""The calculator task: its data generator, its reward, SFT on whole conversations (the loss mask on assistant
turns), and the tool quickstart configs."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from spmdrl.cli import app
from spmdrl.config import load_config
from spmdrl.config.validate import validate
from spmdrl.data import PromptDataset, SFTDataset, validate_table
from spmdrl.data.tool_sums import make_tool_sums, problems
from spmdrl.errors import ConfigError, DataError
from spmdrl.rewards import default_compute_score
from spmdrl.rewards.tool_sum import last_assistant_turn, tool_sum_reward
from spmdrl.sft import SFTConfig, validate_sft
from spmdrl.tiny import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def one_line(err, *needles):
    msg = str(err.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, (n, msg)
    return msg


def rows(path):
    return pq.read_table(path).to_pylist()


# ----- the data generator -----

def test_tool_sums_deterministic_disjoint_and_correct(tmp_path, tok):
    a = make_tool_sums(str(tmp_path / "a"), n_train=300, n_val=50, n_sft=200, seed=3)
    b = make_tool_sums(str(tmp_path / "b"), n_train=300, n_val=50, n_sft=200, seed=3)
    for name in ("train", "val", "sft"):
        assert rows(a[name]) == rows(b[name]), name
    c = make_tool_sums(str(tmp_path / "c"), n_train=100, n_val=50, seed=4)
    assert rows(c["val"]) != rows(a["val"])
    # the validation split does not depend on n_train
    d = make_tool_sums(str(tmp_path / "d"), n_train=10, n_val=50, seed=3)
    assert rows(d["val"]) == rows(a["val"])

    train, val, sft = rows(a["train"]), rows(a["val"]), rows(a["sft"])
    assert (len(train), len(val), len(sft)) == (300, 50, 200)
    q = [r["prompt"][0]["content"] for r in train], [r["prompt"][0]["content"] for r in val]
    sft_q = [r["messages"][0]["content"] for r in sft]
    assert len(set(q[0])) == 300 and len(set(q[1])) == 50
    assert not set(q[0]) & set(q[1]) and not set(sft_q) & set(q[1]) and set(sft_q) <= set(q[0])
    for r in train + val:
        text = r["prompt"][0]["content"]
        assert text.endswith("=")
        terms = [int(t) for t in text[:-1].split("+")]
        assert 2 <= len(terms) <= 3 and all(5 <= len(str(t)) <= 7 for t in terms)
        assert r["reward_model"]["ground_truth"] == str(sum(terms))  # the answer, from the question's own text
        info = r["extra_info"]
        assert info["terms"] == terms and info["tools"] == ["calculator"]
        assert "calculator" in info["tools_kwargs"]
    assert {r["extra_info"]["split"] for r in val} == {"val"}
    assert len({len(r["extra_info"]["terms"]) for r in train}) == 2  # both 2 and 3 terms occur
    validate_table(pq.read_table(a["train"]), a["train"])
    assert len(PromptDataset(a["val"], tok, max_prompt_length=72)) == 50

    for r in sft:  # the demonstration: question, a call whose expression is the question, its result, the answer
        user, call, result, answer = r["messages"]
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "tool", "assistant"]
        body = call["content"]
        assert body.startswith("<tool_call>") and body.endswith("</tool_call>")
        parsed = json.loads(body[len("<tool_call>"):-len("</tool_call>")])
        assert parsed["name"] == "calculator" and parsed["arguments"]["expression"] + "=" == user["content"]
        total = sum(int(t) for t in user["content"][:-1].split("+"))
        assert result["content"] == answer["content"] == str(total)
        assert [t["function"]["name"] for t in json.loads(r["tools"])] == ["calculator"]


def test_tool_sums_limits():
    with pytest.raises(ConfigError, match="min_terms"):
        problems(5, seed=0, terms=(1, 2))
    with pytest.raises(ConfigError, match="min_digits"):
        problems(5, seed=0, digits=(3, 2))
    with pytest.raises(ConfigError, match="distinct problems"):
        problems(60, seed=0, terms=(2, 2), digits=(1, 1))  # 100 pairs of 1-digit numbers


def test_cli_data_tool_sums(tmp_path):
    result = CliRunner().invoke(app, ["data", "tool-sums", "--out", str(tmp_path), "--n-train", "20", "--n-val", "4",
                                      "--n-sft", "8", "--max-terms", "2", "--min-digits", "6", "--max-digits", "6"])
    assert result.exit_code == 0, result.output
    assert [pq.read_table(tmp_path / f"{s}.parquet").num_rows for s in ("train", "val", "sft")] == [20, 4, 8]
    q = rows(tmp_path / "train.parquet")[0]["prompt"][0]["content"]
    assert [len(t) for t in q[:-1].split("+")] == [6, 6]
    bad = CliRunner().invoke(app, ["data", "tool-sums", "--out", str(tmp_path), "--min-terms", "1"])
    assert bad.exit_code == 2 and "min_terms" in bad.stderr


# ----- the reward -----

def test_tool_sum_reward():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12345+67890"}}</tool_call>'

    def trajectory(last):  # a response decoded with the special tokens skipped
        return call + "\ntool\n80235\nassistant\n" + last

    assert tool_sum_reward(trajectory("80235"), "80235") == 1.0
    assert tool_sum_reward(trajectory("80236"), "80235") == 0.0
    assert tool_sum_reward(trajectory("80235 is the sum"), "80235") == 0.0
    # the tool's result alone is not the answer: the last turn must state it
    assert tool_sum_reward(trajectory(""), "80235") == 0.0
    kept = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call><|im_end|>\n'
            "<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n3<|im_end|>")  # special tokens kept
    assert last_assistant_turn(kept) == "3" and tool_sum_reward(kept, "3") == 1.0
    # a trajectory that ends still calling the tool scores 0; a single-turn answer is read whole
    assert tool_sum_reward('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>',
                           "3") == 0.0
    assert tool_sum_reward(" 80235\n", "80235") == 1.0
    assert default_compute_score("synthetic/tool_sum", trajectory("80235"), "80235") == 1.0


# ----- SFT on whole conversations -----

CONV = [
    {"role": "user", "content": "12+30="},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12+30"}}'
                                     "</tool_call>"},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "42"},
]
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {"type": "object"}}}]


def hand_built(tok, conv, tool_names):
    """The tiny ChatML template's ids and loss mask, written out by hand: each message is
    <|im_start|>role\\ncontent<|im_end|>\\n, a system line names the tools, and the trained tokens are an
    assistant message's content and its <|im_end|>."""
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    ids, mask = [], []

    def add(part, m):
        ids.extend(part)
        mask.extend([m] * len(part))

    if tool_names:
        add([start] + enc("system\ntools:" + "".join(" " + n for n in tool_names)) + [end] + enc("\n"), 0)
    for msg in conv:
        add([start] + enc(msg["role"] + "\n"), 0)
        trained = msg["role"] == "assistant"
        add(enc(msg["content"]) + [end], int(trained))
        add(enc("\n"), 0)
    return ids, mask


def write_conversations(path, convs, tools=None):
    cols = {"messages": pa.array(convs, type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))}
    if tools is not None:
        cols["tools"] = pa.array(tools, type=pa.string())
    pq.write_table(pa.table(cols), path)
    return str(path)


def test_conversation_mask_equals_hand_built_ids(tmp_path, tok):
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "hello"}, {"role": "user", "content": "7+8="},
              {"role": "assistant", "content": "15"}]
    path = write_conversations(tmp_path / "c.parquet", [CONV, system], [json.dumps(TOOLS), None])
    ds = SFTDataset(path, tok, max_length=256)
    for i, (conv, names) in enumerate(((CONV, ["calculator"]), (system, []))):
        ids, mask = hand_built(tok, conv, names)
        assert ds[i]["input_ids"] == ids
        assert ds[i]["loss_mask"] == mask
    # the trained tokens are exactly the assistant turns, end tokens included
    trained = tok.decode([t for t, m in zip(ds[0]["input_ids"], ds[0]["loss_mask"]) if m])
    assert trained == CONV[1]["content"] + "<|im_end|>" + "42<|im_end|>"
    # tools as a list of objects (not a JSON string) render the same
    table = pa.table({"messages": pq.read_table(path).column("messages").slice(0, 1),
                      "tools": pa.array([TOOLS])})
    pq.write_table(table, tmp_path / "l.parquet")
    assert SFTDataset(str(tmp_path / "l.parquet"), tok, max_length=256)[0] == ds[0]
    # prompt/response files keep working next to conversation files
    pq.write_table(pa.table({"prompt": ["1+2="], "response": ["3"]}), tmp_path / "pr.parquet")
    both = SFTDataset([path, str(tmp_path / "pr.parquet")], tok, max_length=256)
    assert len(both) == 3 and sum(both[2]["loss_mask"]) == 2


def test_conversation_errors_name_the_row(tmp_path, tok):
    fine = CONV
    path = write_conversations(tmp_path / "t.parquet", [fine, fine], [json.dumps(TOOLS), "[not json"])
    with pytest.raises(DataError) as e:
        SFTDataset(path, tok, max_length=256)
    one_line(e, path, "row 1", "'tools'", "JSON")

    path = write_conversations(tmp_path / "n.parquet", [fine, [{"role": "user", "content": "x"}]])
    with pytest.raises(DataError) as e:
        SFTDataset(path, tok, max_length=256)
    one_line(e, path, "row 1", "'messages'", "no assistant message")

    path = write_conversations(tmp_path / "o.parquet", [fine])
    with pytest.raises(DataError) as e:
        SFTDataset(path, tok, max_length=40)
    one_line(e, path, "row 0", "max_length=40", "truncation=right")
    cut = SFTDataset(path, tok, max_length=40, truncation="right")[0]
    assert len(cut["input_ids"]) == 40 and cut["loss_mask"] == hand_built(tok, fine, [])[1][:40]

    # a template that drops earlier assistant turns (as reasoning-stripping templates do) is not prefix-preserving
    strip = build_tokenizer()
    strip.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n"
        "<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(DataError) as e:
        SFTDataset(path, strip, max_length=256)
    one_line(e, path, "row 0", "prefix-preserving")


def test_sft_loss_counts_only_assistant_tokens(tmp_path, tok):
    """One SFT step on conversations in a world of one: the logged loss equals a float64 reference NLL over the
    assistant tokens alone, not the NLL over everything after the first assistant token."""
    import torch.distributed as dist
    from launching import free_port

    from spmdrl.sft import run_sft
    from spmdrl.tiny import build_tiny
    from spmdrl.metrics import read_jsonl

    model_dir = build_tiny(str(tmp_path / "tiny"), seed=0)
    from transformers import AutoModelForCausalLM

    sharp = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():  # peaked predictions, so that tokens' NLLs differ and the masked mean is distinctive
        sharp.lm_head.weight.mul_(40.0)
    sharp.save_pretrained(model_dir)
    convs = [[{"role": "user", "content": f"{a}+{b}="},
              {"role": "assistant", "content": f'<tool_call>{{"expression": "{a}+{b}"}}</tool_call>'},
              {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]
             for a, b in ((1, 2), (30, 4), (500, 60), (7, 8000))]
    data = write_conversations(tmp_path / "c.parquet", convs, [json.dumps(TOOLS)] * 4)
    cfg = load_config(None, [f"model.path={model_dir}", f'sft.train_files=["{data}"]', "sft.max_length=192",
                             "sft.batch_size=4", "sft.micro_batch_size=2", "sft.max_steps=1", "sft.lr=1e-6",
                             f"trainer.output_dir={tmp_path / 'out'}", "trainer.device=cpu",
                             "logging.tensorboard=false", "logging.console=false", "logging.progress=false"],
                      root_cls=SFTConfig)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        run_sft(cfg, validate_sft(cfg, 1), 0, torch.device("cpu"))
    finally:
        if created:
            dist.destroy_process_group()
    logged = [r for r in read_jsonl(str(tmp_path / "out" / "metrics.jsonl")) if "sft/loss" in r][0]["sft/loss"]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ds = SFTDataset(data, tok, 192)
    nll = {"assistant": 0.0, "everything": 0.0}
    count = {"assistant": 0, "everything": 0}
    for i in range(len(ds)):
        ids, mask = torch.tensor(ds[i]["input_ids"]), torch.tensor(ds[i]["loss_mask"])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
        m = mask[1:].double()
        after_first = (torch.arange(len(ids) - 1) >= int(mask.nonzero()[0]) - 1).double()
        for key, w in (("assistant", m), ("everything", after_first)):
            nll[key] -= float((logp * w).sum())
            count[key] += int(w.sum())
    ref = nll["assistant"] / count["assistant"]
    assert abs(logged - ref) < 1e-4 * ref, (logged, ref)
    # the loss over everything after the first assistant token (user and tool turns too) is 50x the tolerance off
    assert abs(nll["everything"] / count["everything"] - ref) > 5e-3 * ref


# ----- the quickstart configs -----

def test_tool_quickstart_configs_validate():
    cfg = load_config(os.path.join(REPO, "configs", "quickstart", "grpo_tools.toml"))
    assert cfg.multi_turn.enable and cfg.multi_turn.tools == ["calculator"]
    validate(cfg, 2)
    sft = load_config(os.path.join(REPO, "configs", "quickstart", "sft_tools.toml"), root_cls=SFTConfig)
    validate_sft(sft, 2)
    # the longest conversation of the task fits the SFT length, its prompt the GRPO prompt length, and the rest
    # the GRPO response budget
    tok = build_tokenizer()
    terms = (9999999,) * 3
    from spmdrl.data.tool_sums import calculator, conversation

    conv = conversation(terms)
    n = [len(tok(tok.apply_chat_template(c, tools=[calculator().schema()], tokenize=False, add_generation_prompt=g),
                 add_special_tokens=False)["input_ids"]) for c, g in ((conv[:1], True), (conv, False))]
    assert n[0] <= cfg.data.max_prompt_length and n[1] <= sft.sft.max_length
    assert n[1] - n[0] <= cfg.data.max_response_length
