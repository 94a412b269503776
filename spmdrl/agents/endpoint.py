"""The OpenAI-compatible endpoint of a rollout group's leader rank: a loopback HTTP server whose requests become
admissions into the group's stepped engine (agents/sessions.py steps it on every rank).

Paths: `/sessions/<id>/v1/chat/completions` and `/sessions/<id>/v1/completions` (plain and streamed),
`/sessions/<id>/v1/models`, and `POST /sessions/<id>/reward` (also under `.../v1/reward`: the session's reward,
`{"reward": <number>}`) for a training session (its calls are captured, agents/capture.py); `spmdrl serve` serves
the same under `/v1/` without capture and without rewards.

Streaming. A streamed request gets its text as the engine samples it: the engine loop hands the HTTP thread each
step's new tokens (`step(partial=True)`), the thread decodes them (`TextStream`) and sends what can no longer
change. Held back until it can: an incomplete character (a multi-byte character split over tokens), text that may
still become a tool call (`<tool_call>` or its beginning at the end) or one of the agent's stop strings, and
trailing whitespace. Tool calls are parsed once the completion is finished and sent then, as `tool_calls` deltas
before the last chunk (a call's text is never streamed as content). The deltas put together are exactly the
content of the same reply unstreamed; the trained ids and log-probs are the finished completion's.

Every request needs the run's secret as its bearer token (401 otherwise). A request that cannot be served gets a
4xx with one line (`{"error": {"message": ...}}`) and one line in the log; nothing a request sends reaches the engine loop except a well-formed admission.

The run fixes the sampling: temperature, top_p, top_k and the seed are the run's (an agent's values are ignored);
n > 1, logit_bias, presence / frequency penalties, response_format and a forced tool_choice are refused (they
would sample from another distribution than the one trained on); max_tokens (max_completion_tokens) and stop
are honoured within the run's budget. Under tool_choice "none" the model samples as always and a call it writes
comes back as text. Other fields (parallel_tool_calls, store, metadata, user, ...) are ignored.
"""
from __future__ import annotations

import hmac
import itertools
import json
import logging
import math
import queue
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from spmdrl.agents.capture import Call, CallError, ChatRender, Session, assistant_message
from spmdrl.rollout.base import Completion, SamplingSpec
from spmdrl.tools.parse import OPEN, stop_strings

logger = logging.getLogger("spmdrl.agents")

SERVED_MODEL = "policy"
REFUSED = {"logit_bias": "logit_bias", "presence_penalty": "a presence penalty",
           "frequency_penalty": "a frequency penalty", "response_format": "response_format (guided decoding)"}
_PATH = re.compile(r"^(?:/sessions/(?P<sid>[A-Za-z0-9_.-]+))?(?P<v1>/v1)?/(?P<what>chat/completions|completions|models"
                   r"|reward)/?$")


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
    reward: float | None = None
    """The last reward the agent posted (POST .../reward), None if it posted none."""


