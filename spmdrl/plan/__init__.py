"""`spmdrl plan`: what a config needs before anything runs (role meshes, weight-sync bytes, memory per phase).

`estimate.py` builds and renders the plan (FSDP2 roles and the phases, build, checkpoint_save and resume
included); `megatron.py` adds what a role on the Megatron-core backend holds per pipeline stage and at
construction; `overheads.py` the CUDA context, NCCL's buffers and vLLM's memory outside its sleep pool;
`sync_memory.py` the weight sync's buffers bucket by bucket. Parameter shapes come from the model's config.json
(`spmdrl.models.model`); no GPU, no weights and no process group are needed.
"""
from spmdrl.models.model import load_hf_config, model_param_shapes

from .estimate import build_plan, load_bytes_per_rank, render, split_figures

__all__ = ["build_plan", "load_bytes_per_rank", "load_hf_config", "model_param_shapes", "render", "split_figures"]
