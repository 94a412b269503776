"""Agent sessions in a process of their own (`spmdrl.agents.worker.main`, started by spmdrl/process/workers.py),
one after another: each of a rank's `agent.sessions` slots keeps one such worker, so a Python agent's module and
what it imports (the openai client: most of a session's CPU on a small model) load once per slot, not per session.

For each session the rank sends `(kind, target, sample, env)`: kind "python" calls `target` ('file.py:run' or
'module:run') as `run(base_url, api_key, sample)`; kind "command" runs `target` with /bin/sh, the sample as JSON on
its stdin and in SPMDRL_SAMPLE, and reads its result from the last line of its stdout. `env` (the session's
OPENAI_BASE_URL and OPENAI_API_KEY) goes into the environment of both. The worker is a subreaper: whatever the
session started is killed before it answers; the rank kills the worker's whole tree when a session's time runs out
(and starts a fresh worker for the slot's next session).

The answer is `("ok", {"reward": float | None, "transcript": list | None})` or `("error", one line)`.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from spmdrl.process.proctree import become_subreaper, kill_tree
from spmdrl.process.usercode import load_object, one_line
from spmdrl.process.workers import recv, send, serve_streams

MODULE = "spmdrl.agents.worker"


class BadResult(Exception):
    pass


def outcome(value) -> dict:
    """What an agent returned: a number (the reward), a list of messages (the transcript the run's reward function
    scores), a dict with "reward" and / or "transcript", or None (the run's reward function scores what the
    endpoint captured)."""
    if value is None:
        return {"reward": None, "transcript": None}
    if isinstance(value, bool):
        raise BadResult("returned a bool; return a number (the reward), a list of messages or None")
    if isinstance(value, (int, float)):
        if not math.isfinite(float(value)):
            raise BadResult(f"returned the reward {value!r}; it must be finite")
        return {"reward": float(value), "transcript": None}
    if isinstance(value, list):
        return {"reward": None, "transcript": _messages(value)}
    if isinstance(value, dict):
        out = outcome(value.get("reward"))
        if value.get("transcript") is not None:
            out["transcript"] = _messages(value["transcript"])
        return out
    raise BadResult(f"returned a {type(value).__name__}; return a number (the reward), a list of messages or None")


def _messages(value) -> list:
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise BadResult("returned a transcript that is not a list of {\"role\", \"content\"} messages")
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise BadResult(f"returned a transcript that is not JSON ({one_line(e)})") from None


def parse_stdout(text: str) -> dict:
    """A command's result: its last non-empty stdout line as JSON (a number, a list of messages, an object), or
    None when it printed nothing."""
    lines = [x for x in text.splitlines() if x.strip()]
    if not lines:
        return outcome(None)
    try:
        return outcome(json.loads(lines[-1]))
    except json.JSONDecodeError:
        raise BadResult(f"printed {lines[-1][:80]!r} last; print the reward (a number) or a JSON transcript") from None


def run_command(command: str, sample: dict) -> dict:
    data = json.dumps(sample)
    proc = subprocess.run(["/bin/sh", "-c", command], input=data.encode(), stdout=subprocess.PIPE,
                          env={**os.environ, "SPMDRL_SAMPLE": data})
    if proc.returncode != 0:
        raise BadResult(f"exited with status {proc.returncode}")
    return parse_stdout(proc.stdout.decode("utf-8", "replace"))


def main() -> int:
    parent = os.getppid()
    requests, replies = serve_streams(ignore_sigterm=False)
    if os.getppid() != parent:  # the rank died before die_with_parent took effect
        return 0
    become_subreaper()
    agents: dict[str, object] = {}  # target -> the loaded run function: one import per worker
    while True:
        msg = recv(requests.fileno(), None)
        if msg is None:  # the rank closed the slot
            return 0
        kind, target, sample, env = msg
        os.environ.update(env)
        try:
            if kind == "python":
                if target not in agents:
                    agents[target] = load_object(target, what="agent", key="agent.entry", error=BadResult)
                reply = ("ok", outcome(agents[target](env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"], sample)))
            else:
                reply = ("ok", run_command(target, sample))
        except BadResult as e:
            reply = ("error", str(e))
        except BaseException as e:  # the agent's own failure: one line
            reply = ("error", f"raised {type(e).__name__}: {one_line(e) or '(no message)'}")
        kill_tree(os.getpid(), include_root=False)  # nothing the session started outlives it
        sys.stdout.flush()
        send(replies, reply)