class Admissions:
    """Between the HTTP threads and the engine loop: requests to admit, requests to abort, and the futures the
    HTTP threads wait on."""

    def __init__(self):
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self.futures: dict[str, Future] = {}
        self.streams: dict[str, queue.SimpleQueue] = {}
        """Streamed requests: their new tokens, step by step, then None once the future is set."""
        self._ids = itertools.count()
        self.wake = threading.Event()

    def submit(self, context: list[int], spec: SamplingSpec, tokens: queue.SimpleQueue | None = None
               ) -> tuple[str, Future]:
        """Queue a request for the engine loop; `tokens` (a streamed request): where its new tokens go."""
        rid = f"agent-{next(self._ids)}"
        fut: Future = Future()
        with self._lock:
            self.futures[rid] = fut
            if tokens is not None:
                self.streams[rid] = tokens
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
            fut, q = self.futures.pop(rid, None), self.streams.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(CallError(400, f"the engine refused the request: {' '.join(str(e).split())[:200]}"))
        if q is not None:
            q.put(None)

    def deliver(self, c: Completion) -> None:
        """A finished (or aborted) request's completion; a running one's new tokens (c.finished False) go to its
        stream, if it has one."""
        with self._lock:
            if not c.finished:
                q = self.streams.get(c.id)
                if q is not None:
                    q.put(c.token_ids)
                return
            fut, q = self.futures.pop(c.id, None), self.streams.pop(c.id, None)
        if fut is not None and not fut.done():
            fut.set_result(c)
        if q is not None:
            q.put(None)


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
        """(status, payload) with payload a dict (JSON) or an iterator of dicts (a stream: its first events are
        produced lazily, as the engine samples); CallError for refusals."""
        m = _PATH.match(path.split("?", 1)[0])
        if m is None or (m.group("what") != "reward" and not m.group("v1")):
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
        elif what == "reward":
            raise CallError(404, "this endpoint serves a model without sessions: there is no reward to post")
        if what == "models":
            if method != "GET":
                raise CallError(405, "use GET for /v1/models")
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "spmdrl"}]}
        if method != "POST":
            raise CallError(405, f"use POST for /{what}")
        try:
            req = json.loads(body or b"")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CallError(400, f"the request body is not valid JSON ({getattr(e, 'msg', type(e).__name__)})") from None
        if not isinstance(req, dict):
            raise CallError(400, "the request body must be a JSON object")
        if what == "reward":
            return 200, self._post_reward(sid, st, req)
        if st is not None:
            with st.session.lock:
                st.calls += 1
                if st.calls > self.limits.max_calls:
                    raise CallError(429, f"session {sid} made more than {self.limits.max_calls} calls (agent.max_calls)")
        session = st.session if st is not None else Session(self.render, max_prompt_tokens=self.max_prompt_tokens,
                                                            max_response_tokens=self.max_response_tokens, fmt=self.fmt)
        spec, stops, max_tokens = self._sampling(req)
        stream = req.get("stream", False)
        if stream not in (True, False, None):
            raise CallError(400, f"stream={stream!r} must be true or false")
        include_usage = bool(stream) and bool((req.get("stream_options") or {}).get("include_usage"))
        chat = what == "chat/completions"
        if chat:
            tools = req.get("tools") or None
            if tools is not None and not isinstance(tools, list):
                raise CallError(400, "tools must be a list of function schemas")
            tool_choice = req.get("tool_choice", "auto")
            if tool_choice not in ("auto", "none", None):
                raise CallError(400, "tool_choice other than auto or none is refused: the run samples without "
                                     "forcing calls")
            call = session.prepare(req.get("messages"), tools, max_tokens)
        else:
            call = session.prepare_text(req.get("prompt"), max_tokens)
            tool_choice = None
        # tool_choice "none": the model samples as always; a call it writes comes back as text, not as tool_calls
        reply = Reply(self, call, session, st, stops, chat, include_usage, calls=chat and tool_choice != "none")
        try:
            reply.submit(replace(spec, max_tokens=call.max_tokens), stream=bool(stream))
            if stream:
                return 200, reply.events()
            return 200, reply.body(reply.wait())
        except BaseException:
            reply.release()
            raise

    def _post_reward(self, sid: str, st: SessionState, req: dict) -> dict:
        """POST /sessions/<id>/reward {"reward": <number>}: the session's reward (the last one posted counts)."""
        value = req.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise CallError(400, f"post {{\"reward\": <a finite number>}}, not reward={value!r}"[:200])
        with self._lock:  # with close_session: a post either counts or is refused
            if st.closed:
                raise CallError(404, "the session ended")
            st.reward = float(value)
        return {"session": sid, "reward": float(value)}

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


