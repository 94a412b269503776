"""One multi-turn trajectory: the token sequence after the prompt (model ids and tool/glue ids, with which is
which), its turns as text (the model's text, the calls parsed from it, their results), and with route capture
the experts the rollout engine routed each position to (`Trajectory.add_turn_routes`).

The turns travel with the batch as a JSON document per sample packed into an int64 tensor (`pack_texts`), so
they survive the batch moves between role layouts and split placement's transfers like every other tensor, and
the reward function and the hooks on the training ranks see them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from spmdrl.tools.base import ToolCall, ToolResult

FINISHES = ("answer", "turn_limit", "length", "error")
"""How a trajectory ended: the model answered without a call, it still called tools after multi_turn.max_turns
turns, the response budget (data.max_response_length) ran out (the trajectory is `truncated`), or its agent
session failed ([agent]: crashed, timed out; it trains nothing)."""

_BYTES_PER_ELEMENT = 6  # float64 (what batch moves pack into) holds 48-bit integers exactly


@dataclass
class Turn:
    text: str
    """The model's text of this turn (special tokens kept, the final stop token left out)."""
    calls: list[ToolCall] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)
    """One per call; empty when the turn's calls were not run (the last turn, or the budget ran out)."""
    appended: bool = False
    """Whether the results (and the template glue) went into the token sequence."""


@dataclass
class Trajectory:
    prompt: list[int]
    messages: list[dict]
    """The prompt's chat messages; the turns' assistant and tool messages are appended as they happen."""
    seed: int
    sample: int
    tool_kwargs: dict = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)
    """Every token after the prompt: the model's and the tools'/template's."""
    mask: list[int] = field(default_factory=list)
    """1 where the model sampled the token, 0 on tool results and template glue."""
    logprobs: list[float] = field(default_factory=list)
    """The rollout log-prob of each model token, 0.0 on tool/glue tokens."""
    versions: list[int] = field(default_factory=list)
    """The rollout engine's weight version that sampled each model token (Completion.versions); a glue token
    carries the version of the token before it."""
    turns: list[Turn] = field(default_factory=list)
    finish: str = ""
    agent: dict = field(default_factory=dict)
    """[agent] rollouts: the session's "reward" (None: the run's reward function scores it), "transcript" (what
    the agent returned, if it did), "branches" (the session's trajectories; this is the last) and "error"."""
    routes: np.ndarray | None = None
    """With route capture: the experts of every position of prompt + ids the rollout engine computed, int16
    [positions, layers, top_k] (rollout/routes.py; positions it never computed are left for the batch to fill
    with NO_ROUTE); None otherwise."""

    @property
    def done(self) -> bool:
        return bool(self.finish)

    @property
    def truncated(self) -> bool:
        return self.finish == "length"

    def add_turn_routes(self, turn_routes) -> None:
        """Keep, of the routes of this turn's request (call after its tokens went into `ids`), those of the
        positions no earlier turn computed.

        Each turn is a request whose prompt is the whole trajectory so far, and an engine that records routes
        runs without prefix caching, so every turn recomputes the history. A position keeps the routes of the
        FIRST turn that computed it: that turn sampled from the logits at this very position (or, for glue,
        from positions that attend to it), while later turns only read its keys and values. The log-prob of a
        token sampled in turn j was computed with the history as turn j computed it; the same weights and
        tokens give later turns the same routes, up to floating-point differences between a decode step and a
        prefill over another batch, and where those differ the first turn's routes are the ones the sampled
        token itself was computed with. Tool and glue tokens are computed as prompt positions of the next turn
        (they shape the keys and values later model tokens attend to) and carry that turn's routes. Routes
        beyond the trajectory (a request cut to the response budget ran past it) are dropped."""
        if turn_routes is None:
            return
        r = np.asarray(turn_routes)[: len(self.prompt) + len(self.ids)]
        held = 0 if self.routes is None else len(self.routes)
        if self.routes is None:
            self.routes = r.astype(np.int16, copy=True)
        elif len(r) > held:
            self.routes = np.concatenate([self.routes, r[held:].astype(np.int16)])

    def info(self) -> dict:
        """The turns as plain JSON-able data (what the batch carries)."""
        out = {"finish": self.finish, "turns": [turn_info(t) for t in self.turns]}
        if self.agent:
            out["agent"] = self.agent
        return out


