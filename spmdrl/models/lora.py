"""A LoRA adapter as PEFT names and files it: the [lora] settings, the adapter parameters' names (in the model, in
the base checkpoint, in PEFT's files) and shapes, the target layers, adapter_config.json and the adapter directory.
Wrapping a model with adapters is the training engine's (spmdrl/engines/lora.py)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from spmdrl.models.model import block_index, decoder_blocks
from spmdrl.models.vision import VISION_TOWER_PREFIX, in_vision_tower


INITS = ("default", "gaussian")
VISION_TOWER_MODULES = re.escape(VISION_TOWER_PREFIX) + ".*"  # exclude_modules of a vision-language model


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
    exclude_modules: str = ""  # a regex of module names PEFT leaves alone (a vision-language model's vision tower)

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
    models.model.model_param_shapes): r x in for A and out x r for B of every 2-D weight in a decoder block
    whose module name is in `targets` (empty: every one), for plans made without building the model. A
    vision-language model's adapters are its language model's: none in the vision tower."""
    out = []
    for name, shape in params:
        module, _, leaf = name.rpartition(".")
        if block_index(name) is None or leaf != "weight" or len(shape) != 2 or in_vision_tower(name):
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
                      task_type="CAUSAL_LM", base_model_name_or_path=base_model or None,
                      exclude_modules=s.exclude_modules or None)


def unknown_targets(targets, present: list[str], model: str = "") -> str:
    """The one refusal of lora.target_modules naming no linear layer of the decoder blocks ("" when all do):
    config validation raises it before launch (from config.json), the engine when it wraps the model."""
    unknown = [t for t in targets if t not in present]
    if not unknown:
        return ""
    return (f"lora.target_modules: {unknown} name no linear layer of the decoder blocks{model}; choose from "
            f"{', '.join(present)}, or [] for all of them")


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
