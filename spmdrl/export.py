"""`spmdrl export`: a checkpoint's model as an HF model directory (safetensors, config, tokenizer); a LoRA
checkpoint's adapters as a PEFT adapter directory, or merged into its base model as an HF model directory.

Runs in one plain process, no torchrun: DCP reads the sharded tensors without a process group and reshards
them into full tensors, one bucket of parameters at a time, each written as one safetensors file (with the
index `from_pretrained` reads). The checkpoint's manifest, sizes and checksums are verified first, and each
parameter's stored shape against the manifest's list (itself checked against its params_hash). Peak memory
is one bucket (`bucket_bytes`, 1 GiB by default) in the stored dtype plus its cast, on CPU.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile

import torch

from spmdrl.checkpoint.dcp import dcp_error, param_hash, safe_reader, single_process_quiet, tensor_only_planner
from spmdrl.checkpoint.files import find_checkpoint, sha256, state_dir
from spmdrl.checkpoint.verify import check_files, read_manifest
from spmdrl.errors import CheckpointError
from spmdrl.models.vision import copy_image_processor

log = logging.getLogger("spmdrl")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _stored(path: str, engine: str, verify: bool):
    """(reader, [(HF name, DCP key, shape, dtype)]) of `engine`'s parameters in checkpoint `path`, checked."""
    manifest = read_manifest(path)
    check_files(path, manifest)
    if verify:
        for rel, info in sorted(manifest["files"].items()):
            if rel.startswith("state/") and sha256(os.path.join(path, rel)) != info["sha256"]:
                raise CheckpointError(f"checkpoint {path}: {rel} failed the checksum (corrupted on disk)")
    if engine not in manifest["engines"]:
        raise CheckpointError(f"checkpoint {path} has no {engine!r} model (it holds {', '.join(manifest['engines'])})")
    listed = manifest["engines"][engine]
    if "params_hash" in listed and param_hash(listed.get("params", [])) != listed["params_hash"]:
        raise CheckpointError(f"checkpoint {path}: the {engine} parameter list in manifest.json does not match its "
                              "params_hash (edited or damaged); export a checkpoint as it was written")
    prefix = listed.get("hf_prefix", "")
    reader = safe_reader(state_dir(path, engine))
    md = reader.read_metadata().state_dict_metadata
    head = f"{engine}.model.{prefix}"
    out = []
    for name, shape, _ in listed["params"]:
        key = f"{engine}.model.{name}"
        if key not in md or not hasattr(md[key], "chunks"):
            raise CheckpointError(f"checkpoint {path}: parameter {name!r} is listed in the manifest but not stored")
        if list(md[key].size) != list(shape):
            raise CheckpointError(f"checkpoint {path}: parameter {name!r} is stored with shape {list(md[key].size)}, "
                                  f"the manifest lists {list(shape)} (params_hash); the checkpoint was altered, export "
                                  "one as it was written")
        out.append((key[len(head):], key, tuple(md[key].size), md[key].properties.dtype))
    return reader, out


def _read(path: str, reader, entries) -> dict[str, torch.Tensor]:
    """Full tensors of some parameters (DCP reads only the chunks they need)."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    targets = {key: torch.empty(shape, dtype=dtype) for _, key, shape, dtype in entries}
    try:
        with single_process_quiet():
            dcp_load(targets, storage_reader=reader, planner=tensor_only_planner(), no_dist=True)
    except (Exception, CheckpointException) as e:
        inner = dcp_error(e)
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(f"checkpoint {path}: reading tensors failed ({type(inner).__name__}: {inner})") from None
    return {name: targets[key] for name, key, _, _ in entries}


def load_model_tensors(path: str, engine: str = "actor", *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters of `engine` from checkpoint `path`, in HF names, on CPU (the whole model)."""
    reader, entries = _stored(path, engine, verify)
    return _read(path, reader, entries)


