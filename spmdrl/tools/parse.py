"""Tool calls out of the model's text, in the Hermes / Qwen format:

    <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>

Every `<tool_call>` block of a turn gives one ToolCall, in order. A block that cannot be used (bad JSON, no
name, arguments that are not an object, no closing tag) gives a ToolCall with `error` set: it is never run and
its error text is what the model sees as the result. Arguments given as a JSON string holding an object are
accepted, as verl and Qwen's own parsers accept them.
"""
from __future__ import annotations

import json

from spmdrl.tools.base import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMATS = ("hermes",)


def stop_strings(fmt: str = "hermes") -> list[str]:
    """The strings that end a turn with a call in it: the rollout stops there and runs the calls."""
    if fmt not in FORMATS:
        raise ValueError(f"tool-call format {fmt!r} is not one of {', '.join(FORMATS)}")
    return [CLOSE]


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """The calls in one turn's text, in order of appearance; [] when there is none."""
    if fmt not in FORMATS:
        raise ValueError(f"tool-call format {fmt!r} is not one of {', '.join(FORMATS)}")
    calls, pos = [], 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            return calls
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        if end < 0:  # the turn ended (length, EOS) inside the block
            calls.append(_malformed("", f"no {CLOSE} after {OPEN}: the call is not closed"))
            return calls
        calls.append(parse_one(text[body_start:end]))
        pos = end + len(CLOSE)


def parse_one(body: str) -> ToolCall:
    """One block's body (the text between the tags) as a ToolCall."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return _malformed("", f"the call is not valid JSON ({e.msg} at character {e.pos}); write "
                              '{"name": ..., "arguments": {...}}')
    if not isinstance(obj, dict):
        return _malformed("", f"the call is a JSON {type(obj).__name__}, not an object with name and arguments")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _malformed("", "the call has no \"name\" string")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments as a JSON-encoded string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return _malformed(name, f"the arguments string is not valid JSON ({e.msg})")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return _malformed(name, f"\"arguments\" is a JSON {type(args).__name__}, not an object")
    return ToolCall(name=name, arguments=args)


def _malformed(name: str, why: str) -> ToolCall:
    return ToolCall(name=name or "", arguments={}, error=f"error: malformed tool call: {why}")
