"""What the multi-turn tests share: a tiny model that has memorised scripted tool conversations (so real vLLM
and the transformers engine produce tool calls, answers and malformed calls on cue), and test tools.

The scripts, by the user message:
  a: calls add(x=1, y=2) in every turn (it reaches the turn limit)
  b: answers "7" at once
  c: writes a malformed call, then answers "ok"
  d: calls boom (raises), then answers "ok"
  e: calls slow (sleeps past the timeout), then answers "ok"
(after a result that starts with "error" the model answers "ok"; after add's "3" it calls add again)
"""
from __future__ import annotations

import os
import time

import torch

from spmdrl.tiny import build_tiny
from spmdrl.tools.base import Tool
from spmdrl.tools.parse import parse_tool_calls
from spmdrl.tools.runner import ThreadToolRunner

CALL_ADD = '<tool_call>{"name": "add", "arguments": {"x": 1, "y": 2}}</tool_call>'
MALFORMED = '<tool_call>{"name": add}</tool_call>'
CALL_BOOM = '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
CALL_SLOW = '<tool_call>{"name": "slow", "arguments": {}}</tool_call>'
TIMEOUT_S = 0.5


def add(x: int, y: int) -> str:
    return str(x + y)


def boom() -> str:
    raise RuntimeError("boom")


def slow() -> str:
    time.sleep(TIMEOUT_S * 4)
    return "late"


ADD = Tool("add", "add two integers", {"type": "object", "properties": {"x": {"type": "integer"},
                                                                       "y": {"type": "integer"}},
                                         "required": ["x", "y"]}, add)
BOOM = Tool("boom", "always fails", {"type": "object", "properties": {}}, boom)
SLOW = Tool("slow", "never returns in time", {"type": "object", "properties": {}}, slow)
TOOLS = [ADD, BOOM, SLOW]  # multi_turn.tools = ["tests/tool_agent.py:ADD", ...]
SCHEMAS = [t.schema() for t in TOOLS]


def runner(timeout_s: float = TIMEOUT_S):
    """The real tool runner over the test tools."""
    return ThreadToolRunner(TOOLS, timeout_s=timeout_s, max_calls_per_turn=4)


def conversations() -> dict[str, list[dict]]:
    """The scripted conversations, by user message (what the model memorises)."""
    def tool(text):
        return {"role": "tool", "content": text}

    def asst(text):
        return {"role": "assistant", "content": text}

    return {
        "a": [asst(CALL_ADD), tool("3")] * 2 + [asst(CALL_ADD)],
        "b": [asst("7")],
        "c": [asst(MALFORMED), tool(parse_tool_calls(MALFORMED)[0].error), asst("ok")],
        "d": [asst(CALL_BOOM), tool("error: RuntimeError: boom"), asst("ok")],
        "e": [asst(CALL_SLOW), tool(f"error: tool slow took longer than {TIMEOUT_S:g}s and was stopped"), asst("ok")],
    }


def prompt_messages(letter: str) -> list[dict]:
    return [{"role": "user", "content": letter}]


SIZES = dict(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=192, num_layers=2)
"""Smaller than build_tiny's default (head dim 32 still, what vLLM's CPU attention needs): it trains in seconds."""


def build_tool_model(out_dir: str, max_steps: int = 400, *, arch: str = "qwen2", letters: str = "abcde") -> str:
    """build_tiny (of architecture `arch`) + training on the assistant turns of the scripted conversations of
    `letters` (the answers' own <|im_end|> included) until every one of those tokens has probability > 0.8.
    Returns the model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.isfile(os.path.join(out_dir, "trained")):
        return out_dir
    build_tiny(out_dir, seed=0, arch=arch, **SIZES)
    tok = AutoTokenizer.from_pretrained(out_dir)

    def n_tokens(msgs, gen):
        return len(tok.encode(tok.apply_chat_template(msgs, tools=SCHEMAS, tokenize=False, add_generation_prompt=gen),
                              add_special_tokens=False))

    seqs, targets = [], []
    for letter, turns in conversations().items():
        if letter not in letters:
            continue
        msgs = prompt_messages(letter) + turns
        seqs.append(tok.encode(tok.apply_chat_template(msgs, tools=SCHEMAS, tokenize=False), add_special_tokens=False))
        spans = []
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":
                start = n_tokens(msgs[:k], True)
                answer = "<tool_call>" not in m["content"]  # an answer ends with the model's own <|im_end|>
                spans.append((start, start + len(tok.encode(m["content"], add_special_tokens=False)) + answer))
        targets.append(spans)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    for i, (s, spans) in enumerate(zip(seqs, targets)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        for a, b in spans:
            labels[i, a:b] = ids[i, a:b]
    shifted = labels[:, 1:]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        for step in range(max_steps):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            opt.zero_grad()
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                probs = out.logits[:, :-1].float().softmax(-1)
                sel = shifted != -100
                p_target = probs.gather(-1, shifted.clamp(min=0)[..., None])[..., 0][sel]
                if os.environ.get("TOOL_MODEL_DEBUG") and step % 10 == 0:
                    print(step, float(out.loss), float(p_target.min()), flush=True)
                if bool((p_target > 0.8).all()):
                    break
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "trained"), "w") as f:
        f.write(f"steps {step + 1} loss {float(out.loss.detach()):.6f} min target prob {float(p_target.min()):.4f}\n")
    return out_dir


def shared_tool_model(tmp_path_factory) -> str:
    """The tool model of this pytest session (trained once, in the session's base temp directory), or the
    directory SPMDRL_TOOL_MODEL names (one built by build_tool_model earlier)."""
    given = os.environ.get("SPMDRL_TOOL_MODEL")
    if given:
        return given
    return build_tool_model(str(tmp_path_factory.getbasetemp() / "tool_model"))