def _target_dtype(dtype: str, config) -> torch.dtype:
    """The export dtype; auto: the original model's (config.json)."""
    if dtype == "auto":
        target = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if not isinstance(target, torch.dtype):
            target = DTYPES.get(str(target).removeprefix("torch."), torch.float32)
        return target
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise CheckpointError(f"export dtype {dtype!r}: use auto, {', '.join(DTYPES)}")


def _save_tokenizer(path: str, hf_dir: str, out_dir: str) -> None:
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    except (OSError, ValueError) as e:
        log.warning("checkpoint %s: no tokenizer exported (%s)", path, e)
    copy_image_processor(hf_dir, out_dir)


def check_out_dir(out_dir: str) -> None:
    """The export target must be new or an empty directory: files already there (an older model.safetensors)
    would sit beside the new shards, and from_pretrained could load them instead."""
    if os.path.isdir(out_dir):
        held = sorted(os.listdir(out_dir))
        if held:
            raise CheckpointError(f"export --out {out_dir}: the directory is not empty (it holds "
                                  f"{', '.join(held[:3])}{' ...' if len(held) > 3 else ''}); give a new or empty "
                                  "directory (files left there could be loaded instead of the export)")
    elif os.path.lexists(out_dir):
        raise CheckpointError(f"export --out {out_dir}: it is a file, not a directory; give a new or empty directory")


@contextlib.contextmanager
def _staged(out_dir: str):
    """A temporary directory beside `out_dir`, renamed to it when the export is complete: a failed export
    leaves no half-written model there."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.export-", dir=parent)
    except OSError as e:
        raise CheckpointError(f"export --out {out_dir}: cannot write there ({e.strerror or e}); choose a writable "
                              "directory") from None
    try:
        yield tmp
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (check_out_dir); rename replaces no files
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _hf_config(path: str, hf_dir: str):
    """hf/config.json as a transformers config, or a one-line CheckpointError when it does not load."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(hf_dir)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: hf/config.json does not load as a model config ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}); the checkpoint was edited or damaged") from None


def export_hf(checkpoint: str, out_dir: str, *, dtype: str = "auto", engine: str = "actor", verify: bool = True,
              bucket_bytes: int = 1 << 30, merged: bool = False) -> str:
    """Checks the target (new or empty, check_out_dir), then writes the export into a temporary directory
    beside it and renames it into place when complete (`_export`)."""
    check_out_dir(out_dir)
    path = find_checkpoint(checkpoint)
    with _staged(out_dir) as tmp:
        _export(path, tmp, dtype=dtype, engine=engine, verify=verify, bucket_bytes=bucket_bytes, merged=merged)
    log.info("export written to %s", out_dir)
    return out_dir


def _export(path: str, out_dir: str, *, dtype: str = "auto", engine: str = "actor", verify: bool = True,
            bucket_bytes: int = 1 << 30, merged: bool = False) -> str:
    """Write `engine`'s weights from `checkpoint` (a checkpoint dir, or a run's output_dir: its latest) as an
    HF model directory `out_dir`, streamed: DCP reads one bucket of parameters (about bucket_bytes in the export
    dtype) at a time, which is cast and written as one safetensors file (engines/hf_writer.py). dtype auto keeps
    the original model's dtype (config.json). A LoRA checkpoint gives a PEFT adapter directory, or with `merged`
    the base model with the adapters merged in (export_lora)."""
    from transformers import AutoModelForCausalLM

    from spmdrl.engines.hf_writer import ShardWriter
    from spmdrl.reshard.plan import group_by_bytes

    hf_dir = os.path.join(path, "hf")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise CheckpointError(f"checkpoint {path}: hf/config.json is missing; it cannot be exported")
    if "adapter" in read_manifest(path)["engines"].get(engine, {}):
        return export_lora(path, out_dir, dtype=dtype, engine=engine, verify=verify, merged=merged)
    if merged:
        raise CheckpointError(f"checkpoint {path} holds the whole {engine} model, not LoRA adapters; export it without --merged")
    reader, entries = _stored(path, engine, verify)
    config = _hf_config(path, hf_dir)
    target = _target_dtype(dtype, config)
    try:
        with torch.device("meta"):  # the names and shapes the model in hf/config.json expects: nothing allocated
            model = AutoModelForCausalLM.from_config(config, dtype=target)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: hf/config.json does not describe a causal LM transformers can build "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    stored = {name: shape for name, _, shape, _ in entries}
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    wrong = sorted(n for n in set(expected) & set(stored) if expected[n] != stored[n])
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"checkpoint {path}: its {engine} weights do not fit the model in hf/config.json "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {wrong[:3]})"
        )
    esize = torch.empty((), dtype=target).element_size()
    by_name = {e[0]: e for e in entries}
    buckets = group_by_bytes([(e[0], torch.Size(e[2]).numel() * esize) for e in entries], bucket_bytes)
    writer = ShardWriter(out_dir, len(buckets))
    for names in buckets:
        writer.write([(n, t.to(target)) for n, t in _read(path, reader, [by_name[n] for n in names]).items()])
    writer.finish()
    config.use_cache = True
    config.save_pretrained(out_dir)
    _save_tokenizer(path, hf_dir, out_dir)
    log.info("exported %s (%s) from %s in %d file(s)", engine, str(target).removeprefix("torch."), path, len(buckets))
    return out_dir


