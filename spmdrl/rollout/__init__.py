"""Rollout engines: generate responses in-process, one engine per rollout tensor-parallel group.

`build_engine("vllm" | "hf" | "auto", **kwargs)` builds one; `auto` takes vLLM when it is importable and
otherwise falls back to the slow transformers engine with a warning.
"""
from __future__ import annotations

import importlib.util
import inspect
import logging

from spmdrl.errors import ConfigError
from spmdrl.rollout.base import RolloutEngine, RolloutOutput, SamplingSpec, sample_seed

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingSpec", "build_engine", "sample_seed", "vllm_available"]

logger = logging.getLogger(__name__)


def vllm_available() -> bool:
    """Whether vLLM can be imported here (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def build_engine(kind: str = "auto", **kwargs) -> RolloutEngine:
    """Build a rollout engine. kwargs are VLLMEngine's; the ones HFEngine lacks (tp_size, kv_cache_gb, ...)
    are dropped when the transformers engine is used, since each of its ranks holds the whole model."""
    if kind not in ("vllm", "hf", "auto"):
        raise ConfigError(f"rollout.engine={kind!r}: use vllm, hf or auto")
    if kind == "auto":
        kind = "vllm" if vllm_available() else "hf"
    if kind == "vllm":
        if not vllm_available():
            raise ConfigError("rollout.engine='vllm' but vllm is not installed: pip install vllm, or set engine='hf'")
        from spmdrl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(**kwargs)
    from spmdrl.rollout.hf_engine import HFEngine

    accepted = set(inspect.signature(HFEngine.__init__).parameters)
    dropped = sorted(k for k in kwargs if k not in accepted)
    if dropped:
        logger.info("transformers rollout engine ignores %s", ", ".join(dropped))
    return HFEngine(**{k: v for k, v in kwargs.items() if k in accepted})
