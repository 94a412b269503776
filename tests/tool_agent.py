"""What the multi-turn tests share: a tiny model that has memorised scripted tool conversations (so real vLLM
and the transformers engine produce tool calls, answers and malformed calls on cue), test tools, and a small
ToolRunner written for the tests (threads, a timeout per call, every failure an error result).

The scripts, by the user message:
  a: calls add(x=1, y=2) in every turn (it reaches the turn limit)
  b: answers "7" at once
  c: writes a malformed call, then answers "ok"
  d: calls boom (raises), then answers "ok"
  e: calls slow (sleeps past the timeout), then answers "ok"
(after a result that starts with "error" the model answers "ok"; after add's "3" it calls add again)
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import time

import torch

from spmdrl.tiny import build_tiny
from spmdrl.tools.base import Tool, ToolCall, ToolResult

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


TOOLS = [
    Tool("add", "add two integers", {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                     "required": ["x", "y"]}, add),
    Tool("boom", "always fails", {"type": "object", "properties": {}}, boom),
    Tool("slow", "never returns in time", {"type": "object", "properties": {}}, slow),
]
SCHEMAS = [t.schema() for t in TOOLS]


class LocalRunner:
    """Runs one turn's calls concurrently in threads, each with a timeout; failures become error results."""

    def __init__(self, tools: list[Tool], timeout_s: float = TIMEOUT_S):
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.pool = cf.ThreadPoolExecutor(8)
        self.calls = 0

    def run(self, calls: list[list[ToolCall]], kwargs: list[dict] | None = None) -> list[list[ToolResult]]:
        futures = [[self.pool.submit(self._one, c) for c in cs] for cs in calls]
        return [[self._wait(f, c) for f, c in zip(fs, cs)] for fs, cs in zip(futures, calls)]

    def _one(self, call: ToolCall) -> ToolResult:
        self.calls += 1
        if call.error:
            return ToolResult(call.name, f"error: {call.error}", "malformed")
        if call.name not in self.tools:
            return ToolResult(call.name, f"error: no tool named {call.name}", "unknown_tool")
        t0 = time.perf_counter()
        try:
            out = self.tools[call.name].fn(**call.arguments)
        except Exception as e:
            return ToolResult(call.name, f"error: {type(e).__name__}: {e}", "exception", time.perf_counter() - t0)
        return ToolResult(call.name, out, "", time.perf_counter() - t0)

    def _wait(self, fut, call: ToolCall) -> ToolResult:
        try:
            return fut.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            return ToolResult(call.name, f"error: {call.name} timed out after {self.timeout_s}s", "timeout",
                              self.timeout_s)


def conversations() -> dict[str, list[dict]]:
    """The scripted conversations, by user message (what the model memorises)."""
    def tool(text):
        return {"role": "tool", "content": text}

    def asst(text):
        return {"role": "assistant", "content": text}

    return {
        "a": [asst(CALL_ADD), tool("3")] * 2 + [asst(CALL_ADD)],
        "b": [asst("7")],
        "c": [asst(MALFORMED), tool("error: malformed tool call"), asst("ok")],
        "d": [asst(CALL_BOOM), tool("error: RuntimeError: boom"), asst("ok")],
        "e": [asst(CALL_SLOW), tool("error: slow timed out"), asst("ok")],
    }


def prompt_messages(letter: str) -> list[dict]:
    return [{"role": "user", "content": letter}]


SIZES = dict(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=192, num_layers=2)
"""Smaller than build_tiny's default (head dim 32 still, what vLLM's CPU attention needs): it trains in seconds."""


def build_tool_model(out_dir: str, max_steps: int = 400) -> str:
    """build_tiny + training on the assistant turns of the scripted conversations (the answers' own <|im_end|>
    included) until every one of those tokens has probability > 0.8. Returns the model
    directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.isfile(os.path.join(out_dir, "trained")):
        return out_dir
    build_tiny(out_dir, seed=0, **SIZES)
    tok = AutoTokenizer.from_pretrained(out_dir)

    def n_tokens(msgs, gen):
        return len(tok.encode(tok.apply_chat_template(msgs, tools=SCHEMAS, tokenize=False, add_generation_prompt=gen),
                              add_special_tokens=False))

    seqs, targets = [], []
    for letter, turns in conversations().items():
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
