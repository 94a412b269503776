"""A Hugging Face checkpoint's safetensors files: where each tensor is, whether the files are whole, the names
transformers' checkpoint conversions store a tensor under (the checkpoint's layout, which vLLM's loaders read), and
reading any block of a parameter in the model's layout."""
from __future__ import annotations

import json
import os
from contextlib import ExitStack

import torch

from spmdrl.errors import ConfigError


def checkpoint_index(model_path: str) -> dict[str, str]:
    """HF parameter name -> safetensors file of a local directory or a hub id in the HF cache."""
    path = model_path
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(model_path, allow_patterns=["*.safetensors", "*.json"])
        except Exception as e:  # offline and not cached, or no such repo
            raise ConfigError(f"model.path = {model_path!r}: cannot find its safetensors files ({e})") from None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ConfigError(f"model.path = {model_path!r}: no model.safetensors(.index.json); convert the checkpoint to safetensors")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def safetensors_problem(path: str) -> str | None:
    """Why safetensors file `path` is unusable (truncated, grown, a header that is not safetensors), else None.
    Reads only the header: 8 bytes of header length, the JSON header, then the tensors' data, whose extent the
    header's data_offsets give."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                return f"{size} bytes, too short for its header (truncated or not a safetensors file)"
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        return f"its header is unreadable ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    want = 8 + n + end
    if size != want:
        return f"{size} bytes, its header says {want} ({'truncated' if size < want else 'bytes appended'})"
    return None


def check_weights(key: str, model_dir: str) -> None:
    """Every safetensors file a model directory's weights are in (its index, else *.safetensors) is there and
    whole: a one-line ConfigError naming the file otherwise, before any rank reads one."""
    if not os.path.isdir(model_dir):
        return
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{key} = {model_dir!r}: model.safetensors.index.json is unreadable ({e}); restore the "
                              "model files") from None
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    for name in names:
        file = os.path.join(model_dir, name)
        why = "missing" if not os.path.isfile(file) else safetensors_problem(file)
        if why:
            raise ConfigError(f"{key} = {model_dir!r}: weights file {name} is {why}; download or copy the model again")


def _conversions(config) -> list:
    """transformers' checkpoint conversions for the config's model type ([] where it has none)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without checkpoint conversions: names are the checkpoint's
        return []
    return list(get_checkpoint_conversion_mapping(getattr(config, "model_type", "")) or [])


def _ops(conversion) -> list[tuple[str, int | None]]:
    return [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(conversion, "operations", [])]


def checkpoint_names(config):
    """name -> the name a checkpoint uses for it: transformers' renames of this model type undone (Mixtral's
    in-memory `.mlp.` is the checkpoint's `.block_sparse_moe.`); other names unchanged."""
    from spmdrl.models.vision import is_vision_language

    renames = [(c.target_patterns[0], c.source_patterns[0]) for c in _conversions(config)
               if not _ops(c) and len(c.source_patterns) == len(c.target_patterns) == 1]
    if is_vision_language(config):  # Qwen-VL's published checkpoints: visual.*, and model.* for the language model
        renames += [("model.visual.", "visual."), ("model.language_model.", "model.")]

    def name_of(name: str) -> str:
        for model_part, ckpt_part in renames:
            name = name.replace(model_part, ckpt_part)
        return name

    return name_of


def _merges(config) -> list[tuple[str, list[str]]]:
    """transformers' per-expert merges of this model type: (fused target, per-expert source patterns with '*'),
    stacked on dim 0 and (several sources) concatenated on dim 1."""
    return [(c.target_patterns[0], list(c.source_patterns)) for c in _conversions(config)
            if _ops(c) in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
            and len(c.target_patterns) == 1 and all(p.count("*") == 1 for p in c.source_patterns)]


