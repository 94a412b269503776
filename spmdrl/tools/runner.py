"""Run one turn's tool calls: concurrently, each under a timeout, one ToolResult per call whatever happens.

A tool loaded from multi_turn.tools (Tool.spec set) runs in a worker process (tools/worker.py): a sync tool's
calls each in an idle worker of their own, an async tool's calls together on one worker's event loop. A
tool built in Python by the caller (no spec) runs here: a sync one in its own daemon thread, an async one on
one event loop kept in a background thread. At most `max_parallel` calls run at once, the rest wait for a
free slot; a call's timeout counts from its start. A call that runs past it gets a 'timeout' result at once:
its worker process is killed with everything it started (a sync call), or takes no new call and is killed
when its other calls have ended (an async call); in-process, an async call is cancelled and a sync call's
thread is abandoned (Python cannot stop a thread). Nothing a tool does raises out of `run`.
"""
from __future__ import annotations

import asyncio
import inspect
import os
import queue
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from spmdrl.tools.base import Tool, ToolCall, ToolResult, as_text
from spmdrl.tools.worker import ToolWorker

_MAX_ERROR_CHARS = 500
UNKNOWN = "_unknown"
"""The tool name metrics use for calls naming no registered tool (so model-invented names add no keys)."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:_MAX_ERROR_CHARS]


def _data_kwargs(tool_kwargs: dict | None, tool: Tool, accepts: set[str] | None) -> dict:
    """The keywords a data row adds to a call of `tool`: verl's extra_info.tools_kwargs[tool.name], whose
    create_kwargs and execute_kwargs are merged (else the entry is the keywords), kept only where the tool
    function takes them (all of them for a function with **kwargs)."""
    entry = (tool_kwargs or {}).get(tool.name) or {}
    if not isinstance(entry, dict):
        return {}
    if "create_kwargs" in entry or "execute_kwargs" in entry:
        merged = dict(entry.get("create_kwargs") or {})
        merged.update(entry.get("execute_kwargs") or {})
        entry = merged
    if accepts is None:
        return dict(entry)
    return {k: v for k, v in entry.items() if k in accepts}


def _accepted_names(fn) -> set[str] | None:
    """Keyword names fn takes, None if it takes **kwargs (or has no inspectable signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


@dataclass
class _Job:
    key: tuple[int, int]
    tool: Tool
    arguments: dict
    start: float = 0.0
    future: object = None  # an async call's concurrent.futures.Future
    ended: threading.Event | None = None
    worker: ToolWorker | None = None  # the process running it (a tool with a spec)


class ThreadToolRunner:
    """The ToolRunner (tools/base.py) of a rollout rank: worker processes for the tools loaded from a spec,
    threads and one event loop for the others. cfg: the [multi_turn] section the workers load the built-in
    tools with; hidden_dirs: directories the python sandbox must not read (tools/sandbox.py).

    Metrics accumulate until `take_metrics()`: tools/calls, tools/failures, tools/seconds (wall time inside
    `run`), and per tool tools/calls/<tool>, tools/seconds/<tool> (summed call time), tools/failures/<tool>/<kind>
    with kind one of tools.base.FAILURES; calls to unregistered names count under the tool name "_unknown".
    """

    def __init__(self, tools: list[Tool], *, timeout_s: float, max_parallel: int = 16, max_calls_per_turn: int = 4,
                 cfg=None, hidden_dirs: tuple[str, ...] = ()):
        if timeout_s <= 0 or max_parallel < 1 or max_calls_per_turn < 1:
            raise ValueError(f"ThreadToolRunner needs timeout_s > 0, max_parallel >= 1 and max_calls_per_turn >= 1, "
                             f"got {timeout_s}, {max_parallel}, {max_calls_per_turn}")
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        self.timeout_s = float(timeout_s)
        self.max_parallel = int(max_parallel)
        self.max_calls_per_turn = int(max_calls_per_turn)
        self._accepts = {t.name: _accepted_names(t.fn) for t in tools}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._abandoned_async: list = []
        self._counts: dict[str, float] = defaultdict(float)
        self.abandoned_threads = 0
        """Sync calls that ran past their timeout (their threads may still be running)."""
        self._specs = [t.spec for t in tools if t.spec]
        self._index = {t.name: self._specs.index(t.spec) for t in tools if t.spec}
        self._cfg = cfg
        from spmdrl.tools.sandbox import HIDE_ENV

        self._env = {HIDE_ENV: os.pathsep.join(os.path.abspath(d) for d in hidden_dirs)}
        self._idle: list[ToolWorker] = []  # for sync calls
        self._async_worker: ToolWorker | None = None
        self._retired: list[ToolWorker] = []
        self._call_ids = 0

    # ---- the turn ----------------------------------------------------------------------------------------

    def run(self, calls: list[list[ToolCall]], kwargs: list[dict] | None = None) -> list[list[ToolResult]]:
        """One list of results per trajectory, one result per call, in the calls' order. kwargs[i] is
        trajectory i's per-tool keywords (verl's extra_info.tools_kwargs), or None."""
        t0 = time.monotonic()
        if kwargs is not None and len(kwargs) != len(calls):
            raise ValueError(f"ToolRunner.run got {len(calls)} trajectories and {len(kwargs)} kwargs")
        results: list[list[ToolResult | None]] = [[None] * len(turn) for turn in calls]
        jobs: deque[_Job] = deque()
        for i, turn in enumerate(calls):
            for j, call in enumerate(turn):
                early = self._precheck(call, j)
                if early is not None:
                    results[i][j] = early
                    continue
                tool = self.tools[call.name]
                args = dict(call.arguments)
                args.update(_data_kwargs(kwargs[i] if kwargs else None, tool, self._accepts[tool.name]))
                jobs.append(_Job((i, j), tool, args))
        if jobs:
            self._prestart(jobs)
            self._run_jobs(jobs, results)
        for turn in results:
            for r in turn:
                self._count(r)
        self._counts["tools/seconds"] += time.monotonic() - t0
        return results  # type: ignore[return-value]

    def _precheck(self, call: ToolCall, index: int) -> ToolResult | None:
        """The result of a call that is not run, else None."""
        if index >= self.max_calls_per_turn:
            return ToolResult(call.name, f"error: more than {self.max_calls_per_turn} tool calls in one turn; "
                              "this call was not run", "too_many_calls")
        if call.error:
            return ToolResult(call.name, call.error, "malformed")
        if not isinstance(call.arguments, dict):
            return ToolResult(call.name, "error: the tool call's arguments must be a JSON object", "malformed")
        if call.name not in self.tools:
            names = ", ".join(self.tools) or "none"
            return ToolResult(call.name, f"error: unknown tool {call.name!r}; the tools are: {names}", "unknown_tool")
        return None

    def _run_jobs(self, pending: deque[_Job], results: list[list[ToolResult | None]]) -> None:
        done: queue.SimpleQueue = queue.SimpleQueue()  # (key, ok, value, end time); one per run: late ones are lost
        running: dict[tuple[int, int], _Job] = {}
        if not all(ended.is_set() for ended in self._abandoned_async):
            self._replace_loop()  # a cancelled call has not unwound: it may hold the loop (sync code inside)
        self._abandoned_async = []
        while pending or running:
            while pending and len(running) < self.max_parallel:
                job = pending.popleft()
                self._start(job, done)
                running[job.key] = job
            wait = min(job.start for job in running.values()) + self.timeout_s - time.monotonic()
            try:
                key, ok, value, end = done.get(timeout=max(wait, 0.0))
            except queue.Empty:
                now = time.monotonic()
                for key, job in list(running.items()):
                    if now - job.start >= self.timeout_s:
                        del running[key]
                        results[key[0]][key[1]] = self._expire(job)
                continue
            job = running.pop(key, None)
            if job is not None:
                results[key[0]][key[1]] = self._finish(job, ok, value, end)
                self._release(job)

    # ---- calls in worker processes ------------------------------------------------------------------------

    def _new_worker(self) -> ToolWorker:
        return ToolWorker(self._specs, self._cfg, self._env)

    def _prestart(self, jobs) -> None:
        """Start the workers this turn's sync calls need, so that they load at the same time."""
        want = min(sum(1 for j in jobs if j.tool.spec and not j.tool.is_async), self.max_parallel)
        self._idle = [w for w in self._idle if w.alive() or not w.ready]
        self._idle += [self._new_worker() for _ in range(want - len(self._idle))]

    def _submit(self, job: _Job, done: queue.SimpleQueue) -> None:
        if job.tool.is_async:
            if self._async_worker is None or not self._async_worker.alive():
                self._async_worker = self._new_worker()
            worker = self._async_worker
        else:
            worker = self._idle.pop() if self._idle else self._new_worker()
        try:
            worker.wait_ready()  # loading the tools is not the call's time
        except BaseException:
            self._async_worker = None if worker is self._async_worker else self._async_worker
            raise
        job.start = time.monotonic()
        job.worker = worker
        self._call_ids += 1
        worker.submit(self._call_ids, job.key, done, self._index[job.tool.name], job.arguments)

    def _release(self, job: _Job) -> None:
        """A worker call ended (answered or timed out): the worker takes the next call, or is killed."""
        worker = job.worker
        if worker is None:
            return
        worker.open -= 1
        if job.tool.is_async:
            if worker.retired and worker.open <= 0:
                worker.kill()
                self._retired.remove(worker)
        elif worker.alive():
            self._idle.append(worker)

    def _start(self, job: _Job, done: queue.SimpleQueue) -> None:
        job.start = time.monotonic()
        if job.tool.spec:
            self._submit(job, done)
            return
        if job.tool.is_async:
            try:
                coro = job.tool.fn(**job.arguments)  # bad arguments raise here, before any coroutine exists
            except Exception as e:
                done.put((job.key, False, e, time.monotonic()))
                return
            ended = threading.Event()  # set when the coroutine has unwound, whatever the future says
            fut = asyncio.run_coroutine_threadsafe(_tracked(coro, ended), self._event_loop())
            job.future = fut
            job.ended = ended

            def report(f, key=job.key):
                if f.cancelled():
                    return
                e = f.exception()
                done.put((key, e is None, f.result() if e is None else e, time.monotonic()))
            fut.add_done_callback(report)
            return

        def work(key=job.key, fn=job.tool.fn, args=job.arguments):
            try:
                value = fn(**args)
                if inspect.isawaitable(value):  # a sync callable that returns a coroutine
                    value = asyncio.run(_awaited(value))
                done.put((key, True, value, time.monotonic()))
            except BaseException as e:  # handed to the runner as the call's result
                done.put((key, False, e, time.monotonic()))
        threading.Thread(target=work, daemon=True, name=f"spmdrl-tool-{job.tool.name}").start()

    def _finish(self, job: _Job, ok, value, end: float) -> ToolResult:
        seconds = max(end - job.start, 0.0)
        name = job.tool.name
        if isinstance(ok, tuple):  # a worker's outcome
            kind = ok[0]
            if kind == "ok":
                return ToolResult(name, ok[1], "", seconds)
            if kind == "bad_output":
                return ToolResult(name, f"error: tool {name} returned {ok[1]}, not text", "bad_output", seconds)
            if kind == "died":
                return ToolResult(name, f"error: tool {name}'s process died during the call ({ok[1]}); it is "
                                  "replaced", "exception", seconds)
            return ToolResult(name, f"error: {ok[1]}: {_one_line(ok[2]) or '(no message)'}", "exception", seconds)
        if not ok:
            msg = _one_line(value) or "(no message)"
            return ToolResult(name, f"error: {type(value).__name__}: {msg}", "exception", seconds)
        text = as_text(value)
        if text is None:
            return ToolResult(name, f"error: tool {name} returned {type(value).__name__}, not text", "bad_output",
                              seconds)
        return ToolResult(name, text, "", seconds)

    def _expire(self, job: _Job) -> ToolResult:
        if job.worker is not None:
            worker = job.worker
            if job.tool.is_async:  # its loop may be blocked: no new call goes there
                worker.retired = True
                if worker is self._async_worker:
                    self._async_worker = self._new_worker()
                    self._retired.append(worker)
            else:
                worker.kill()  # whatever it is doing, with everything it started
                self._idle.append(self._new_worker())  # loads while the turn goes on
            self._release(job)
        elif job.future is not None:
            job.future.cancel()
            self._abandoned_async.append(job.ended)
        else:
            self.abandoned_threads += 1
        return ToolResult(job.tool.name, f"error: tool {job.tool.name} took longer than {self.timeout_s:g}s and "
                          "was stopped", "timeout", self.timeout_s)

    # ---- the event loop for async tools -------------------------------------------------------------------

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._loop.is_closed() or not self._loop_thread.is_alive():
            loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=loop.run_forever, daemon=True, name="spmdrl-tool-loop")
            self._loop_thread.start()
            self._loop = loop
        return self._loop

    def _replace_loop(self) -> None:
        """Leave a blocked loop to its thread and use a fresh one from now on."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop = None
        self._abandoned_async = []

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        for worker in self._idle + self._retired + [self._async_worker]:
            if worker is not None:
                worker.kill()
        self._idle, self._retired, self._async_worker = [], [], None

    # ---- metrics --------------------------------------------------------------------------------------------

    def _count(self, r: ToolResult) -> None:
        name = r.name if r.name in self.tools else UNKNOWN
        self._counts["tools/calls"] += 1
        self._counts[f"tools/calls/{name}"] += 1
        self._counts[f"tools/seconds/{name}"] += r.seconds
        if r.failure:
            self._counts["tools/failures"] += 1
            self._counts[f"tools/failures/{name}/{r.failure}"] += 1

    def take_metrics(self) -> dict[str, float]:
        """The counters since the last call (calls, failures, seconds; see the class), then reset."""
        out = dict(self._counts)
        self._counts.clear()
        return out


async def _awaited(awaitable):
    return await awaitable


async def _tracked(coro, ended: threading.Event):
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as e:  # raised out of a task, these would stop the shared loop
        raise RuntimeError(f"the tool raised {type(e).__name__}: {e}") from None
    finally:
        ended.set()


def build_tool_runner(cfg, tools: list[Tool] | None = None, *, hidden_dirs: tuple[str, ...] = ()) -> ThreadToolRunner:
    """The rank's ToolRunner for the [multi_turn] section `cfg` (its tools loaded unless given): tools loaded
    from a spec run in worker processes. hidden_dirs: directories the python sandbox must not read (the run's
    output_dir)."""
    from spmdrl.tools.registry import load_tools

    tools = load_tools(cfg.tools, cfg) if tools is None else tools
    return ThreadToolRunner(tools, timeout_s=cfg.tool_timeout_s, max_parallel=cfg.max_parallel_calls,
                            max_calls_per_turn=cfg.max_calls_per_turn, cfg=cfg, hidden_dirs=hidden_dirs)
