"""The OpenAI-compatible endpoint of a rollout group's leader rank: a loopback HTTP server whose requests become
admissions into the group's stepped engine (agents/sessions.py steps it on every rank).

Paths: `/sessions/<id>/v1/chat/completions` (plain and streamed), `/sessions/<id>/v1/completions` and
`/sessions/<id>/v1/models` for a training session (its calls are captured, agents/capture.py); `spmdrl serve`
serves the same under `/v1/` without capture. Every request needs the run's secret as its bearer token (401
otherwise). A request that cannot be served gets a 4xx with one line (`{"error": {"message": ...}}`) and one line
in the log; nothing a request sends reaches the engine loop except a well-formed admission.

The run fixes the sampling: temperature, top_p, top_k and the seed are the run's (an agent's values are ignored);
n > 1, logit_bias, presence / frequency penalties, response_format and a forced tool_choice are refused (they
would sample from another distribution than the one trained on); max_tokens (max_completion_tokens) and stop
are honoured within the run's budget.
"""
from __future__ import annotations

import hmac
import itertools
import json
import logging
import queue
import re
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from spmdrl.agents.capture import Call, CallError, ChatRender, Session, content_text
from spmdrl.rollout.base import Completion, SamplingSpec
from spmdrl.tools.parse import stop_strings

logger = logging.getLogger("spmdrl.agents")

SERVED_MODEL = "policy"
REFUSED = {"logit_bias": "logit_bias", "presence_penalty": "a presence penalty",
           "frequency_penalty": "a frequency penalty", "response_format": "response_format (guided decoding)"}
_PATH = re.compile(r"^(?:/sessions/(?P<sid>[A-Za-z0-9_.-]+))?/v1/(?P<what>chat/completions|completions|models)/?$")


@dataclass
class Limits:
    max_request_bytes: int = 1 << 20
    max_calls: int = 64
    """Calls one session may make (429 after)."""
    max_stop: int = 4


@dataclass
class SessionState:
    session: Session
    deadline: float
    calls: int = 0
    closed: bool = False
    rids: set = field(default_factory=set)
    """Its requests in the engine."""
    errors: list = field(default_factory=list)
    """The one-line faults of its calls (what the log got)."""


