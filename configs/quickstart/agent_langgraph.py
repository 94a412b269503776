"""The calculator quickstart's agent written with LangGraph (`pip install langgraph langchain-openai`).

The same agent as agent_react.py (the calculator's schema, at most 3 model turns, results cut to 16 characters, the
same reward), here LangGraph's prebuilt ReAct agent over a `ChatOpenAI` pointed at the endpoint. Run it in training
with `agent.entry = "configs/quickstart/agent_langgraph.py:run"` (docs/agents.md).
"""
from __future__ import annotations

import json

from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent
from openai import BadRequestError

from agent_react import MAX_RESULT_CHARS, MAX_TURNS, TOOLS, calculator, reward  # the sibling file

SCHEMA = TOOLS[0]["function"]


def run_calculator(expression: str) -> str:
    return calculator(json.dumps({"expression": expression}))[:MAX_RESULT_CHARS]


CALCULATOR = StructuredTool.from_function(run_calculator, name=SCHEMA["name"], description=SCHEMA["description"],
                                          args_schema=SCHEMA["parameters"])


def run(base_url: str, api_key: str, sample: dict) -> float:
    model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, timeout=300)
    agent = create_react_agent(model, [CALCULATOR])
    try:
        # a model turn and a tool turn are a step each: 3 model turns with 2 tool turns between are 5 steps
        state = agent.invoke({"messages": [dict(m) for m in sample["messages"]]},
                             {"recursion_limit": 2 * MAX_TURNS - 1})
    except GraphRecursionError:
        return 0.0
    except BadRequestError:  # the conversation outgrew the run's context: unanswered
        return 0.0
    last = state["messages"][-1]
    if getattr(last, "tool_calls", None):  # still calling tools after its last turn
        return 0.0
    return reward(last.content if isinstance(last.content, str) else "", sample["ground_truth"])
