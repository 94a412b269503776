"""What a tool is, what a parsed call is, and what running one returns.

A tool is a Python callable with a name, a description and a JSON schema of its arguments; `call(arguments)`
returns the text the model sees (sync or async). Calls are parsed out of the model's text (tools/parse.py) and
run by a ToolRunner (tools/runner.py): every call gives exactly one ToolResult, failures included, so a tool
that raises, hangs or returns garbage never stops a rollout.
"""
from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

FAILURES = ("exception", "timeout", "malformed", "unknown_tool", "bad_output", "too_many_calls")
"""The kinds of failed call, as counted in the metrics (tools/failures/<tool>/<kind>); too_many_calls: a call
past multi_turn.max_calls_per_turn in its turn, not run."""


@dataclass(frozen=True)
class Tool:
    """One callable tool."""

    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments object ({"type": "object", "properties": {...}, "required": [...]})."""
    fn: Callable[..., str | Awaitable[str]]
    """Called as fn(**arguments) (or fn(**arguments, **kwargs) with per-sample kwargs from the data row)."""
    spec: str = ""
    """The multi_turn.tools entry it was loaded from (set by tools/registry.py): a tool with one runs in tool
    worker processes that load it again from it (tools/worker.py); one without (built in Python by the
    caller) runs in a thread of the calling process."""

    def schema(self) -> dict:
        """The OpenAI-style function schema that chat templates take in `tools`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for, in order of appearance in its turn."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str = ""
    """Non-empty when the call could not be parsed (bad JSON, no name, arguments not an object): it is not run,
    and this message is its result (failure kind 'malformed')."""


@dataclass(frozen=True)
class ToolResult:
    """What one call gave: the text the model sees next, and how it went."""

    name: str
    text: str
    failure: str = ""
    """'' when the call succeeded, else one of FAILURES."""
    seconds: float = 0.0
    """Wall time of the call (0 for calls that were never run)."""

    @property
    def ok(self) -> bool:
        return not self.failure


def as_text(value) -> str | None:
    """A tool's return value as the text the model sees, or None when it is not usable: a str as is, a JSON
    value (number, bool, list, dict) serialised; None, NaN, objects, bytes and text that is not valid
    Unicode are not."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (bool, int, float, list, dict)):
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):  # a non-JSON value inside, nan, an int past Python's str() limit
            return None
    else:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return None
    return text


class ToolRunner(Protocol):
    """Runs the calls of one turn: one list of calls per trajectory in, one result per call back, same order.
    Calls run concurrently, each with its own timeout; nothing raises for a failing tool."""

    def run(self, calls: list[list[ToolCall]], kwargs: list[dict] | None = None) -> list[list[ToolResult]]:
        ...
