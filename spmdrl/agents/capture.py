"""Token-in/token-out capture of an agent's calls: per session, the branches (trajectories) its calls extend.

An agent resends the whole conversation on every call. A call whose messages start with the messages a branch
has already seen (the earlier calls' messages and the assistant messages the endpoint returned) extends that
branch: the branch's ids are reused exactly as they were sampled and only the new messages are tokenized, as
the chat template writes them after an assistant turn (`ChatRender.suffix`). A call that extends no branch
starts a new one (an edited history, another system prompt): its messages are rendered whole. Tokens the model
sampled carry mask 1 and their rollout log-prob; everything else (the prompt, tool results, user turns and the
template's glue between them) carries mask 0.

The suffix is rendered after a placeholder assistant turn, never after the real history: a template that
rewrites earlier assistant turns (one that strips their reasoning, re-serialises their tool calls) cannot change
ids that were already sampled.
"""
from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass, field

from spmdrl.rollout.trajectory import Trajectory, Turn
from spmdrl.tools.base import ToolCall, ToolResult
from spmdrl.tools.parse import OPEN, parse_tool_calls

TEXT = "\0completions"  # the tools_key of /v1/completions branches
_SENTINEL = "\u2063spmdrl-sentinel\u2063"
ROLES = ("system", "developer", "user", "assistant", "tool")


class CallError(Exception):
    """A request the endpoint answers with an HTTP error: status and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def content_text(content) -> str:
    """A message's content as text: a string, None, or a list of text parts (OpenAI's content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                raise CallError(400, "message content parts must be text parts ({\"type\": \"text\", \"text\": ...}); "
                                     "images and audio are not served")
        return "".join(out)
    raise CallError(400, f"message content must be a string, null or a list of text parts, not {type(content).__name__}")


