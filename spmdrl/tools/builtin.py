"""The built-in tools: calculator, python (the local sandbox) and http_exec (an external code-execution service).

Each factory takes the [multi_turn] config section (None: the defaults) and raises a one-line ConfigError when
the tool cannot work as configured.
"""
from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request

from spmdrl.errors import ConfigError
from spmdrl.tools.base import Tool
from spmdrl.tools.calculator import ALLOWED, calculate
from spmdrl.tools.sandbox import SandboxLimits, interpreter_problem, run_python

HTTP_APIS = ("sandbox_fusion", "piston")
_CODE_SCHEMA = {"type": "object", "required": ["code"],
                "properties": {"code": {"type": "string", "description": "A complete Python 3 program."}}}


def calculator_tool(cfg=None) -> Tool:
    def calculator(expression: str) -> str:
        return calculate(expression)

    return Tool(
        name="calculator",
        description=f"Evaluate an arithmetic expression exactly: integers of any size, decimals; {ALLOWED}.",
        parameters={"type": "object", "required": ["expression"],
                    "properties": {"expression": {"type": "string", "description": "e.g. 12345678901 * 98765 + 7"}}},
        fn=calculator,
    )


def _program_output(stdout: str, stderr: str, status: str) -> str:
    parts = [stdout.rstrip("\n")] if stdout else []
    if stderr:
        parts.append("stderr:\n" + stderr.rstrip("\n"))
    if status:
        parts.append(status)
    return "\n".join(parts) if parts else "(no output)"


def python_tool(cfg=None) -> Tool:
    limits = SandboxLimits.from_config(cfg) if cfg is not None else SandboxLimits()
    interpreter = (getattr(cfg, "sandbox_python", "") if cfg is not None else "") or sys.executable
    problem = interpreter_problem(interpreter)
    if problem:
        raise ConfigError(
            f"multi_turn.tools has python, but {problem}; set multi_turn.sandbox_python to an interpreter every user "
            "can run (e.g. /usr/bin/python3), or run the trainer as a user other than root"
        )

    def python(code: str) -> str:
        r = run_python(code, limits, python=interpreter)
        return _program_output(r.stdout, r.stderr, r.describe(limits))

    return Tool(
        name="python",
        description="Run a Python 3 program and return what it prints (stdout, then stderr). Every call is a fresh "
                    "process with short time limits and no state kept between calls: print the values you need.",
        parameters=_CODE_SCHEMA,
        fn=python,
    )


def http_exec_tool(cfg=None) -> Tool:
    url = getattr(cfg, "http_exec_url", "") if cfg is not None else ""
    api = getattr(cfg, "http_exec_api", "sandbox_fusion") if cfg is not None else "sandbox_fusion"
    timeout_s = float(getattr(cfg, "http_exec_timeout_s", 8.0)) if cfg is not None else 8.0
    if not url:
        raise ConfigError("multi_turn.tools has http_exec but multi_turn.http_exec_url is empty; set it to the "
                          "code-execution service's endpoint, e.g. http://host:8080/run_code")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"multi_turn.http_exec_url = {url!r} is not an http:// or https:// URL")
    if api not in HTTP_APIS:
        raise ConfigError(f"multi_turn.http_exec_api = {api!r} is not one of {', '.join(HTTP_APIS)}")

    def http_exec(code: str) -> str:
        return execute_remote(code, url=url, api=api, timeout_s=timeout_s)

    return Tool(
        name="http_exec",
        description="Run a Python 3 program on a code-execution service and return what it prints (stdout, then "
                    "stderr). No state is kept between calls: print the values you need.",
        parameters=_CODE_SCHEMA,
        fn=http_exec,
    )


def _request_body(code: str, api: str, timeout_s: float) -> dict:
    if api == "piston":
        return {"language": "python", "version": "*", "files": [{"name": "main.py", "content": code}],
                "run_timeout": int(timeout_s * 1000)}
    return {"code": code, "language": "python", "run_timeout": timeout_s}


def _parse_response(body: dict, api: str) -> str:
    if api == "piston":
        if "run" not in body:  # piston answers {"message": ...} to a bad request
            raise RuntimeError(f"the service answered without a run result: {body.get('message', body)!r:.300}")
        run = body["run"]
        status = ""
        if run.get("signal"):
            status = f"[killed by signal {run['signal']}]"
        elif run.get("code"):
            status = f"[exit status {run['code']}]"
        return _program_output(run.get("stdout") or "", run.get("stderr") or "", status)
    run = body.get("run_result")
    if not isinstance(run, dict):
        raise RuntimeError(f"the service answered status {body.get('status')!r} without a run result: "
                           f"{body.get('message') or ''!r:.300}")
    status = ""
    if run.get("status") not in (None, "Finished"):
        status = f"[{run['status']}]"  # e.g. TimeLimitExceeded
    elif run.get("return_code"):
        status = f"[exit status {run['return_code']}]"
    return _program_output(run.get("stdout") or "", run.get("stderr") or "", status)


def execute_remote(code: str, *, url: str, api: str, timeout_s: float) -> str:
    """POST `code` to the service and return the program's output; raises RuntimeError (one line) when the
    service cannot be reached or answers with something unusable (the runner turns it into an error result)."""
    data = json.dumps(_request_body(code, api, timeout_s)).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s + 2.0) as resp:  # the service's own limit first
            raw = resp.read(8 << 20)
    except urllib.error.HTTPError as e:
        detail = e.read(300).decode(errors="replace") if e.fp else ""
        raise RuntimeError(f"the code-execution service answered HTTP {e.code}: {' '.join(detail.split())}") from None
    except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise RuntimeError(f"the code-execution service at {url} is unreachable: {reason}") from None
    try:
        body = json.loads(raw)
    except ValueError:
        raise RuntimeError(f"the code-execution service answered with non-JSON: {raw[:200]!r}") from None
    if not isinstance(body, dict):
        raise RuntimeError(f"the code-execution service answered with {type(body).__name__}, not a JSON object")
    return _parse_response(body, api)
