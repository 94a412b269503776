"""LoRA adapters on an FSDP2 engine's model, with PEFT: injection on the meta device, their initialisation,
the switch that turns them off (the reference policy), and the names and config PEFT saves them under.

The base model's weights are frozen (no gradients, no optimizer state) and stay in the compute dtype; the
adapters are float32 (the trained masters, cast to the compute dtype by FSDP2's mixed precision). An engine
without adapters never imports this module.
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from spmdrl.engines.loading import backbone_of, block_index, decoder_blocks
from spmdrl.errors import ConfigError

INITS = ("default", "gaussian")
ADAPTER_KEYS = (".lora_A.", ".lora_B.")
ADAPTER = "default"  # PEFT's adapter name inside the modules; PEFT's files leave it out


@dataclass
class LoraSettings:
    """What `lora` in the config asks for. target_modules: module-name suffixes; empty means every linear
    layer of the decoder blocks, resolved against the model when the adapters are injected."""

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)
    init: str = "default"
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def settings_from_config(cfg) -> LoraSettings:
    """The config's [lora] section as engine settings (seeded from trainer.seed)."""
    s = cfg.lora
    return LoraSettings(rank=s.rank, alpha=s.alpha, dropout=s.dropout, target_modules=list(s.target_modules),
                        init=s.init, seed=cfg.trainer.seed)


def is_adapter(name: str) -> bool:
    return any(k in name for k in ADAPTER_KEYS)


def checkpoint_name(name: str) -> str:
    """The HF checkpoint's name of a parameter of the injected model (PEFT moves a wrapped layer's own weight
    under `.base_layer`)."""
    return name.replace(".base_layer.", ".")


def peft_name(name: str) -> str:
    """The name PEFT's save_pretrained gives adapter parameter `name` of the HF model (PeftModel's prefix, the
    adapter name dropped): model.layers.0.self_attn.q_proj.lora_A.default.weight ->
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    for key in ADAPTER_KEYS:
        name = name.replace(f"{key}{ADAPTER}.", key)
    return "base_model.model." + name


def linear_targets(backbone: nn.Module) -> list[str]:
    """Suffixes of every nn.Linear inside the decoder blocks, in module order (PEFT's all-linear without the
    LM head)."""
    out: list[str] = []
    for name, mod in decoder_blocks(backbone).named_modules():
        suffix = name.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Linear) and suffix not in out:
            out.append(suffix)
    return out


def adapter_shapes(params: list[tuple[str, tuple[int, ...]]], rank: int, targets: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the adapters LoRA adds to a model with parameters `params` (HF names and shapes, e.g.
    engines.loading.model_param_shapes): r x in for A and out x r for B of every 2-D weight in a decoder block
    whose module name is in `targets` (empty: every one), for plans made without building the model."""
    out = []
    for name, shape in params:
        module, _, leaf = name.rpartition(".")
        if block_index(name) is None or leaf != "weight" or len(shape) != 2:
            continue
        if targets and module.rsplit(".", 1)[-1] not in targets:
            continue
        out += [(f"{module}.lora_A.{ADAPTER}.weight", (rank, shape[1])), (f"{module}.lora_B.{ADAPTER}.weight", (shape[0], rank))]
    return out


def peft_config(s: LoraSettings, base_model: str = ""):
    """PEFT's LoraConfig for these settings (bias none, no modules_to_save: the base stays as it was loaded)."""
    from peft import LoraConfig

    return LoraConfig(r=s.rank, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=list(s.target_modules),
                      init_lora_weights=True if s.init == "default" else "gaussian", bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=base_model or None)


def unknown_targets(targets, present: list[str], model: str = "") -> str:
    """The one refusal of lora.target_modules naming no linear layer of the decoder blocks ("" when all do):
    config validation raises it before launch (from config.json), the engine when it wraps the model."""
    unknown = [t for t in targets if t not in present]
    if not unknown:
        return ""
    return (f"lora.target_modules: {unknown} name no linear layer of the decoder blocks{model}; choose from "
            f"{', '.join(present)}, or [] for all of them")


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
    s = replace(s, target_modules=targets)
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


def adapter_config(s: LoraSettings, base_model: str) -> dict:
    """adapter_config.json as PEFT's save_pretrained writes it (inference mode, sets as lists)."""
    cfg = peft_config(s, base_model)
    cfg.inference_mode = True
    d = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.to_dict().items()}
    return json.loads(json.dumps(d, sort_keys=True))


def write_adapter(out_dir: str, tensors: list[tuple[str, torch.Tensor]], config: dict) -> str:
    """A PEFT adapter directory: adapter_config.json + adapter_model.safetensors (PEFT's names)."""
    import os

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors}, os.path.join(out_dir, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True))
    return out_dir
