"""Sharded loading: build the HF model on the meta device, shard it, then fill each rank's shard from the
safetensors slices it owns, in the storage dtype. No rank ever holds a whole parameter it does not own, and
none holds a full float32 copy of the model.

    hf = build_meta_model(path, ...)           # parameters on meta; buffers (rotary tables) real, on the host
    ... TP parallelize_module / fully_shard on the meta model ...
    materialise(root, hf, path, device, dtype) # to_empty, then per parameter: read my block, cast, copy
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
from contextlib import ExitStack

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from spmdrl.errors import ConfigError

log = logging.getLogger("spmdrl")

HEAD_PREFIXES = ("score.", "classifier.")  # a critic's fresh value head: not in a causal-LM checkpoint
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


VISION_LANGUAGE = ("qwen2_5_vl", "qwen3_vl")  # the vision-language families spmdrl trains (docs/vlm.md)


def is_vision_language(config) -> bool:
    """Whether `config` is one of the vision-language models spmdrl trains (a language model with a vision tower
    whose image tokens go into its prompt)."""
    return getattr(config, "model_type", None) in VISION_LANGUAGE


def meta_model(config, *, value_head: bool, **kw):
    """The HF causal LM of `config` (value_head: a one-label token classifier, the critic's and reward model's
    form) with every parameter on the meta device; `config` itself is left as it is."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

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


def build_meta_model(model_path: str, *, value_head: bool, trust_remote_code: bool, dtype: torch.dtype = torch.float32,
                     attn_implementation: str = "sdpa", switch_attention: bool = True):
    """The HF model with every parameter on the meta device (no memory), in the storage dtype, and real buffers
    on the host; dropout off; attention by the transformers implementation `attn_implementation` (a registered
    name), or with switch_attention by the one this model needs (SDPA for a model with its own attention classes,
    eager for attention soft-capping or sinks; one log line each)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path = {model_path!r}: cannot load the model ({e}); give an HF model directory or hub id") from None
    if is_vision_language(config) and value_head:
        raise ConfigError(f"model.path = {model_path!r}: a vision-language model ({config.model_type}) as a critic or "
                          "reward model is not supported; give a text model")
    if not value_head and not is_vision_language(config) and \
            getattr(config, "get_text_config", lambda: config)() is not config:
        raise ConfigError(f"model.path = {model_path!r}: model type {config.model_type!r} is a multimodal model "
                          f"({', '.join(getattr(config, 'architectures', None) or [type(config).__name__])}); spmdrl "
                          "trains text models: give a checkpoint of its language model alone (its text model type, "
                          f"{config.get_text_config().model_type!r})")
    switched_off = dropout_off(config)
    if switched_off:
        log.info("model.path = %r: dropout set to 0 for training (%s; vLLM never applies it): the update's forward "
                 "must compute the policy that sampled", model_path, ", ".join(switched_off))
    if is_vision_language(config) and attn_implementation not in ("sdpa", "eager"):
        # its vision tower runs bidirectional attention over each image through the same attention functions, which
        # spmdrl's causal kernels are not
        log.info("model.path = %r (%s, vision-language): it trains with transformers' SDPA attention and padded rows",
                 model_path, config.model_type)
        attn_implementation = "sdpa"
    if attn_implementation not in ("sdpa", "eager") and not _class_takes_attention_functions(config, value_head):
        attn_implementation = "sdpa" if _class_supports(config, value_head, "_supports_sdpa") else "eager"
        log.info("model.path = %r (%s) runs its own attention classes, not transformers' attention functions: it "
                 "trains with transformers' %s attention and explicit masks (packed batches laid out as padded rows)",
                 model_path, config.model_type, attn_implementation)
    needs = eager_only_attention(config)
    if needs and attn_implementation != "eager":
        if not switch_attention:
            raise ConfigError(f"model.path = {model_path!r}: {needs}, which only transformers' eager attention computes; "
                              "set model.attn_implementation = 'eager' (or 'auto', which picks it)")
        log.info("model.path = %r: %s, which only transformers' eager attention computes: the training engines use it "
                 "(packed batches laid out as padded rows)", model_path, needs)
        attn_implementation = "eager"
    hf = meta_model(config, value_head=value_head, trust_remote_code=trust_remote_code,
                    attn_implementation=attn_implementation, dtype=dtype)
    _real_buffers(hf)
    return hf


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


def _class_supports(config, value_head: bool, flag: str) -> bool:
    """A transformers class flag (_supports_sdpa, ...) of the model class of `config`, before it is built."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    try:
        return bool(getattr(auto._model_mapping[type(config)], flag, False))
    except KeyError:
        return True


