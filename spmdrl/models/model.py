"""A Hugging Face model without its weights: its config (local, cached or bundled), the meta-device model and its
parameters' names and shapes, the decoder stack and blocks, and the config facts the training forward depends on
(dropout, attention that only eager computes)."""
from __future__ import annotations

import copy
import json
import os
import re

import torch
import torch.nn as nn

from spmdrl.errors import ConfigError


BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_configs")


def load_hf_config(path: str, trust_remote_code: bool = False):
    """The HF config of model.path: a local directory, the HF cache, or a bundled copy of a published config.json
    for the shipped example models (spmdrl/model_configs), so the plan runs offline."""
    from transformers import AutoConfig

    bundled = os.path.join(BUNDLED, path.replace("/", "--") + ".json")
    if not os.path.isdir(path) and os.path.isfile(bundled):
        with open(bundled) as f:
            d = json.load(f)
        return AutoConfig.for_model(d.pop("model_type"), **d)
    source = path
    if not os.path.isdir(os.path.expanduser(path)) and not path.startswith(("/", ".", "~")):
        # a hub id: read the cached config.json, never the network (from_pretrained would retry for half a minute)
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(path, "config.json")
        except ValueError:
            cached = None
        if not isinstance(cached, str):
            raise ConfigError(
                f"model.path = {path!r}: not a local directory and its config.json is not in the HF cache; give a "
                f"directory holding its config.json (only that file is read) or fetch it with "
                f"`huggingface-cli download {path} config.json`"
            )
        source = os.path.dirname(cached)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model.path = {path!r}: no config.json found ({str(e).splitlines()[0]}); give a local model directory "
            "(only config.json is read) or a hub id in the HF cache"
        ) from None


def meta_model(config, *, value_head: bool, **kw):
    """The HF causal LM of `config` (value_head: a one-label token classifier, the critic's and reward model's
    form) with every parameter on the meta device; `config` itself is left as it is."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from spmdrl.models.vision import is_vision_language

    config = copy.deepcopy(config)
    with torch.device("meta"):
        if is_vision_language(config) and not value_head:
            from transformers import AutoModelForImageTextToText

            return AutoModelForImageTextToText.from_config(config, **kw)
        if value_head:
            config.num_labels = 1
            return AutoModelForTokenClassification.from_config(config, **kw)
        return AutoModelForCausalLM.from_config(config, **kw)


BLOCK_NAME = re.compile(r"\.(\d+)\.")  # a decoder block's parameters: model.layers.3. / transformer.h.3.


def backbone_of(hf: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM or token classifier: the attribute its base_model_prefix names, else its
    `model` (Llama 4's text model keeps the multimodal class's prefix, "language_model")."""
    found = getattr(hf, hf.base_model_prefix, None)
    if found is None:
        found = getattr(hf, "model", None)
    if found is None:
        raise ConfigError(f"{type(hf).__name__} has no {hf.base_model_prefix!r} or 'model' decoder stack")
    return found


def decoder_blocks(backbone: nn.Module) -> nn.ModuleList:
    """The backbone's list of decoder blocks (model.layers for Llama-style models, transformer.h for Falcon and
    GPT-2, model.decoder.layers for OPT): its longest nn.ModuleList child, or a grandchild's when it has none; a
    vision-language model's are its language model's (its vision tower's blocks are not decoder blocks)."""
    backbone = getattr(backbone, "language_model", backbone)
    lists = [m for m in backbone.children() if isinstance(m, nn.ModuleList)]
    if not lists:
        lists = [m for c in backbone.children() for m in c.children() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ConfigError(f"{type(backbone).__name__} has no list of decoder blocks that spmdrl recognises")
    return max(lists, key=len)


def block_index(name: str) -> int | None:
    """The decoder block an HF parameter name belongs to, None for the root's (embeddings, final norm, heads)."""
    m = BLOCK_NAME.search(name)
    return int(m.group(1)) if m else None


def model_param_shapes(hf_config, value_head: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every parameter, in named_parameters order, from a meta-device model: the same list
    FSDPEngine.param_shapes() returns for a model loaded from that config."""
    return [(n, tuple(p.shape)) for n, p in meta_model(hf_config, value_head=value_head).named_parameters()]


DROPOUT_KEYS = re.compile(r"(dropout|pdrop)(_prob|_rate)?$")


def dropout_off(config) -> list[str]:
    """Set every dropout probability of `config` (and its sub-configs) to 0; returns the "key = value" it changed.
    An RL update's ratio needs the forward that sampled: vLLM never drops out, so the trainer must not either."""
    changed = []
    for c in {id(x): x for x in (config, getattr(config, "get_text_config", lambda: config)())}.values():
        for k, v in list(vars(c).items()):
            if DROPOUT_KEYS.search(k) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                setattr(c, k, 0.0)
                changed.append(f"{k} = {v}")
    return changed


def eager_only_attention(config) -> str:
    """Why `config`'s attention needs transformers' eager implementation (neither spmdrl's kernels nor SDPA compute
    it), or "" when it does not: attention-logit soft-capping (Gemma 2), attention sinks (gpt-oss)."""
    text = getattr(config, "get_text_config", lambda: config)()
    if getattr(text, "attn_logit_softcapping", None):
        return f"attn_logit_softcapping = {text.attn_logit_softcapping}"
    if text.model_type in SINK_MODEL_TYPES:
        return "attention sinks (a learnt per-head logit in every softmax)"
    return ""


SINK_MODEL_TYPES = ("gpt_oss",)  # transformers passes s_aux to the attention function; only eager applies it


def takes_attention_functions(hf: nn.Module) -> bool:
    """Whether built model `hf` calls transformers' registered attention functions (spmdrl's kernels plug in there,
    and its attention can be switched after the build); older classes (Falcon) pick their own attention classes."""
    return bool(getattr(type(hf), "_supports_attention_backend", False))


def class_supports(config, value_head: bool, flag: str) -> bool:
    """A transformers class flag (_supports_sdpa, ...) of the model class of `config`, before it is built."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    try:
        return bool(getattr(auto._model_mapping[type(config)], flag, False))
    except KeyError:
        return True


def class_takes_attention_functions(config, value_head: bool) -> bool:
    """takes_attention_functions for the model class of `config`, before it is built."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    try:
        cls = auto._model_mapping[type(config)]
    except KeyError:  # remote code: assume the modern interface, transformers checks it at build
        return True
    return bool(getattr(cls, "_supports_attention_backend", False))
