"""Agent programs for the [agent] tests: a ReAct agent written with the openai client, and misbehaving ones.

`run(base_url, api_key, sample)` picks by the sample's extra_info["mode"] (default "react"); the test model is
tests/tool_agent.py's, which has memorised scripted tool conversations by user message (a: calls add forever,
b: answers 7, d: calls boom then answers ok)."""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request

ADD = {"type": "function", "function": {"name": "add", "description": "add two integers",
                                        "parameters": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                                         "y": {"type": "integer"}},
                                                       "required": ["x", "y"]}}}
BOOM = {"type": "function", "function": {"name": "boom", "description": "always fails",
                                         "parameters": {"type": "object", "properties": {}}}}
SLOW = {"type": "function", "function": {"name": "slow", "description": "never returns in time",
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [ADD, BOOM, SLOW]  # the same names, in the same order, as the model saw in training


def call_tool(name: str, args: dict) -> str:
    if name == "add":
        return str(int(args["x"]) + int(args["y"]))
    return f"error: RuntimeError: {name}"


def react(base_url: str, api_key: str, sample: dict, turns: int = 3) -> float:
    """Call the model, run the tools it asks for, send their results, until it answers or `turns` calls were made;
    the reward is 1 for the expected answer. The second call streams."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    messages = [dict(m) for m in sample["messages"]]
    for turn in range(turns):
        if turn == 1:
            message = streamed(client, messages)
        else:
            r = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=0.7)
            message = r.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if not message.get("tool_calls"):
            break
        for c in message["tool_calls"]:
            args = json.loads(c["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": call_tool(c["function"]["name"], args)})
    answer = messages[-1].get("content") or ""
    return 1.0 if answer.strip() == str(sample["ground_truth"]) and sample["ground_truth"] else 0.0


def streamed(client, messages) -> dict:
    """One streamed call, the chunks put back together into a message."""
    content, calls = "", {}
    for chunk in client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            calls[c.index] = {"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
    out = {"role": "assistant", "content": content or None}
    if calls:
        out["tool_calls"] = [calls[k] for k in sorted(calls)]
    return out


def raw(url: str, body: bytes, key: str | None) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json",
                                                                         **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def faults(base_url: str, api_key: str, sample: dict) -> float:
    """Malformed JSON, no secret, a body over the size cap, a prompt over the context: their status codes go to
    extra_info["out"]; then one good call, so the session trains."""
    url = base_url + "/chat/completions"
    good = json.dumps({"model": "policy", "messages": sample["messages"]}).encode()
    codes = {
        "malformed": raw(url, b'{"messages": [', api_key),
        "no_secret": raw(url, good, None),
        "wrong_secret": raw(url, good, api_key + "x"),
        "too_big": raw(url, b'{"x": "' + b"y" * 70_000 + b'"}', api_key),
        "too_long": raw(url, json.dumps({"messages": [{"role": "user", "content": "z" * 500}]}).encode(), api_key),
        "n2": raw(url, json.dumps({"messages": sample["messages"], "n": 2}).encode(), api_key),
        "good": raw(url, good, api_key),
    }
    with open(sample["extra_info"]["out"], "w") as f:
        json.dump(codes, f)
    return 0.5


def flood(base_url: str, api_key: str, sample: dict) -> None:
    """More calls than agent.max_calls: the later ones get 429."""
    url = base_url + "/chat/completions"
    good = json.dumps({"messages": sample["messages"], "max_tokens": 2}).encode()
    codes = [raw(url, good, api_key) for _ in range(8)]
    with open(sample["extra_info"]["out"], "w") as f:
        json.dump(codes, f)


def crash(base_url: str, api_key: str, sample: dict):
    raise RuntimeError("the agent fell over")


def hang(base_url: str, api_key: str, sample: dict):
    """Starts a child in a new session, then never returns: the timeout must kill both."""
    child = subprocess.Popen(["python3", "-c", "import time; time.sleep(1000)"], start_new_session=True)
    with open(sample["extra_info"]["out"], "w") as f:
        json.dump({"child": child.pid}, f)
    time.sleep(1000)


def graded(base_url: str, api_key: str, sample: dict) -> float:
    """react's reward plus 0.5 for the second session of a prompt: a GRPO group whose rewards differ."""
    return react(base_url, api_key, sample) + 0.5 * sample["sample"]


MODES = {"react": react, "graded": graded, "faults": faults, "flood": flood, "crash": crash, "hang": hang}


def two_calls(base_url: str, api_key: str, sample: dict) -> float:
    """Two chat calls, the second extending the first with its reply and a user turn (any model: no tools)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    messages = [dict(m) for m in sample["messages"]]
    for _ in range(2):
        r = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    return 1.0


MODES["two_calls"] = two_calls


def openai_agents(base_url: str, api_key: str, sample: dict) -> float:
    """The same ReAct loop written with the OpenAI Agents SDK: an Agent over the Chat Completions model, the test
    tools as FunctionTools. 1.0 when it called a tool and then answered "ok" (prompt d: boom, then ok)."""
    from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran = []

    def tool(schema):
        async def invoke(ctx, arguments: str) -> str:
            ran.append(schema["name"])
            return call_tool(schema["name"], json.loads(arguments or "{}"))
        return FunctionTool(name=schema["name"], description=schema["description"],
                            params_json_schema=schema["parameters"], on_invoke_tool=invoke, strict_json_schema=False)

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    agent = Agent(name="test", model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  tools=[tool(t["function"]) for t in TOOLS])
    result = Runner.run_sync(agent, [dict(m) for m in sample["messages"]], max_turns=3)
    return 1.0 if ran and str(result.final_output).strip() == "ok" else 0.0


def langgraph(base_url: str, api_key: str, sample: dict) -> float:
    """The same ReAct loop as LangGraph's prebuilt agent over ChatOpenAI, the test tools as StructuredTools. 1.0
    when it called a tool and then answered "ok"."""
    from langchain_core.tools import StructuredTool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    ran = []

    def tool(schema):
        def invoke(**args) -> str:
            ran.append(schema["name"])
            return call_tool(schema["name"], args)
        return StructuredTool.from_function(invoke, name=schema["name"], description=schema["description"],
                                            args_schema=schema["parameters"])

    model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    agent = create_react_agent(model, [tool(t["function"]) for t in TOOLS])
    state = agent.invoke({"messages": [dict(m) for m in sample["messages"]]}, {"recursion_limit": 5})
    return 1.0 if ran and state["messages"][-1].content.strip() == "ok" else 0.0


MODES["openai_agents"], MODES["langgraph"] = openai_agents, langgraph


def run(base_url: str, api_key: str, sample: dict):
    mode = (sample.get("extra_info") or {}).get("mode", "react")
    assert os.environ["OPENAI_BASE_URL"] == base_url and os.environ["OPENAI_API_KEY"] == api_key
    return MODES[mode](base_url, api_key, sample)
