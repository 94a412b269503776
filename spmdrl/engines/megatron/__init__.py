"""megatron-core training backend (trainer.backend = "megatron"): GPTModel with TP x PP x DP from the role mesh.

engine.py: the TrainEngine; model.py: parallel state and GPTModel construction; forward.py: vocab-parallel
log-probs / entropy and the value head; convert.py: HF <-> Megatron block arithmetic; state.py: loading, weight
sync shards, export and checkpoints; cpu_compat.py: the CPU-only workarounds.
"""
from .engine import MegatronEngine

__all__ = ["MegatronEngine"]