class Admissions:
    """Between the HTTP threads and the engine loop: requests to admit, requests to abort, and the futures the
    HTTP threads wait on."""

    def __init__(self):
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self.futures: dict[str, Future] = {}
        self._ids = itertools.count()
        self.wake = threading.Event()

    def submit(self, context: list[int], spec: SamplingSpec) -> tuple[str, Future]:
        rid = f"agent-{next(self._ids)}"
        fut: Future = Future()
        with self._lock:
            self.futures[rid] = fut
        self._new.put((rid, context, spec))
        self.wake.set()
        return rid, fut

    def abort(self, rids) -> None:
        with self._lock:
            self._aborts.update(r for r in rids if r in self.futures)
        self.wake.set()

    def drop_stale(self) -> None:
        """Fail whatever is queued and not admitted (a request that raced its session's end): before a rollout."""
        new, _ = self.take()
        for rid, _, _ in new:
            self.fail(rid, RuntimeError("its session ended before it was admitted"))

    def take(self) -> tuple[list, list[str]]:
        new = []
        while True:
            try:
                new.append(self._new.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            aborts, self._aborts = sorted(self._aborts), set()
        self.wake.clear()
        return new, aborts

    def fail(self, rid: str, e: Exception) -> None:
        with self._lock:
            fut = self.futures.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(CallError(400, f"the engine refused the request: {' '.join(str(e).split())[:200]}"))

    def deliver(self, c: Completion) -> None:
        with self._lock:
            fut = self.futures.pop(c.id, None)
        if fut is not None and not fut.done():
            fut.set_result(c)


class Endpoint:
    """The HTTP server (started by `start`, on 127.0.0.1) and the sessions it serves.

    spec: the run's sampling spec (its temperature, top_p, top_k, stop strings and stop ids); stop_ids: the token
    ids that end a turn and are not part of its text (EOS); capture: False serves `/v1/` without sessions
    (`spmdrl serve`)."""

    def __init__(self, render: ChatRender, spec: SamplingSpec, stop_ids: set, secret: str, *, fmt: str = "hermes",
                 limits: Limits | None = None, capture: bool = True, max_prompt_tokens: int = 1024,
                 max_response_tokens: int = 1024, model_name: str = SERVED_MODEL):
        self.render, self.spec, self.stop_ids, self.secret, self.fmt = render, spec, set(stop_ids), secret, fmt
        self.limits, self.capture, self.model_name = limits or Limits(), capture, model_name
        self.max_prompt_tokens, self.max_response_tokens = max_prompt_tokens, max_response_tokens
        self.admissions = Admissions()
        self.sessions: dict[str, SessionState] = {}
        self._lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.faults = 0

    # ------------------------------------------------------------------------------------------------ server

    def start(self, port: int = 0) -> str:
        """Serve on 127.0.0.1:port (0: a free port) in a daemon thread; the base URL (no path)."""
        endpoint = self

        class Handler(_Handler):
            pass

        Handler.endpoint = endpoint
        self.server = _Server(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
                         name="spmdrl-agent-endpoint").start()
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # ------------------------------------------------------------------------------------------------ sessions

    def open_session(self, sid: str, session: Session, timeout_s: float) -> None:
        with self._lock:
            self.sessions[sid] = SessionState(session, time.monotonic() + timeout_s)

    def close_session(self, sid: str) -> SessionState:
        """No more calls; its requests still in the engine are aborted."""
        with self._lock:
            st = self.sessions.pop(sid)
            st.closed = True
            rids = list(st.rids)
        st.session.close()
        self.admissions.abort(rids)
        return st

    def fault(self, where: str, status: int, message: str, st: SessionState | None = None) -> None:
        self.faults += 1
        line = f"agent endpoint {where}: {status} {message}"
        if st is not None:
            st.errors.append(line)
        logger.warning(line)

    # ------------------------------------------------------------------------------------------------ requests

    def handle(self, method: str, path: str, headers, body: bytes | None):
        """(status, payload) with payload a dict (JSON) or a list of dicts (a stream); CallError for refusals."""
        m = _PATH.match(path.split("?", 1)[0])
        if m is None:
            raise CallError(404, f"no such path {path[:100]!r}: use /v1/chat/completions, /v1/completions or /v1/models "
                                 "under the base URL you were given")
        auth = headers.get("Authorization", "")
        token = auth[7:].strip() if auth.startswith("Bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.secret.encode()):
            raise CallError(401, "missing or wrong API key: pass the key you were given (OPENAI_API_KEY)")
        sid, what = m.group("sid"), m.group("what")
        st = None
        if self.capture:
            if sid is None:
                raise CallError(404, "this endpoint serves agent sessions: use the base URL you were given "
                                     "(OPENAI_BASE_URL, with its /sessions/<id>/v1)")
            with self._lock:
                st = self.sessions.get(sid)
            if st is None:
                raise CallError(404, f"session {sid} is not running (it ended or timed out)")
        if what == "models":
            if method != "GET":
                raise CallError(405, "use GET for /v1/models")
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "spmdrl"}]}
        if method != "POST":
            raise CallError(405, f"use POST for /v1/{what}")
        try:
            req = json.loads(body or b"")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CallError(400, f"the request body is not valid JSON ({getattr(e, 'msg', type(e).__name__)})") from None
        if not isinstance(req, dict):
            raise CallError(400, "the request body must be a JSON object")
        if st is not None:
            with st.session.lock:
                st.calls += 1
                if st.calls > self.limits.max_calls:
                    raise CallError(429, f"session {sid} made more than {self.limits.max_calls} calls (agent.max_calls)")
        session = st.session if st is not None else Session(self.render, max_prompt_tokens=self.max_prompt_tokens,
                                                            max_response_tokens=self.max_response_tokens, fmt=self.fmt)
        spec, stops, max_tokens = self._sampling(req)
        chat = what == "chat/completions"
        if chat:
            tools = req.get("tools") or None
            if tools is not None and not isinstance(tools, list):
                raise CallError(400, "tools must be a list of function schemas")
            if req.get("tool_choice", "auto") not in ("auto", "none", None):
                raise CallError(400, "tool_choice other than auto or none is refused: the run samples without "
                                     "forcing calls")
            call = session.prepare(req.get("messages"), tools, max_tokens)
        else:
            call = session.prepare_text(req.get("prompt"), max_tokens)
        try:
            completion = self._sample(call, replace(spec, max_tokens=call.max_tokens), st)
        except BaseException:
            session.release(call)
            raise
        text, calls, reason = session.finish(call, completion.token_ids, completion.logprobs,
                                             completion.finish_reason, self.stop_ids, stops, completion.routes)
        usage = {"prompt_tokens": len(call.context), "completion_tokens": len(completion.token_ids),
                 "total_tokens": len(call.context) + len(completion.token_ids)}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{completion.id}"
        created = int(time.time())
        if not chat:
            return 200, {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                         "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}],
                         "usage": usage}
        from spmdrl.agents.capture import assistant_message

        message = assistant_message(text, calls, self.fmt)
        if not req.get("stream"):
            return 200, {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                         "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
                         "usage": usage}
        return 200, _chunks(rid, created, self.model_name, message, reason)

    def _sampling(self, req: dict) -> tuple[SamplingSpec, list[str], int | None]:
        n = req.get("n", 1)
        if n not in (1, None):
            raise CallError(400, f"n={n!r} is refused: one choice per request (make n requests)")
        for key, what in REFUSED.items():
            v = req.get(key)
            if v not in (None, 0, 0.0, {}, []) and not (key == "response_format" and isinstance(v, dict)
                                                        and v.get("type") == "text"):
                raise CallError(400, f"{what} is refused: the run samples from the policy as it is trained")
        mt = req.get("max_completion_tokens", req.get("max_tokens"))
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
            raise CallError(400, f"max_tokens={mt!r} must be a positive integer")
        stop = req.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or \
                len(stop) > self.limits.max_stop:
            raise CallError(400, f"stop must be a string or a list of at most {self.limits.max_stop} non-empty strings")
        spec = replace(self.spec, n=1, stop=list(dict.fromkeys([*self.spec.stop, *stop_strings(self.fmt), *stop])))
        return spec, stop, mt

    def _sample(self, call: Call, spec: SamplingSpec, st: SessionState | None) -> Completion:
        if call.max_tokens < 1:
            raise CallError(400, "no tokens left in this trajectory's budget (data.max_response_length)")
        with self._lock:  # with close_session: a request is either refused here or aborted there
            if st is not None and st.closed:
                raise CallError(404, "the session ended")
            rid, fut = self.admissions.submit(call.context, spec)
            if st is not None:
                st.rids.add(rid)
        try:
            left = None if st is None else max(0.0, st.deadline - time.monotonic())
            c = fut.result(timeout=left)
        except FutureTimeout:
            self.admissions.abort([rid])
            raise CallError(408, "the session's time ran out while this call was sampled (agent.timeout_s)") from None
        finally:
            if st is not None:
                st.rids.discard(rid)
        if c.finish_reason == "abort":
            raise CallError(408, "the call was taken back: its session ended")
        return c


