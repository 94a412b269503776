"""The calculator quickstart's task done by a black-box agent: a small ReAct loop written with the openai client.

spmdrl calls `run(base_url, api_key, sample)` once per session, in a process of its own (configs/quickstart/
grpo_agent.toml, `TASK=agent bash launch/quickstart.sh`). The agent talks to the policy through `base_url` like to
any OpenAI-compatible server, runs the calculator itself when the model asks for it, and returns its reward.
It behaves like the in-process tool loop of configs/quickstart/grpo_tools.toml, so the two runs can be compared:
the same tool schema (the chat template writes it into the prompt), at most 3 model turns, tool results cut to
16 characters (16 tokens of the quickstart's byte-level tokenizer), and the same reward rule (synthetic/tool_sum:
the last answer must be exactly the sum).
"""
from __future__ import annotations

import json
import re

from openai import BadRequestError, OpenAI

from spmdrl.tools.calculator import calculate  # the calculator the in-process loop runs (any other would do)

MAX_TURNS = 3
MAX_RESULT_CHARS = 16
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression exactly: integers of any size, decimals; numbers, "
                   "+ - * / // % ** and parentheses.",
    "parameters": {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string", "description": "e.g. 12345678901 * 98765 + 7"}}},
}}]
_INT = re.compile(r"[+-]?[0-9]+")


def calculator(arguments: str) -> str:
    """The tool's result as the model sees it: the value, or one error line."""
    try:
        args = json.loads(arguments)
        return calculate(args["expression"]) if isinstance(args, dict) else "error: arguments must be an object"
    except Exception as e:  # a bad expression, bad JSON, a missing argument: the model reads the error
        return f"error: {type(e).__name__}: {' '.join(str(e).split())}"


def reward(answer: str, truth: str) -> float:
    answer, truth = answer.strip(), str(truth).strip()
    return 1.0 if _INT.fullmatch(answer) and _INT.fullmatch(truth) and int(answer) == int(truth) else 0.0


def run(base_url: str, api_key: str, sample: dict) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, timeout=300)  # the default retries: connection errors
    messages = [dict(m) for m in sample["messages"]]
    for _ in range(MAX_TURNS):
        try:
            r = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except BadRequestError:  # the conversation outgrew the run's context: unanswered
            return 0.0
        message = r.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return reward(message.content or "", sample["ground_truth"])
        for call in message.tool_calls:
            result = calculator(call.function.arguments)[:MAX_RESULT_CHARS]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0  # still calling tools after its last turn
