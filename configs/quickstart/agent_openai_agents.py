"""The calculator quickstart's agent written with the OpenAI Agents SDK (`pip install openai-agents`).

The same agent as agent_react.py (the calculator's schema, at most 3 model turns, results cut to 16 characters, the
same reward), here an SDK `Agent` whose model is the endpoint through the Chat Completions API. Run it in training
with `agent.entry = "configs/quickstart/agent_openai_agents.py:run"` (docs/agents.md).
"""
from __future__ import annotations

from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI, BadRequestError

from agent_react import MAX_RESULT_CHARS, MAX_TURNS, TOOLS, calculator, reward  # the sibling file

set_tracing_disabled(True)  # the SDK would send its traces to OpenAI's servers with this key
SCHEMA = TOOLS[0]["function"]


async def run_calculator(ctx, arguments: str) -> str:
    return calculator(arguments)[:MAX_RESULT_CHARS]


CALCULATOR = FunctionTool(name=SCHEMA["name"], description=SCHEMA["description"],
                          params_json_schema=SCHEMA["parameters"], on_invoke_tool=run_calculator,
                          strict_json_schema=False)


def run(base_url: str, api_key: str, sample: dict) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=300)
    agent = Agent(name="calculator", model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  tools=[CALCULATOR])
    try:
        result = Runner.run_sync(agent, [dict(m) for m in sample["messages"]], max_turns=MAX_TURNS)
    except MaxTurnsExceeded:  # still calling tools after its last turn
        return 0.0
    except BadRequestError:  # the conversation outgrew the run's context: unanswered
        return 0.0
    return reward(str(result.final_output), sample["ground_truth"])