def checkpoint_views(config):
    """(name, tensor) -> [(checkpoint name, view of tensor)]: the tensor as the checkpoint stores it, which is what
    vLLM's loaders are written for. A fused expert tensor [E, k x F, ...] becomes E x k per-expert views (no copy);
    other tensors keep their data under their checkpoint name."""
    name_of, merges = checkpoint_names(config), _merges(config)

    def views(name: str, t):
        ckpt = name_of(name)
        for target, sources in merges:
            target = name_of(target)
            if ckpt.endswith(target):
                prefix, per = ckpt[: -len(target)], t.shape[1] // len(sources)
                return [(prefix + src.replace("*", str(e)), t[e, j * per:(j + 1) * per] if len(sources) > 1 else t[e])
                        for e in range(t.shape[0]) for j, src in enumerate(sources)]
        return [(ckpt, t)]

    return views


class CheckpointReader:
    """Reads any block of a model parameter from the checkpoint's safetensors, in the model's layout.

    A parameter is stored under its own name, or (transformers' checkpoint conversions, e.g. a mixture of experts
    whose in-memory experts are fused [experts, 2 x ffn, hidden] tensors) under a renamed key, or as one tensor per
    expert (and per gate/up half) that the model stacks on dim 0 and concatenates on dim 1. Only the slices a block
    needs are read, so a rank reads its own experts' rows and nothing else."""

    def __init__(self, index: dict[str, str], config, stack: ExitStack):
        self.index, self.stack, self.files = index, stack, {}
        self._unrename = checkpoint_names(config)
        self.merges = _merges(config)

    def _slice(self, key: str):
        file = self.index[key]
        if file not in self.files:
            from safetensors import safe_open

            self.files[file] = self.stack.enter_context(safe_open(file, framework="pt", device="cpu"))
        return self.files[file].get_slice(key)

    def has(self, name: str) -> bool:
        return self._plan(name) is not None

    def _plan(self, name: str):
        """('direct', key) or ('merged', [per source: [per expert key]]) or None."""
        for key in (name, self._unrename(name)):
            if key in self.index:
                return "direct", key
        ckpt_name = self._unrename(name)
        for target, sources in self.merges:
            if ckpt_name.endswith(self._unrename(target)):
                prefix = ckpt_name[: -len(self._unrename(target))]
                keys = []
                for src in sources:
                    head, tail = src.split("*")
                    experts = sorted(int(k[len(prefix + head):-len(tail)]) for k in self.index
                                     if k.startswith(prefix + head) and k.endswith(tail)
                                     and k[len(prefix + head):-len(tail)].isdigit())
                    keys.append([f"{prefix}{head}{e}{tail}" for e in experts])
                if keys and keys[0]:
                    return "merged", keys
        return None

    def read(self, name: str, shape: tuple[int, ...], offs: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
        how, keys = self._plan(name)
        if how == "direct":
            sl = self._slice(keys)
            if tuple(sl.get_shape()) != tuple(shape):
                raise ConfigError(f"{name}: checkpoint shape {tuple(sl.get_shape())} != model shape {tuple(shape)}")
            return sl[tuple(slice(o, o + n) for o, n in zip(offs, size))]
        experts, parts = len(keys[0]), len(keys)
        per = shape[1] // parts  # rows of one source (gate or up) within dim 1 of the fused tensor
        if experts != shape[0] or per * parts != shape[1] or any(len(k) != experts for k in keys):
            raise ConfigError(f"{name}: the checkpoint has {[len(k) for k in keys]} expert tensors for a model tensor "
                              f"of shape {tuple(shape)}; the checkpoint does not match config.json")
        rows = []
        for e in range(offs[0], offs[0] + size[0]):
            pieces = []
            for j in range(parts):
                lo, hi = max(offs[1], j * per), min(offs[1] + size[1], (j + 1) * per)
                if hi > lo:
                    sl = self._slice(keys[j][e])
                    rest = tuple(slice(o, o + n) for o, n in zip(offs[2:], size[2:]))
                    pieces.append(sl[(slice(lo - j * per, hi - j * per), *rest)])
            rows.append(torch.cat(pieces, dim=0) if pieces else torch.empty(0, *size[2:]))
        return torch.stack(rows) if rows else torch.empty(size)
