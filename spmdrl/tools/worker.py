"""Tools in worker processes, so that multi_turn.tool_timeout_s stops a call whatever it does.

A worker (`spmdrl.tools.worker.main` in a new interpreter, started by spmdrl/process/workers.py like a reward worker) loads every tool
of the runner again from its spec (multi_turn.tools) and answers calls `(id, tool index, arguments)` with
`(id, "ok", text)`, `(id, "bad_output", type name)` or `(id, "error", exception type name, message)`. A sync
tool runs in the worker's main thread, one call at a time; an async tool runs on the worker's event loop, many
calls at once. The rank kills a worker whose call ran past its timeout (SIGKILL of the worker and of every
process under it, spmdrl/process/proctree.py: a C loop, a regex backtrack holding the GIL, a blocked event loop) and
uses a fresh one; a worker that dies in a call (os._exit, a segfault, a signal) fails that call.

Every worker is a subreaper: whatever a call starts (children, new sessions, double forks) is killed when a
sync call returns, or for async tools when no call is running in the worker any more.
"""
from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import queue
import signal
import sys
import threading
import time

from spmdrl.errors import ConfigError
from spmdrl.process.proctree import become_subreaper, has_children, kill_tree
from spmdrl.tools.base import as_text
from spmdrl.process.workers import recv, send, serve_streams, spawn_worker

START_TIMEOUT_S = 120.0  # importing the tools' modules is not a call's time
MODULE = "spmdrl.tools.worker"