def _call_key(call) -> tuple:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise CallError(400, "each tool_calls entry must be {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
    fn = call["function"]
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass  # kept as the string it is
    return str(fn.get("name", "")), json.dumps(args, sort_keys=True)


def normalize(m) -> tuple:
    """What decides whether two messages are the same for prefix matching: role, text, tool calls (name and
    arguments as canonical JSON); ids, names and whitespace at the ends of the text are not."""
    if not isinstance(m, dict):
        raise CallError(400, f"each message must be a JSON object, not {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise CallError(400, f"message role {role!r} is not one of {', '.join(ROLES)}")
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise CallError(400, "tool_calls must be a list")
    return role, content_text(m.get("content")).strip(), tuple(_call_key(c) for c in calls)


def template_message(m: dict) -> dict:
    """A message as the chat template takes it (text content; tool calls with their arguments as objects)."""
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": content_text(m.get("content"))}
    if m.get("name"):
        out["name"] = str(m["name"])
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            name, args = _call_key(c)
            calls.append({"type": "function", "function": {"name": name, "arguments": json.loads(args)}})
        out["tool_calls"] = calls
    return out


class ChatRender:
    """The chat template on the endpoint's side: whole conversations (a branch's first call) and the suffix a call
    adds after an assistant turn. One lock: Hugging Face's fast tokenizers are not safe to call from two threads."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lock = threading.Lock()

    def render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template([template_message(m) for m in messages], tools=tools or None,
                                                      tokenize=False, add_generation_prompt=generation_prompt)
        except CallError:
            raise
        except Exception as e:  # the template raised on what the agent sent (a role order it refuses, ...)
            raise CallError(400, f"the model's chat template cannot render these messages ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:200]})") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def full(self, messages: list[dict], tools) -> list[int]:
        with self.lock:
            return self.encode(self.render(messages, tools, True))

    def full_text(self, text: str) -> list[int]:
        with self.lock:
            return self.encode(text)

    def suffix(self, messages: list[dict], tools, sampled_end: str) -> list[int]:
        """The ids after a sampled assistant turn up to the next generation prompt: the end of that message (less
        the stop token the model sampled, `sampled_end`), `messages`, and the generation prompt."""
        with self.lock:
            text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL},
                                *messages], tools, True)
            at = text.find(_SENTINEL)
            if at < 0:
                raise CallError(500, "the chat template dropped the assistant turn it was given; it cannot be served")
            glue = text[at + len(_SENTINEL):]
            if sampled_end and glue.startswith(sampled_end):
                glue = glue[len(sampled_end):]
            return self.encode(glue)

    def decode(self, ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class Branch:
    """One trajectory of a session: what its calls sent and got back, and the token sequence."""

    traj: Trajectory
    tools_key: str
    seen: list[tuple] = field(default_factory=list)
    """The normalized messages of the conversation so far (each call's, then the assistant message returned)."""
    end: str = ""
    """The text of the stop token the last turn sampled ('' when it stopped at a stop string or ran out)."""
    busy: bool = False
    marks: tuple = (0, 0, 0, 0)
    """(len(ids), len(turns), len(seen), len(messages)) before the call in flight: where a fork of it starts, and
    what a call that gets no completion rolls back to."""

    def fork(self) -> "Branch":
        b = Branch(copy.deepcopy(self.traj), self.tools_key, list(self.seen), self.end)
        b.marks = self.marks
        b.rollback()
        return b

    def rollback(self) -> None:
        """Back to where the call in flight started (its glue and messages dropped)."""
        n, t, s, m = self.marks
        traj = self.traj
        traj.ids, traj.mask, traj.logprobs, traj.turns = traj.ids[:n], traj.mask[:n], traj.logprobs[:n], traj.turns[:t]
        traj.versions = traj.versions[:n]
        traj.messages = traj.messages[:m]
        if traj.turns:
            last = traj.turns[-1]
            last.results, last.appended = [], False
        if traj.routes is not None:
            traj.routes = traj.routes[: len(traj.prompt) + n]
        self.seen = self.seen[:s]
        self.busy = False


@dataclass
class Call:
    """One admitted call: its branch, the full context ids and the sampling budget."""

    branch: Branch
    context: list[int]
    max_tokens: int


class Session:
    """The calls of one agent session (thread-safe: an agent may call concurrently)."""

    def __init__(self, render: ChatRender, *, max_prompt_tokens: int, max_response_tokens: int, fmt: str = "hermes",
                 sample: int = 0):
        self.render, self.fmt = render, fmt
        self.max_prompt_tokens, self.max_response_tokens = max_prompt_tokens, max_response_tokens
        self.branches: list[Branch] = []
        self.last: Branch | None = None
        """The branch of the last call that finished: the session's final transcript."""
        self.lock = threading.Lock()
        self.sample = sample
        self.closed = False

    def close(self) -> None:
        """The session ended: its branches take no more calls or completions (what a call still running brings
        back is dropped)."""
        with self.lock:
            self.closed = True

    def prepare(self, messages: list, tools, max_tokens: int | None) -> Call:
        """Match `messages` against the branches; extend one or start a new one; the ids to sample after."""
        if not isinstance(messages, list) or not messages:
            raise CallError(400, "messages must be a non-empty list")
        norm = [normalize(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True)
        with self.lock:
            if self.closed:
                raise CallError(404, "the session ended")
            best = None
            for b in self.branches:
                k = len(b.seen)
                if b.traj.turns and b.tools_key == tools_key and k <= len(norm) and norm[:k] == b.seen:
                    if best is None or k > len(best.seen):
                        best = b
            if best is not None and best.busy:  # a concurrent call from the same point: a branch of its own
                best = best.fork()
                self.branches.append(best)
            if best is None:
                ids = self.render.full(messages, tools)
                if len(ids) > self.max_prompt_tokens:
                    raise CallError(400, f"the prompt renders to {len(ids)} tokens, over the run's "
                                         f"{self.max_prompt_tokens} (data.max_prompt_length)")
                traj = Trajectory(prompt=ids, messages=[template_message(m) for m in messages], seed=0,
                                  sample=self.sample)
                best = Branch(traj, tools_key, marks=(0, 0, 0, len(traj.messages)))
                self.branches.append(best)
            else:
                new = messages[len(best.seen):]
                glue = self.render.suffix(new, tools, best.end)
                t = best.traj
                if len(t.ids) + len(glue) >= self.max_response_tokens:
                    raise CallError(400, f"the conversation reaches {len(t.prompt) + len(t.ids) + len(glue)} tokens: "
                                         "over the run's context for one trajectory (data.max_prompt_length + "
                                         "data.max_response_length)")
                best.marks = (len(t.ids), len(t.turns), len(best.seen), len(t.messages))
                t.ids += glue
                t.mask += [0] * len(glue)
                t.logprobs += [0.0] * len(glue)
                t.versions += t.versions[-1:] * len(glue)  # glue is no model's: it goes with the turn before it
                if t.turns:
                    t.turns[-1].results += [ToolResult(str(m.get("name", "")), content_text(m.get("content")))
                                            for m in new if m.get("role") == "tool"]
                    t.turns[-1].appended = True
                t.messages += [template_message(m) for m in new]
            best.seen = norm
            best.busy = True
            left = self.max_response_tokens - len(best.traj.ids)
            budget = left if max_tokens is None else min(int(max_tokens), left)
            return Call(best, best.traj.prompt + best.traj.ids, budget)

    def prepare_text(self, prompt, max_tokens: int | None) -> Call:
        """A /v1/completions call: a prompt string that extends a branch's text (its prompts and the completions
        returned) reuses that branch's ids and encodes only the rest; a list of token ids that extends a branch's
        ids reuses them and takes the rest as given; anything else starts a branch."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        vocab = len(self.render.tokenizer)
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
                raise CallError(400, f"a token prompt must be a non-empty list of ids in [0, {vocab})")
        elif not isinstance(prompt, str) or not prompt:
            raise CallError(400, "prompt must be a non-empty string or a list of token ids")
        with self.lock:
            if self.closed:
                raise CallError(404, "the session ended")
            best, key = None, None
            for b in self.branches:
                if b.tools_key != TEXT or not b.traj.turns:
                    continue
                if isinstance(prompt, str):
                    text = b.seen[0][1]
                    if prompt.startswith(text) and (best is None or len(text) > len(key)):
                        best, key = b, text
                else:
                    full = b.traj.prompt + b.traj.ids
                    if prompt[: len(full)] == full and (best is None or len(full) > len(key)):
                        best, key = b, full
            if best is not None and best.busy:
                best = best.fork()
                self.branches.append(best)
            if best is None:
                ids = self.render.full_text(prompt) if isinstance(prompt, str) else list(prompt)
                if len(ids) > self.max_prompt_tokens:
                    raise CallError(400, f"the prompt has {len(ids)} tokens, over the run's {self.max_prompt_tokens} "
                                         "(data.max_prompt_length)")
                best = Branch(Trajectory(prompt=ids, messages=[], seed=0, sample=self.sample), TEXT)
                self.branches.append(best)
            else:
                t = best.traj
                if isinstance(prompt, str):
                    with self.render.lock:
                        glue = self.render.encode(prompt[len(key):])
                else:
                    glue = list(prompt[len(key):])
                if len(t.ids) + len(glue) >= self.max_response_tokens:
                    raise CallError(400, "the prompt is over the run's context for one trajectory "
                                         "(data.max_prompt_length + data.max_response_length)")
                best.marks = (len(t.ids), len(t.turns), len(best.seen), 0)
                t.ids += glue
                t.mask += [0] * len(glue)
                t.logprobs += [0.0] * len(glue)
                t.versions += t.versions[-1:] * len(glue)
            best.seen = [("text", prompt if isinstance(prompt, str) else "")]
            best.busy = True
            left = self.max_response_tokens - len(best.traj.ids)
            budget = left if max_tokens is None else min(int(max_tokens), left)
            return Call(best, best.traj.prompt + best.traj.ids, budget)

    def release(self, call: Call) -> None:
        """A call that got no completion (refused, aborted): its branch goes back to before it, and takes calls
        again."""
        with self.lock:
            call.branch.rollback()

    def finish(self, call: Call, token_ids: list[int], logprobs: list[float], reason: str, stop_ids: set,
               stops: list[str], routes=None, versions=None,
               parse_calls: bool = True) -> tuple[str, list[ToolCall], str]:
        """Record a completion on its branch (versions: the weight version that sampled each token); (text
        returned, parsed tool calls, finish_reason). With parse_calls=False (tool_choice "none") no tool calls are
        parsed: the text comes back whole."""
        b, t = call.branch, call.branch.traj
        with self.lock:
            if self.closed:
                raise CallError(408, "the session ended while this call was sampled")
            t.ids += token_ids
            t.mask += [1] * len(token_ids)
            t.logprobs += logprobs if logprobs else [0.0] * len(token_ids)
            t.versions += list(versions) if versions else [0] * len(token_ids)
            if routes is not None:
                t.add_turn_routes(routes)
            end = token_ids[-1] if token_ids and reason == "stop" and token_ids[-1] in stop_ids else None
            body = token_ids[:-1] if end is not None else token_ids
            text = self.render.decode(body)
            b.end = "" if end is None else self.render.decode([end])
            shown = text
            for s in stops:  # the agent's own stop strings: sampled and trained, not returned (as OpenAI does)
                at = shown.find(s)
                if at >= 0:
                    shown = shown[:at]
            if b.tools_key == TEXT:  # a /v1/completions call: its text, no calls
                t.turns.append(Turn(text=text))
                b.seen = [("text", b.seen[0][1] + shown)]
                t.finish = "length" if reason == "length" else "answer"
                b.busy = False
                self.last = b
                return shown, [], reason
            calls = parse_tool_calls(text, self.fmt) if reason == "stop" and parse_calls else []
            t.turns.append(Turn(text=text, calls=calls))
            usable = bool(calls) and not any(c.error for c in calls)
            message = assistant_message(shown, calls if usable else [], self.fmt)
            t.messages.append(template_message(message))
            b.seen = b.seen + [normalize(message)]
            t.finish = "length" if reason == "length" else "answer"
            b.busy = False
            self.last = b
            return shown, calls if usable else [], "tool_calls" if usable else reason

    def trajectories(self) -> list[Trajectory]:
        """Every branch that sampled something, the final one last."""
        with self.lock:
            done = [b for b in self.branches if b.traj.turns]
            if self.last is not None:
                done = [b for b in done if b is not self.last] + [self.last]
            return [b.traj for b in done]


def assistant_message(text: str, calls: list[ToolCall], fmt: str = "hermes") -> dict:
    """The assistant message the endpoint returns: the text before the first call (less trailing whitespace) as
    content, the calls as OpenAI tool_calls (arguments as a JSON string); without calls the whole text."""
    if not calls:
        return {"role": "assistant", "content": text}
    head = (text[: text.find(OPEN)] if OPEN in text else text).rstrip()
    return {"role": "assistant", "content": head or None,
            "tool_calls": [{"id": f"call_{k}", "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for k, c in enumerate(calls)]}