def _chunks(rid: str, created: int, model: str, message: dict, reason: str) -> list[dict]:
    """A finished completion as chat.completion.chunk events: the role, the content, the tool calls, the end."""
    def chunk(delta, finish=None):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        out.append(chunk({"content": message["content"]}))
    for k, c in enumerate(message.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": k, **c}]}))
    out.append(chunk({}, reason))
    return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # a rollout's sessions connect at once: a short accept queue resets connections


class _Handler(BaseHTTPRequestHandler):
    endpoint: Endpoint
    protocol_version = "HTTP/1.1"
    server_version = "spmdrl"
    timeout = 60  # seconds a client may take to send its request (a stalled one costs its own thread only)

    def log_message(self, fmt, *args):  # the endpoint logs its own faults, one line each
        pass

    def _body(self) -> bytes | None:
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            n = int(length)
        except ValueError:
            raise CallError(400, "Content-Length is not a number") from None
        if n > self.endpoint.limits.max_request_bytes:
            raise CallError(413, f"the request has {n} bytes, over the {self.endpoint.limits.max_request_bytes} "
                                 "allowed (agent.max_request_kb)")
        return self.rfile.read(n)

    def _serve(self, method: str) -> None:
        ep = self.endpoint
        sid = (_PATH.match(self.path.split("?", 1)[0]) or _NO_MATCH).groupdict().get("sid") or "-"
        try:
            body = self._body() if method == "POST" else None
            status, payload = ep.handle(method, self.path, self.headers, body)
        except CallError as e:
            st = ep.sessions.get(sid)
            ep.fault(f"session {sid}", e.status, str(e), st)
            return self._json(e.status, {"error": {"message": str(e), "type": "invalid_request_error",
                                                   "code": e.status}}, close=True)
        except Exception as e:  # a bug here must cost one request, never the rank
            logger.debug("agent endpoint request failed", exc_info=True)
            ep.fault(f"session {sid}", 500, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
            return self._json(500, {"error": {"message": f"internal error ({type(e).__name__})", "code": 500}}, close=True)
        if isinstance(payload, list):
            return self._stream(payload)
        self._json(status, payload)

    def _json(self, status: int, payload: dict, close: bool = False) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away
            self.close_connection = True

    def _stream(self, events: list[dict]) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for e in events:
                self.wfile.write(b"data: " + json.dumps(e).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            pass
        self.close_connection = True

    def do_GET(self):  # noqa: N802
        self._serve("GET")

    def do_POST(self):  # noqa: N802
        self._serve("POST")


_NO_MATCH = re.match(r"(?P<sid>)", "")
