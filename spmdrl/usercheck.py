"""User code loaded in a throwaway process before a run starts (check_loadable): the reward functions and the
tool files a config names. A misspelled name, a module that raises, and a file that ends its process at import
(`os._exit`, a crash in C code) are each one ConfigError line naming the config key and the spec, and the
process that asked is not the one that ends.

The throwaway process is a worker (spmdrl/process/workers.py: `main` below in a new interpreter, user prints on stderr):
it gets the (key, spec) list on its stdin and answers ("loading", i) before each item, then ("ok",) or ("error",
i, message). A process that ends without a final answer ended while loading the last item it announced.
"""
from __future__ import annotations

import pickle
import time

from spmdrl.errors import ConfigError, RewardError, SpmdrlError
from spmdrl.process.usercode import load_object, one_line
from spmdrl.process.workers import kill_worker, recv, send, serve_streams, spawn_worker

PROBE_TIMEOUT_S = 120.0  # importing the user's modules and their dependencies


def check_loadable(items: list[tuple[str, str]], tools_cfg=None) -> None:
    """Load each (config key, spec) in a throwaway process (reward functions: reward.custom_fn(s); tools:
    multi_turn.tools with `tools_cfg`, the [multi_turn] section), before the run starts: a misspelled name, a
    module that raises, and a file that ends its process at import (`os._exit`, a crash), which no exception
    handler in this process could report, are each one ConfigError line naming the key and the spec."""
    if not items:
        return
    proc = spawn_worker("spmdrl.usercheck", [])
    current = None
    try:
        try:
            send(proc.stdin, (items, tools_cfg))
            deadline = time.monotonic() + PROBE_TIMEOUT_S
            while True:
                reply = recv(proc.stdout.fileno(), deadline)
                if reply is None or reply[0] != "loading":
                    break
                current = items[reply[1]]
        except TimeoutError:
            raise ConfigError(f"{current[0]}: importing {current[1]!r} did not finish within {PROBE_TIMEOUT_S:g}s; a "
                              "module that blocks at import (a loop, input(), a server started at top level) would "
                              "keep the run waiting: fix the file") from None
        except (OSError, EOFError, ValueError, pickle.UnpicklingError):
            reply = None
        if reply is None:
            code = proc.wait()
            how = f"exit code {code}" if code >= 0 else f"signal {-code}"
            key, spec = current or items[0]
            raise ConfigError(f"{key}: loading {spec!r} ended its process ({how}) without a word, at import or in a "
                              "factory (os._exit, a crash in C code); fix the file")
        if reply[0] == "error":
            key, message = items[reply[1]][0], reply[2]
            raise ConfigError(message if message.startswith(key) else f"{key}: {message}")
    finally:
        kill_worker(proc)


def main() -> int:
    """The throwaway process of check_loadable: ("loading", i) before each item, then ("ok",) or ("error", i,
    one-line message)."""
    requests, replies = serve_streams()
    items, tools_cfg = recv(requests.fileno(), None)
    for i, (key, spec) in enumerate(items):
        send(replies, ("loading", i))
        try:
            if key.startswith("reward."):  # as rewards/loader.py loads it, without importing the scoring code
                if not callable(load_object(spec, what="reward function", key=key, error=RewardError)):
                    raise RewardError(f"reward function {spec!r}: {spec.rpartition(':')[2]!r} is not callable")
            else:
                from spmdrl.tools.registry import load_tool

                load_tool(spec, tools_cfg, schema=False)
        except SpmdrlError as e:
            send(replies, ("error", i, one_line(e)))
            return 0
    send(replies, ("ok",))
    return 0
