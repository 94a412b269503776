"""What every rollout engine takes and returns.

An engine turns token-id prompts into sampled responses plus the log-prob of each sampled token. Engines run
SPMD: every rank of a rollout tensor-parallel group calls `generate` with the same prompts and seeds and gets
the same answer: by default the engine seeds one random stream per call from all the per-prompt seeds
(`call_seed`); with per-request seeding each sample has its own stream (`sample_seed`).
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from spmdrl.errors import ConfigError

_MASK64 = (1 << 64) - 1


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


@contextmanager
def preserved_rng_state() -> Iterator[None]:
    """Restore the torch (CPU and CUDA), numpy and python RNG states on exit.

    Engine construction reseeds the global RNGs; training must not notice.
    """
    py_state = random.getstate()
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # numpy is optional
        np = None
        np_state = None
    try:
        yield
    finally:
        random.setstate(py_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if np is not None:
            np.random.set_state(np_state)