def _class_takes_attention_functions(config, value_head: bool) -> bool:
    """takes_attention_functions for the model class of `config`, before it is built."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    try:
        cls = auto._model_mapping[type(config)]
    except KeyError:  # remote code: assume the modern interface, transformers checks it at build
        return True
    return bool(getattr(cls, "_supports_attention_backend", False))


def _real_buffers(hf: nn.Module) -> None:
    """Buffers computed at construction (rotary inverse frequencies) came out on meta: rebuild the modules
    that own them on the host. HF rotary embeddings are built from the model config alone."""
    for name, mod in hf.named_modules():
        if not any(b.is_meta for b in mod.buffers(recurse=False)):
            continue
        try:
            fresh = type(mod)(getattr(mod, "config", None) or hf.config)  # a sub-model's rotary: its own config
        except TypeError as e:  # built from more than the config (Gemma 3's scaled embedding): the model's own
            # weight initialisation fills its non-persistent buffers, as transformers' loading does
            for bname, b in list(mod.named_buffers(recurse=False)):
                mod._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
            if not hasattr(hf, "_init_weights"):
                raise ConfigError(f"cannot build {type(mod).__name__} ({name}) off the meta device: {e}") from None
            with torch.no_grad():
                hf._init_weights(mod)
            continue
        for bname, b in fresh.named_buffers(recurse=False):
            mod._buffers[bname] = b
        for k, v in vars(fresh).items():  # attention_scaling and the like
            if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module)):
                setattr(mod, k, v)


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


def local_block(p) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of this rank's shard of parameter p in the full tensor."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(offset), tuple(shape)
    return tuple(0 for _ in p.shape), tuple(p.shape)


def materialise(root: nn.Module, hf: nn.Module, model_path: str, device: torch.device,
                initializer_range: float = 0.02, init_fresh=None) -> dict[str, int]:
    """Allocate `root`'s (sharded) parameters on `device` (in the dtype they were built in) and fill this rank's blocks from the
    checkpoint; returns {"bytes_read": ...}. Parameters missing from the checkpoint are allowed only for a
    value head, initialised like HF's _init_weights (normal(0, initializer_range), zero bias) from the global
    RNG, which every rank seeds alike. init_fresh(name, shape) -> full tensor or None: parameters that do not come
    from the checkpoint (LoRA adapters, spmdrl/engines/lora.py); with it, a LoRA-wrapped layer's `.base_layer.`
    weight is read under the checkpoint's own name."""
    buffers = {n: b.clone() for n, b in root.named_buffers()}
    root.to_empty(device=device)
    with torch.no_grad():
        for n, b in root.named_buffers():
            b.copy_(buffers[n])
    index = checkpoint_index(model_path)
    prefix = next((n + "." for n, m in root.named_modules() if m is hf), "")
    bytes_read = 0
    with ExitStack() as stack, torch.no_grad():
        reader = CheckpointReader(index, hf.config, stack)
        for name, p in hf.named_parameters():
            offs, shape = local_block(p)
            local = p.to_local() if isinstance(p, DTensor) else p
            fresh = init_fresh(name, p.shape) if init_fresh is not None else None
            source = name.replace(".base_layer.", ".") if init_fresh is not None else name
            if fresh is not None:
                block = fresh[tuple(slice(o, o + s) for o, s in zip(offs, shape))]
            elif not reader.has(source):
                if not name.startswith(HEAD_PREFIXES):
                    raise ConfigError(f"model.path = {model_path!r}: the checkpoint has no parameter {name!r} ({prefix}{name})")
                full = torch.zeros(p.shape) if name.endswith("bias") else torch.empty(p.shape).normal_(0.0, initializer_range)
                block = full[tuple(slice(o, o + s) for o, s in zip(offs, shape))]
            else:
                block = reader.read(source, tuple(p.shape), offs, shape) if math.prod(shape) else torch.empty(shape)
                bytes_read += block.numel() * block.element_size()
            local.copy_(block.reshape(local.shape).to(local.dtype))
            del block
    return {"bytes_read": bytes_read}
