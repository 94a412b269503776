"""LoRA adapters on an FSDP2 engine's model, with PEFT: injection on the meta device, their initialisation, their
tensor-parallel layout, and the switch that turns them off (the reference policy). The names and files PEFT keeps
them under are spmdrl/models/lora.py's.

The base model's weights are frozen (no gradients, no optimizer state) and stay in the compute dtype; the
adapters are float32 (the trained masters, cast to the compute dtype by FSDP2's mixed precision). An engine
without adapters never imports this module.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch
import torch.nn as nn

from spmdrl.errors import ConfigError
from spmdrl.models.lora import (ADAPTER, VISION_TOWER_MODULES, LoraSettings, is_adapter, linear_targets, peft_config,
                                unknown_targets)
from spmdrl.models.model import backbone_of
from spmdrl.models.vision import is_vision_language


def inject(hf: nn.Module, s: LoraSettings, *, trainable_head: bool) -> LoraSettings:
    """Wrap the target layers of `hf` (on the meta device) with LoRA layers in place; freeze everything but the
    adapters (and, for a critic, its value head) and make those float32. Returns the settings with
    target_modules resolved."""
    from peft import inject_adapter_in_model

    backbone = backbone_of(hf)
    present = linear_targets(backbone)
    targets = list(s.target_modules) or present
    why = unknown_targets(targets, present)
    if why:
        raise ConfigError(why)
    # a vision-language model's vision tower has linear layers of the same names (its MLP's): adapters go on the
    # language model only
    s = replace(s, target_modules=targets, exclude_modules=VISION_TOWER_MODULES if is_vision_language(hf.config) else "")
    inject_adapter_in_model(peft_config(s), hf, adapter_name=ADAPTER)
    hf.requires_grad_(False)
    for name, p in hf.named_parameters():
        if is_adapter(name):
            p.requires_grad_(True)
    for name, mod in hf.named_modules():
        if isinstance(mod, nn.Linear) and is_adapter(name + "."):
            mod.to(torch.float32)
    if trainable_head:
        head = hf.score if hasattr(hf, "score") else hf.classifier
        head.to(torch.float32).requires_grad_(True)
    return s


def adapter_init(s: LoraSettings):
    """init(name, shape) -> full tensor for an adapter parameter (None for any other), PEFT's initialisation:
    A Kaiming-uniform (a = sqrt(5)) or normal(0, 1/rank), B zero, so the adapted model starts as the base
    model. One generator seeded with s.seed, drawn in parameter order: every rank draws the same tensors."""
    g = torch.Generator().manual_seed(s.seed)

    def init(name: str, shape) -> torch.Tensor | None:
        if ".lora_B." in name:
            return torch.zeros(shape)
        if ".lora_A." not in name:
            return None
        t = torch.empty(shape)
        if s.init == "gaussian":
            return t.normal_(0.0, 1.0 / s.rank, generator=g)
        return nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)

    return init


def tp_plan(plan: dict, targets: list[str]) -> dict:
    """The DTensor TP plan of a backbone whose `targets` layers are wrapped by LoRA layers. The base layer keeps
    its style. A column-parallel layer's B is column-parallel too (A sees the replicated input whole, B's output is
    sharded like the base layer's). A row-parallel layer's A is row-parallel (it reads the sharded input, its
    r outputs are all-reduced) and B is replicated. Either way the adapter's output is laid out as the base
    layer's, so PEFT's sum needs no change."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for key, style in plan.items():
        if key.rsplit(".", 1)[-1] not in targets:
            out[key] = style
        elif isinstance(style, ColwiseParallel):
            out[f"{key}.base_layer"], out[f"{key}.lora_B.{ADAPTER}"] = style, ColwiseParallel()
        elif isinstance(style, RowwiseParallel):
            out[f"{key}.base_layer"], out[f"{key}.lora_A.{ADAPTER}"] = style, RowwiseParallel()
        else:
            raise ConfigError(f"LoRA on {key}: no adapter layout for its tensor-parallel style {type(style).__name__}")
    return out


def tuner_layers(hf: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in hf.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def disabled(hf: nn.Module):
    """Every LoRA layer computes its base layer alone (PEFT's enable_adapters(False)). PEFT's switch also
    flips the adapters' requires_grad; that is undone at once, since FSDP2 reads requires_grad when it first
    runs a forward and must always see the adapters as trainable."""
    params = [p for p in hf.parameters()]
    flags = [p.requires_grad for p in params]

    def restore():
        for p, f in zip(params, flags):
            if p.requires_grad != f:
                p.requires_grad_(f)

    layers = tuner_layers(hf)
    for m in layers:
        m.enable_adapters(False)
    restore()
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        restore()