class ToolWorker:
    """The rank's handle on one worker process. Replies are put on the queue given with each call, as
    (key, outcome, None, end time) with outcome ("ok", text) | ("bad_output", type name) | ("error", type, message) |
    ("died", how)."""

    def __init__(self, specs: list[str], cfg, env: dict | None = None):
        self.proc = spawn_worker(MODULE, [], env=env)
        self.specs = specs
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = False
        self.dead = ""
        """Why the process ended ('' while it runs)."""
        self.open = 0
        """Calls the runner gave it that have neither answered nor timed out."""
        self.retired = False
        """Takes no new call (an async call of it timed out); killed when `open` is 0."""
        # writes never block the rank: a worker stuck in C code reads nothing, and a pipe holds only 64 KiB
        threading.Thread(target=self._write, args=((specs, cfg),), daemon=True, name="spmdrl-tool-send").start()

    def wait_ready(self) -> None:
        """Block until the worker has loaded the tools; ConfigError (one line, naming multi_turn.tools) when it cannot."""
        if self.ready:
            return
        why = ""
        try:
            reply = recv(self.proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S)
        except TimeoutError:
            reply, why = None, f"did not load them within {START_TIMEOUT_S:g}s"
        except (OSError, pickle.UnpicklingError, EOFError, ValueError) as e:
            reply, why = None, f"wrote something unreadable ({type(e).__name__})"
        if reply is None or reply[0] != "ready":
            self.kill()
            self.proc.stdout.close()  # no reader thread yet
            if reply is not None:
                why = f"loading them raised {reply[1]}: {reply[2]}"
            raise ConfigError(f"multi_turn.tools: the tool worker process {why or 'exited'} "
                                  f"({', '.join(self.specs)}); see its output above")
        self.ready = True
        threading.Thread(target=self._read, daemon=True, name="spmdrl-tool-read").start()

    def submit(self, call_id: int, key, done: queue.SimpleQueue, index: int, arguments: dict) -> None:
        try:
            data = pickle.dumps((call_id, index, arguments), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # an argument from the data row that does not pickle
            done.put((key, ("error", type(e).__name__, str(e)), None, time.monotonic()))
            return
        with self._lock:
            if self.dead:
                done.put((key, ("died", self.dead), None, time.monotonic()))
                return
            self._inflight[call_id] = (key, done)
        self.open += 1
        self._outbox.put(data)

    def _write(self, first) -> None:
        try:
            send(self.proc.stdin, first)
            while True:
                data = self._outbox.get()
                if data is None:
                    return
                self.proc.stdin.write(len(data).to_bytes(8, "little") + data)
                self.proc.stdin.flush()
        except (OSError, ValueError):  # the worker is gone; the reader reports it
            pass

    def _read(self) -> None:
        fd = self.proc.stdout.fileno()
        while True:
            try:
                msg = recv(fd, None)
            except Exception:  # something other than a reply on the pipe
                msg = None
            if msg is None:
                break
            with self._lock:
                entry = self._inflight.pop(msg[0], None)
            if entry is not None:
                entry[1].put((entry[0], tuple(msg[1:]), None, time.monotonic()))
        self.proc.stdout.close()
        code = self.proc.wait()
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        with self._lock:
            self.dead = how
            entries, self._inflight = list(self._inflight.values()), {}
        for key, done in entries:
            done.put((key, ("died", how), None, time.monotonic()))

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the worker and everything under it. Its stdout is left to the reader thread, which closes it
        at end of input (closed here, the descriptor's number could be reused under the reader)."""
        self._outbox.put(None)
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        self.proc.wait()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.dead = self.dead or "killed"


# ---- the worker process -------------------------------------------------------------------------------------

def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]


def _outcome(fn, arguments: dict):
    try:
        value = fn(**arguments)
        if inspect.isawaitable(value):  # a sync callable that returns a coroutine
            value = asyncio.run(_awaited(value))
    except BaseException as e:  # SystemExit and KeyboardInterrupt included: the call's result
        return ("error", type(e).__name__, _one_line(e))
    return _as_reply(value)


def _as_reply(value):
    text = as_text(value)
    return ("bad_output", type(value).__name__) if text is None else ("ok", text)


async def _awaited(awaitable):
    return await awaitable


async def _outcome_async(fn, arguments: dict):
    try:
        value = await fn(**arguments)
    except BaseException as e:  # raised out of a task, SystemExit would stop the loop
        return ("error", type(e).__name__, _one_line(e))
    return _as_reply(value)


def main() -> int:
    parent = os.getppid()
    requests, replies = serve_streams(ignore_sigterm=False)
    if os.getppid() != parent:
        return 0
    become_subreaper()
    stdout = sys.stdout
    fd = requests.fileno()
    specs, cfg = recv(fd, None)
    try:
        from spmdrl.tools.registry import load_tool

        fns = [load_tool(spec, cfg, schema=False).fn for spec in specs]
    except BaseException as e:  # noqa: BLE001 - sys.exit or Ctrl-C in a tool module is a load failure too
        send(replies, ("error", type(e).__name__, _one_line(e)))
        return 1
    write = threading.Lock()

    def reply(call_id: int, outcome) -> None:
        try:
            data = pickle.dumps((call_id, *outcome), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            data = pickle.dumps((call_id, "error", type(e).__name__, _one_line(e)))
        with write:
            replies.write(len(data).to_bytes(8, "little") + data)
            replies.flush()

    loop: asyncio.AbstractEventLoop | None = None
    running = [0]  # async calls in flight (touched on the loop's thread only)

    def async_done(call_id: int, task: asyncio.Task) -> None:
        running[0] -= 1
        reply(call_id, task.result())
        if not running[0] and has_children():
            kill_tree(os.getpid(), include_root=False)

    send(replies, ("ready",))
    while True:
        msg = recv(fd, None)
        if msg is None:  # the rank closed the pipe or is gone
            return 0
        call_id, index, arguments = msg
        fn = fns[index]
        if sys.stdout is not stdout or stdout.closed:  # a tool replaced or closed it
            stdout = sys.stdout = os.fdopen(os.dup(2), "w", buffering=1)
        if inspect.iscoroutinefunction(fn):
            if loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, daemon=True, name="spmdrl-tool-loop").start()

            def start(call_id=call_id, fn=fn, arguments=arguments):
                running[0] += 1
                task = loop.create_task(_outcome_async(fn, arguments))
                task.add_done_callback(lambda t: async_done(call_id, t))
            loop.call_soon_threadsafe(start)
            continue
        outcome = _outcome(fn, arguments)
        if has_children():  # nothing the call started outlives it
            kill_tree(os.getpid(), include_root=False)
        reply(call_id, outcome)


if __name__ == "__main__":
    sys.exit(main())
