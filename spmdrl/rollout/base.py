"""What every rollout engine takes and returns.

An engine turns token-id prompts into sampled responses plus the log-prob of each sampled token. Engines run
SPMD: every rank of a rollout tensor-parallel group calls `generate` with the same prompts and seeds and gets
the same answer: by default the engine seeds one random stream per call from all the per-prompt seeds
(`call_seed`); with per-request seeding each sample has its own stream (`sample_seed`).

Underneath `generate` is the request-level interface the caller steps itself (streaming rollouts): `admit`
requests (one sample each, with an id of the caller's), `step` the engine once and get back the requests that
finished in that step (`Completion`; with `step(partial=True)` also the new tokens of the requests still running,
what a streamed reply sends as they are sampled), `abort` requests, and `in_flight` counts what is admitted and
unfinished. `generate` is a drain of it: admit everything, step until nothing is in flight, return in request
order. Every token a request generates carries `weight_version`, the version of the weights the step that produced it ran
with (the caller sets it after loading new weights); between two steps the caller may load weights, and a request
admitted earlier continues with the new ones (`rebuild_kv` recomputes its cache with them first). Every rank of
a TP group must make the same admissions, aborts and steps.
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from spmdrl.errors import ConfigError
from spmdrl.rollout.routes import merge_routes

_MASK64 = (1 << 64) - 1
GENERATE_ID = "generate:"  # the prefix of the request ids a generate call admits (callers' ids may not start with it)


@dataclass
class SamplingSpec:
    """How to sample: one spec for a whole `generate` call."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus threshold; 1 disables."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) disables."""
    max_tokens: int = 256
    """Longest response in tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends once the decoded response contains one (the tokens are kept)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Stop token ids besides EOS (the stop token is kept in the response)."""
    logprobs: bool = True
    """Return the processed log-prob of each sampled token: log of the distribution it was drawn from
    (logits / temperature, truncated by top_k / top_p and renormalised over the kept tokens; the raw
    logits at temperature 0)."""

    def validate(self) -> None:
        """Raise ConfigError naming the bad field."""
        if self.n < 1:
            raise ConfigError(f"sampling n={self.n}: need at least one sample per prompt")
        if self.temperature < 0:
            raise ConfigError(f"sampling temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling top_p={self.top_p}: must be in (0, 1]")
        if self.max_tokens < 1:
            raise ConfigError(f"sampling max_tokens={self.max_tokens}: must be >= 1")


@dataclass
class RolloutOutput:
    """Responses ordered prompt-major: prompt 0's n samples, then prompt 1's, and so on."""

    response_ids: list[list[int]]
    """Generated token ids per sample (the stop token, when there is one, included)."""
    logprobs: list[list[float]]
    """Processed log-prob of each sampled token (see SamplingSpec.logprobs: after temperature, top-k and top-p);
    empty lists when the spec asked for none."""
    finish_reason: list[str]
    """'stop' (EOS, stop token or stop string) or 'length' (max_tokens reached), per sample."""
    routed_experts: list | None = None
    """With route capture (VLLMEngine(capture_routes=True)): per sample, the experts each computed position of
    prompt + response was routed to, int [positions, layers, top_k] (rollout/routes.py); None otherwise."""

    def __len__(self) -> int:
        return len(self.response_ids)


@dataclass
class Completion:
    """One request the engine finished in a step (or took back with `abort`); with `step(partial=True)` also the
    tokens a request still running produced in that step (finish_reason None)."""

    id: str
    """The caller's request id (admit)."""
    token_ids: list[int]
    """Generated token ids (the stop token, when there is one, included)."""
    logprobs: list[float]
    """Processed log-prob of each token (SamplingSpec.logprobs); empty when the spec asked for none."""
    versions: list[int]
    """The engine's weight_version at the step that produced each token."""
    finish_reason: str | None
    """'stop', 'length', or 'abort' (taken back before it finished); None for a request still running (`step`'s
    partial report: token_ids, logprobs and versions are then only the tokens of that step)."""
    routes: object = None
    """With route capture: the experts each computed position of prompt + response was routed to (see
    RolloutOutput.routed_experts); None otherwise and for aborted requests."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def joined(before: "Completion | None", after: Completion) -> Completion:
    """A request suspended with `before` generated and continued as `after` (a continuation: prompt + before's
    tokens), as one completion: the tokens, log-probs and versions of both, `after`'s finish, and per position the
    routes first computed (before's, as generated; rollout/routes.py merge_routes)."""
    if before is None:
        return after
    routes = after.routes if before.routes is None or after.routes is None else merge_routes(
        np.asarray(before.routes), np.asarray(after.routes))
    return Completion(after.id, before.token_ids + after.token_ids, before.logprobs + after.logprobs,
                      before.versions + after.versions, after.finish_reason, routes)


class RequestLog:
    """What an engine keeps per admitted request while it is in flight: the caller's id and the tokens, log-probs
    and versions it has produced so far (engines feed it the tokens of each step)."""

    def __init__(self, rid: str):
        self.id, self.token_ids, self.logprobs, self.versions = rid, [], [], []

    def extend(self, ids: list[int], logprobs: list[float], version: int) -> None:
        self.token_ids += ids
        self.logprobs += logprobs
        self.versions += [version] * len(ids)

    def done(self, reason: str, routes=None) -> Completion:
        return Completion(self.id, self.token_ids, self.logprobs, self.versions, reason, routes)

    def since(self, start: int) -> Completion:
        """The tokens from `start` on, of a request still running (finish_reason None)."""
        return Completion(self.id, self.token_ids[start:], self.logprobs[start:], self.versions[start:], None)


def drain(step, ids: list[str], stash: list["Completion"]) -> list["Completion"]:
    """generate's requests `ids` to the end: `step()` (an engine's own step) until every one has finished; other
    requests that finish meanwhile go to `stash`, which the engine's next public step() returns. In `ids` order."""
    done: dict[str, Completion] = {}
    while len(done) < len(ids):
        for c in step():
            if c.id.startswith(GENERATE_ID):
                done[c.id] = c
            else:
                stash.append(c)
    return [done[i] for i in ids]


def check_admission(live_ids, ids: list[str], prompt_ids: list[list[int]], spec: SamplingSpec, seeds: list) -> None:
    """The checks both engines make before admitting: one sample per request, one seed (or None) per request, ids
    new and distinct, prompts non-empty."""
    spec.validate()
    if spec.n != 1:
        raise ConfigError(f"admit takes one sample per request (spec.n = 1), got n={spec.n}: admit n requests")
    if not len(ids) == len(prompt_ids) == len(seeds):
        raise ConfigError(f"admit got {len(ids)} ids, {len(prompt_ids)} prompts and {len(seeds)} seeds: pass one "
                          "of each per request")
    taken = sorted(set(ids) & set(live_ids)) or sorted({i for i in ids if ids.count(i) > 1})
    if taken:
        raise ConfigError(f"admit: request id {taken[0]!r} is already in flight (or given twice): ids must be unique")
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ConfigError(f"prompt {i} is empty: every prompt needs at least one token")


class EngineRng:
    """The random stream of an engine's unseeded requests, kept apart from the process's global RNGs: `active()`
    swaps it in around engine work (vLLM draws from the global torch, numpy and python RNGs) and puts the caller's
    back after, so training between two engine steps neither sees nor moves it."""

    def __init__(self):
        self.state = None

    def reseed(self, seed: int) -> None:
        from spmdrl.rng import seed_everything

        with preserved_rng_state():
            seed_everything(seed)
            self.state = capture_rng_state()

    @contextmanager
    def active(self) -> Iterator[None]:
        with preserved_rng_state():
            if self.state is not None:
                restore_rng_state(self.state)
            try:
                yield
            finally:
                self.state = capture_rng_state()


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks


@dataclass(frozen=True)
class LoRASpec:
    """How the rollout engine serves LoRA adapters: the adapter rank, how many adapters vLLM keeps resident
    (the newest plus older versions still in use), and where the adapter directories go (empty: /dev/shm)."""

    rank: int
    max_loras: int = 1
    adapter_dir: str = ""

    def max_lora_rank(self) -> int:
        """The smallest rank vLLM can be built for that holds this adapter."""
        for r in VLLM_LORA_RANKS:
            if r >= self.rank:
                return r
        raise ConfigError(f"lora.rank={self.rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; "
                          "lower the rank or set rollout.lora_sync = 'merge'")


@runtime_checkable
class RolloutEngine(Protocol):
    """A generator living in this process; one per rollout tensor-parallel group, called on all its ranks."""

    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> RolloutOutput:
        """Sample spec.n responses per prompt, prompt-major; the draws are a function of the seeds only."""
        ...

    weight_version: int
    """Stamped on every token the following steps produce (the caller sets it after loading weights)."""

    def admit(self, ids: list[str], prompt_ids: list[list[int]], spec: SamplingSpec, seeds: list[int | None]) -> None:
        """Queue one request per id (spec.n must be 1): a prompt and its seed (None: drawn from the engine's stream,
        see reseed). The same call on every rank of the TP group (checked)."""
        ...

    def step(self, partial: bool = False) -> list["Completion"]:
        """One engine step; the requests that finished in it. partial: also, for each request still running that
        sampled tokens in this step, a Completion of just those tokens with finish_reason None (the finished
        request's Completion still holds all of its tokens). Reporting only: the step is the same either way, so
        the ranks of a TP group may differ in it."""
        ...

    def abort(self, ids: list[str]) -> list["Completion"]:
        """Take back in-flight requests; what each generated so far, finish_reason 'abort' (ids not in flight are
        skipped). A request that finished in a step whose completions were not returned yet (a generate call stepped
        the engine) comes back as it finished."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished or aborted."""
        ...

    def reseed(self, seed: int) -> None:
        """Seed the stream unseeded requests draw from (the same seed on every rank of the TP group)."""
        ...

    def rebuild_kv(self) -> None:
        """Recompute the cached keys and values of every in-flight request with the current weights at its next
        step (no-op where nothing is cached across steps)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of HF-named, full (unsharded) tensors; call again for the next bucket."""
        ...

    def finish_weight_update(self) -> None:
        """Apply what update_weights left pending (the next generate does it anyway); no-op when nothing is."""
        ...

    def weight_snapshot(self) -> dict[str, torch.Tensor]:
        """Host copies of the weights this rank's engine computes with, by the engine's own names (after
        finish_weight_update); rollout.verify_sync compares two of them."""
        ...

    def forget_prefixes(self) -> None:
        """Drop cached prompt prefixes (vLLM's prefix cache; no-op where there is none), so what was generated
        before (the parity check's samples) cannot change later samples."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Release weights (level 1: kept on host; level 2: dropped) and KV cache memory until wake_up (no-op
        where unsupported)."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo sleep for the tagged allocations ("weights", "kv_cache"; None: all; no-op where unsupported)."""
        ...

    def close(self) -> None:
        """Free the engine; the process group it shared stays usable."""
        ...


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(prompt_seed: int, j: int) -> int:
    """Seed of sample j of a prompt: a 63-bit hash of (prompt_seed, j), the same on every rank.

    Hashing (rather than prompt_seed + j) keeps prompts with neighbouring seeds from sharing samples.
    """
    return _splitmix64(_splitmix64(prompt_seed & _MASK64) ^ j) >> 1


def continuation_seed(seed: int, generated: int) -> int:
    """The seed of a request taken out of the engine after `generated` tokens and admitted again as a continuation
    (prompt + its tokens so far): a 63-bit hash of its own seed and that length, the same on every rank."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ generated) >> 1


def call_seed(seeds: list[int]) -> int:
    """One 63-bit seed for a whole generate call: a hash of the per-prompt seeds in order, the same on every rank
    that passes the same seeds (the ranks of a TP group), different between steps and rollout dp ranks because
    the per-prompt seeds are."""
    h = _splitmix64(len(seeds))
    for s in seeds:
        h = _splitmix64(h ^ (s & _MASK64))
    return h >> 1


def check_generate_args(prompt_ids: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> None:
    """The checks both engines make before generating."""
    spec.validate()
    if len(seeds) != len(prompt_ids):
        raise ConfigError(f"generate got {len(prompt_ids)} prompts but {len(seeds)} seeds: pass one seed per prompt")
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ConfigError(f"prompt {i} is empty: every prompt needs at least one token")


def capture_rng_state() -> tuple:
    """The torch (CPU and CUDA), numpy and python RNG states."""
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # numpy is optional
        np_state = None
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), torch.get_rng_state(), cuda_states, np_state


def restore_rng_state(state: tuple) -> None:
    py_state, torch_state, cuda_states, np_state = state
    random.setstate(py_state)
    torch.set_rng_state(torch_state)
    if cuda_states is not None:
        torch.cuda.set_rng_state_all(cuda_states)
    if np_state is not None:
        import numpy as np

        np.random.set_state(np_state)


@contextmanager
def preserved_rng_state() -> Iterator[None]:
    """Restore the torch (CPU and CUDA), numpy and python RNG states on exit.

    Engine construction reseeds the global RNGs; training must not notice.
    """
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)