def _hub_model_id(path: str) -> str | None:
    """model.path of checkpoint `path`'s config.toml when it is a hub id (not a local path)."""
    import tomllib

    from spmdrl.preflight import looks_local

    try:
        with open(os.path.join(path, "config.toml"), "rb") as f:
            given = tomllib.load(f).get("model", {}).get("path", "")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return given if given and not looks_local(given) and not os.path.exists(given) else None


def export_lora(path: str, out_dir: str, *, dtype: str = "auto", engine: str = "actor", verify: bool = True,
                merged: bool = False) -> str:
    """A LoRA checkpoint's adapters as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors,
    what peft.PeftModel.from_pretrained and vLLM's LoRARequest load; dtype auto keeps the stored float32), or
    with `merged` an HF model directory: the base model (adapter_config's base_model_name_or_path, loaded whole in
    the export dtype) with W + (alpha / r) B A merged in by PEFT, so peak memory is the whole model."""
    from spmdrl.models.lora import is_adapter, peft_name, write_adapter

    hf_dir = os.path.join(path, "hf")
    config = dict(read_manifest(path)["engines"][engine]["adapter"])
    hub_id = _hub_model_id(path)
    if hub_id:  # the run read a hub id from a local snapshot: PEFT users expect the id
        config["base_model_name_or_path"] = hub_id
    reader, entries = _stored(path, engine, verify)
    tensors = _read(path, reader, [e for e in entries if is_adapter(e[0])])
    if not merged:
        cast = None if dtype == "auto" else _target_dtype(dtype, None)
        write_adapter(out_dir, [(peft_name(n), t if cast is None else t.to(cast)) for n, t in tensors.items()], config)
        _save_tokenizer(path, hf_dir, out_dir)
        log.info("exported %s's LoRA adapters (%d tensors) from %s", engine, len(tensors), path)
        return out_dir
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = config.get("base_model_name_or_path") or ""
    target = _target_dtype(dtype, _hf_config(path, hf_dir))
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=target)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot load its base model {base!r} to merge the adapters into "
                              f"({str(e).splitlines()[0]}); make it readable at that path") from None
    with tempfile.TemporaryDirectory() as tmp:
        write_adapter(tmp, [(peft_name(n), t) for n, t in tensors.items()], config)
        model = PeftModel.from_pretrained(model, tmp).merge_and_unload()
    model.config.use_cache = True
    model.save_pretrained(out_dir)
    _save_tokenizer(path, hf_dir, out_dir)
    log.info("exported %s merged with its LoRA adapters (%s) from %s", base, str(target).removeprefix("torch."), path)
    return out_dir