class Reply:
    """One call's way through the engine: admitted (`submit`), then either waited for whole (`wait`, `body`) or
    streamed (`events`). Its branch is rolled back (`release`) unless its completion was recorded."""

    def __init__(self, ep: Endpoint, call: Call, session: Session, st: SessionState | None, stops: list[str],
                 chat: bool, include_usage: bool = False, calls: bool = True):
        self.ep, self.call, self.session, self.st, self.stops, self.chat = ep, call, session, st, stops, chat
        self.include_usage = include_usage
        self.calls = chat and calls
        """Whether tool calls in the text become the reply's tool_calls (not under tool_choice "none")."""
        self.rid, self.fut, self.tokens = "", None, None
        self.recorded = False
        self.result: tuple | None = None
        """What session.finish returned: (text, tool calls, finish_reason)."""
        self.created = int(time.time())

    def submit(self, spec: SamplingSpec, stream: bool) -> None:
        if self.call.max_tokens < 1:
            raise CallError(400, "no tokens left in this trajectory's budget (data.max_response_length)")
        self.tokens = queue.SimpleQueue() if stream else None
        with self.ep._lock:  # with close_session: a request is either refused here or aborted there
            if self.st is not None and self.st.closed:
                raise CallError(404, "the session ended")
            self.rid, self.fut = self.ep.admissions.submit(self.call.context, spec, self.tokens)
            if self.st is not None:
                self.st.rids.add(self.rid)

    def _left(self) -> float | None:
        return None if self.st is None else max(0.0, self.st.deadline - time.monotonic())

    def _timed_out(self) -> CallError:
        self.ep.admissions.abort([self.rid])
        return CallError(408, "the session's time ran out while this call was sampled (agent.timeout_s)")

    def wait(self) -> Completion:
        """The finished completion, recorded on the session's branch."""
        try:
            c = self.fut.result(timeout=self._left())
        except FutureTimeout:
            raise self._timed_out() from None
        finally:
            if self.st is not None:
                self.st.rids.discard(self.rid)
        if c.finish_reason == "abort":
            raise CallError(408, "the call was taken back: its session ended")
        self.result = self.session.finish(self.call, c.token_ids, c.logprobs, c.finish_reason, self.ep.stop_ids,
                                          self.stops, c.routes, c.versions, parse_calls=self.calls)
        self.recorded = True
        return c

    def release(self) -> None:
        """A call that got no completion recorded: its branch back to before it; its request aborted if still in
        the engine."""
        if self.recorded:
            return
        self.recorded = True
        if self.rid and self.fut is not None and not self.fut.done():
            self.ep.admissions.abort([self.rid])
        if self.st is not None and self.rid:
            self.st.rids.discard(self.rid)
        self.session.release(self.call)

    def _usage(self, c: Completion) -> dict:
        n = len(self.call.context)
        return {"prompt_tokens": n, "completion_tokens": len(c.token_ids), "total_tokens": n + len(c.token_ids)}

    def body(self, c: Completion) -> dict:
        text, calls, reason = self.result
        rid = f"{'chatcmpl' if self.chat else 'cmpl'}-{c.id}"
        ep = self.ep
        if not self.chat:
            return {"id": rid, "object": "text_completion", "created": self.created, "model": ep.model_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}],
                    "usage": self._usage(c)}
        return {"id": rid, "object": "chat.completion", "created": self.created, "model": ep.model_name,
                "choices": [{"index": 0, "message": assistant_message(text, calls, ep.fmt), "finish_reason": reason,
                             "logprobs": None}], "usage": self._usage(c)}

    def _chunk(self, delta, finish=None) -> dict:
        rid, ep = f"{'chatcmpl' if self.chat else 'cmpl'}-{self.rid}", self.ep
        if self.chat:
            return {"id": rid, "object": "chat.completion.chunk", "created": self.created, "model": ep.model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return {"id": rid, "object": "text_completion", "created": self.created, "model": ep.model_name,
                "choices": [{"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}]}

    def events(self) -> Iterator[dict]:
        """The streamed reply: the role (chat), the text as it is sampled, then (once finished) the rest of the
        content, the tool calls and the finish reason. Closing it early (the client went away) aborts the request
        and rolls its branch back."""
        text = TextStream(self.ep.render, self.ep.stop_ids, self.stops, calls=self.calls)
        try:
            if self.chat:
                yield self._chunk({"role": "assistant", "content": ""})
            while True:
                try:
                    new = self.tokens.get(timeout=self._left())
                except queue.Empty:
                    raise self._timed_out() from None
                if new is None:
                    break
                delta = text.feed(new)
                if delta:
                    yield self._chunk({"content": delta} if self.chat else delta)
            c = self.wait()
            shown, calls, reason = self.result
            message = assistant_message(shown, calls, self.ep.fmt) if self.chat else {"content": shown}
            rest = text.rest(message["content"] or "")
            if rest:
                yield self._chunk({"content": rest} if self.chat else rest)
            for k, tc in enumerate(message.get("tool_calls") or []):
                yield self._chunk({"tool_calls": [{"index": k, **tc}]})
            yield self._chunk({} if self.chat else "", reason)
            if self.include_usage:
                yield {**self._chunk({} if self.chat else ""), "choices": [], "usage": self._usage(c)}
        finally:
            self.release()


class TextStream:
    """A completion's text for a streamed reply, from its tokens as they are sampled: `feed` takes a step's new ids
    and returns the text that can be sent now; `rest` the remainder once the reply's content is known.

    Decoding is incremental over a window that starts where the last complete text ended (so a tokenizer that
    decodes a token differently by what precedes it is read in context), and a window whose text ends in U+FFFD (a
    multi-byte character cut between tokens) waits for the next token. Of the decoded text, sent is what cannot
    change any more: up to the first of the agent's stop strings, in a chat reply up to the first `<tool_call>`,
    less an ending that may still grow into one of those, and in a chat reply less trailing whitespace (the content
    before a tool call is returned without it). Stop tokens (EOS) end the text; they are not in it."""

    def __init__(self, render: ChatRender, stop_ids: set, stops: list[str], calls: bool):
        self.render, self.stop_ids, self.stops, self.calls = render, stop_ids, list(stops), calls
        self.marks = [*self.stops, OPEN] if calls else list(self.stops)
        self.ids: list[int] = []
        self.start = self.read = 0
        self.text = ""
        self.sent = ""

    def feed(self, ids: list[int]) -> str:
        self.ids += [t for t in ids if t not in self.stop_ids]
        before = self.render.decode(self.ids[self.start: self.read])
        after = self.render.decode(self.ids[self.start:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.start, self.read = self.read, len(self.ids)
        safe = self.visible(self.text)
        if not safe.startswith(self.sent):  # cannot happen with prefix-stable decoding; never send what is wrong
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def visible(self, text: str) -> str:
        for s in self.stops:
            at = text.find(s)
            if at >= 0:
                text = text[:at]
        if self.calls and OPEN in text:
            text = text[: text.find(OPEN)]
        for k in range(max(0, len(text) - max(map(len, self.marks), default=0)), len(text)):
            if any(m.startswith(text[k:]) for m in self.marks):  # the earliest ending that may grow into a mark
                text = text[:k]
                break
        return text.rstrip() if self.calls else text

    def rest(self, content: str) -> str:
        """What remains to send of the reply's final content (after what was streamed)."""
        if not content.startswith(self.sent):  # what was sent is always a beginning of it (see visible)
            logger.warning("agent endpoint: a streamed reply's text diverged from its completion's; "
                           "the rest is not sent")
            return ""
        return content[len(self.sent):]


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
            first = None if isinstance(payload, dict) else next(payload, None)  # a stream's faults before its first
        except CallError as e:                                                  # event are plain HTTP errors
            return self._error(sid, e)
        except Exception as e:  # a bug here must cost one request, never the rank
            return self._error(sid, e)
        if isinstance(payload, dict):
            return self._json(status, payload)
        self._stream(first, payload, sid)

    def _error(self, sid: str, e: Exception, streaming: bool = False) -> None:
        """One line to the log and to the client: an HTTP error, or an error event in a stream already begun."""
        ep = self.endpoint
        if isinstance(e, CallError):
            status, message = e.status, str(e)
            ep.fault(f"session {sid}", status, message, ep.sessions.get(sid))
        else:
            logger.debug("agent endpoint request failed", exc_info=True)
            status, message = 500, f"internal error ({type(e).__name__})"
            ep.fault(f"session {sid}", 500, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
        error = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                           "code": status}}
        if not streaming:
            return self._json(status, error, close=True)
        try:
            self.wfile.write(b"data: " + json.dumps(error).encode() + b"\n\n")
            self.wfile.flush()
        except OSError:
            pass

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

    def _stream(self, first: dict | None, events: Iterator[dict], sid: str) -> None:
        """Server-sent events, each sent as it is produced; `[DONE]` after the last. A fault after the first event
        is an error event (the status is sent already); a client that goes away closes `events` (its request is
        aborted)."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for e in itertools.chain([first] if first is not None else [], events):
                    self.wfile.write(b"data: " + json.dumps(e).encode() + b"\n\n")
                    self.wfile.flush()
            except OSError:  # the client went away: below
                raise
            except Exception as e:  # CallError included: one line, the stream ends
                self._error(sid, e, streaming=True)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:  # the client went away
            pass
        finally:
            events.close()
        self.close_connection = True

    def do_GET(self):  # noqa: N802
        self._serve("GET")

    def do_POST(self):  # noqa: N802
        self._serve("POST")


_NO_MATCH = re.match(r"(?P<sid>)", "")