def trajectory_state(t: Trajectory) -> dict:
    """Everything of a trajectory in flight but its prompt, log-probs and routes, as JSON-able data (a checkpoint
    saves it with those; `trajectory_from_state` is the inverse)."""
    return {"messages": t.messages, "seed": t.seed, "sample": t.sample, "tool_kwargs": t.tool_kwargs, "ids": t.ids,
            "mask": t.mask, "versions": t.versions, "finish": t.finish, "turns": [turn_info(x) for x in t.turns],
            "routes": None if t.routes is None else len(t.routes)}


def trajectory_from_state(state: dict, prompt: list[int], logprobs: list[float], routes) -> Trajectory:
    turns = [Turn(text=x["text"], appended=x["appended"],
                  calls=[ToolCall(c["name"], c["arguments"], c["error"]) for c in x["calls"]],
                  results=[ToolResult(r["name"], r["text"], r["failure"], r["seconds"]) for r in x["results"]])
             for x in state["turns"]]
    return Trajectory(prompt=list(prompt), messages=state["messages"], seed=state["seed"], sample=state["sample"],
                      tool_kwargs=state["tool_kwargs"], ids=state["ids"], mask=state["mask"], logprobs=list(logprobs),
                      versions=state["versions"], turns=turns, finish=state["finish"], routes=routes)


def turn_info(t: Turn) -> dict:
    return {
        "text": t.text, "appended": t.appended,
        "calls": [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in t.calls],
        "results": [{"name": r.name, "text": r.text, "failure": r.failure, "seconds": r.seconds} for r in t.results],
    }


def messages_of(prompt_messages: list[dict], info: dict) -> list[dict]:
    """The whole conversation: the prompt's messages, then each turn's assistant message and, where they went
    into the sequence, its tool messages; for an [agent] session the transcript its agent returned, if it did."""
    if (info.get("agent") or {}).get("transcript") is not None:
        return [dict(m) for m in info["agent"]["transcript"]]
    out = [dict(m) for m in prompt_messages]
    for t in info["turns"]:
        out.append({"role": "assistant", "content": t["text"]})
        if t["appended"]:
            out += [{"role": "tool", "name": r["name"], "content": r["text"]} for r in t["results"]]
    return out


def pack_texts(texts: list[str]) -> torch.Tensor:
    """UTF-8 texts as an int64 [B, W] tensor, 6 bytes per element (exact through float64 packing), zero padded."""
    raw = [t.encode("utf-8") for t in texts]
    width = max([-(-len(b) // _BYTES_PER_ELEMENT) for b in raw] + [1])
    out = np.zeros((len(raw), width), dtype=np.int64)
    for i, b in enumerate(raw):
        padded = np.frombuffer(b.ljust(width * _BYTES_PER_ELEMENT, b"\0"), dtype=np.uint8).reshape(width, 6)
        out[i] = (padded.astype(np.int64) << (8 * np.arange(6, dtype=np.int64))).sum(axis=1)
    return torch.from_numpy(out)


def unpack_texts(t: torch.Tensor) -> list[str]:
    """The inverse of pack_texts (trailing zero bytes dropped: JSON text never holds a raw NUL)."""
    a = t.to(torch.int64).numpy()
    shifts = 8 * np.arange(6, dtype=np.int64)
    out = []
    for row in a:
        b = ((row[:, None] >> shifts) & 0xFF).astype(np.uint8).tobytes()
        out.append(b.rstrip(b"\0").decode("utf-8"))
    return out


def encode_infos(trajs: list[Trajectory]) -> torch.Tensor:
    return pack_texts([json.dumps(t.info(), ensure_ascii=False) for t in trajs])


def decode_infos(t: torch.Tensor) -> list[dict]:
    return [json.loads(s) if s else {"finish": "", "turns": []} for s in unpack_texts(t)]
