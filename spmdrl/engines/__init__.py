"""Training backends behind one protocol (base.py). Everything outside this package builds engines with
`build_train_engine` and uses only the protocol's methods."""
from __future__ import annotations

from spmdrl.errors import ConfigError

from .base import ScoreEngine, TrainEngine
from .token_batch import TokenBatch, pack_sequences

BACKENDS = ("fsdp", "megatron")


def build_train_engine(backend: str, model_path: str, mesh, device, **kwargs) -> TrainEngine:
    """A training engine of `backend` for one role on its mesh; kwargs are the backend's (see FSDPEngine)."""
    if backend == "fsdp":
        from .fsdp import FSDPEngine

        return FSDPEngine(model_path, mesh, device, **kwargs)
    if backend == "megatron":
        from .megatron import MegatronEngine

        return MegatronEngine(model_path, mesh, device, **kwargs)
    raise ConfigError(f"trainer.backend = {backend!r}: available backends are {', '.join(BACKENDS)}")


def role_backend(cfg, role: str) -> str:
    """The training backend of a role (actor, ref, critic): trainer.backend, or trainer.critic_backend for the
    critic when set."""
    if role == "critic" and cfg.trainer.critic_backend:
        return cfg.trainer.critic_backend
    return cfg.trainer.backend


def build_score_engine(backend: str, model_path: str, mesh, device, **kwargs) -> ScoreEngine:
    """A forward-only sequence-classification scorer (reward model) on a role's mesh (base.ScoreEngine)."""
    if backend == "fsdp":
        from .scorer import FSDPScoreEngine

        return FSDPScoreEngine(model_path, mesh, device, **kwargs)
    raise ConfigError(f"reward model backend {backend!r}: available backends are {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "role_backend", "ScoreEngine", "TokenBatch", "TrainEngine", "build_score_engine", "build_train_engine", "pack_sequences"]
