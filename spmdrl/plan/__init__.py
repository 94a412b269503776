"""`spmdrl plan`: what a config needs before anything runs (role meshes, weight-sync bytes, memory per phase).

`estimate.py` builds and renders the plan (FSDP2 roles and the phases); `megatron.py` adds what a role on the
Megatron-core backend holds per pipeline stage. Parameter shapes come from the model's config.json
(`spmdrl.engines.loading`); no GPU, no weights and no process group are needed.
"""
from spmdrl.engines.loading import load_hf_config, model_param_shapes

from .estimate import build_plan, load_bytes_per_rank, render, split_figures

__all__ = ["build_plan", "load_bytes_per_rank", "load_hf_config", "model_param_shapes", "render", "split_figures"]
