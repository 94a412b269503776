"""Rollout targets for hand-built parameter lists, learnt from vLLM's loaders (reshard/vllm_reads.py) on the
Llama config those shapes describe (attention_bias for q/k/v biases; Llama honours an explicit head_dim)."""
from __future__ import annotations

import re

from spmdrl.dist.blocks import ModelDims
from spmdrl.reshard.vllm_reads import rollout_targets


def hf_config_for(params, dims: ModelDims):
    from transformers import AutoConfig

    shapes = dict(params)
    layers = {int(m.group(1)) for n in shapes if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    hidden = shapes["model.embed_tokens.weight"][1]
    ffn = shapes["model.layers.0.mlp.gate_proj.weight"][0]
    bias = "model.layers.0.self_attn.q_proj.bias" in shapes
    return AutoConfig.for_model(
        "llama", attention_bias=bias, vocab_size=dims.vocab_size, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=max(layers) + 1, num_attention_heads=dims.num_heads, num_key_value_heads=dims.num_kv_heads,
        head_dim=dims.head_dim, tie_word_embeddings="lm_head.weight" not in shapes, max_position_embeddings=256)


def vllm_blocks(params, groups, dims: ModelDims) -> dict:
    targets, reads = rollout_targets(params, groups, hf_config_for(params, dims), loads_tp_shards=True)
    assert not reads.whole, reads.whole  # these layouts are all on the planned route
    return targets
