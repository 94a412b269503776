"""`spmdrl export`: a checkpoint's model as an HF model directory (safetensors, config, tokenizer).

Runs in one plain process, no torchrun: DCP reads the sharded tensors without a process group and reshards
them into full tensors. The checkpoint's manifest, sizes and checksums are verified first. Peak memory is one
copy of the model in the export dtype (plus the fp32 copy while casting), on CPU.
"""
from __future__ import annotations

import logging
import os

import torch

from spmdrl.checkpoint.dcp import dcp_error, safe_reader, single_process_quiet, tensor_only_planner
from spmdrl.checkpoint.files import find_checkpoint, sha256
from spmdrl.checkpoint.verify import check_files, read_manifest
from spmdrl.errors import CheckpointError

log = logging.getLogger("spmdrl")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model_tensors(path: str, engine: str = "actor", *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters of `engine` from checkpoint `path`, in HF names, on CPU."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    manifest = read_manifest(path)
    check_files(path, manifest)
    if verify:
        for rel, info in sorted(manifest["files"].items()):
            if rel.startswith("state/") and sha256(os.path.join(path, rel)) != info["sha256"]:
                raise CheckpointError(f"checkpoint {path}: {rel} failed the checksum (corrupted on disk)")
    if engine not in manifest["engines"]:
        raise CheckpointError(f"checkpoint {path} has no {engine!r} model (it holds {', '.join(manifest['engines'])})")
    prefix = manifest["engines"][engine].get("hf_prefix", "")
    reader = safe_reader(os.path.join(path, "state"))
    md = reader.read_metadata().state_dict_metadata
    targets = {}
    for name, _, _ in manifest["engines"][engine]["params"]:
        key = f"{engine}.model.{name}"
        if key not in md or not hasattr(md[key], "chunks"):
            raise CheckpointError(f"checkpoint {path}: parameter {name!r} is listed in the manifest but not stored")
        targets[key] = torch.empty(tuple(md[key].size), dtype=md[key].properties.dtype)
    try:
        with single_process_quiet():
            dcp_load(targets, storage_reader=reader, planner=tensor_only_planner(), no_dist=True)
    except (Exception, CheckpointException) as e:
        inner = dcp_error(e)
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(f"checkpoint {path}: reading tensors failed ({type(inner).__name__}: {inner})") from None
    head = f"{engine}.model.{prefix}"
    return {k[len(head):]: v for k, v in targets.items()}


def export_hf(checkpoint: str, out_dir: str, *, dtype: str = "auto", engine: str = "actor", verify: bool = True) -> str:
    """Write `engine`'s weights from `checkpoint` (a checkpoint dir, or a run's output_dir: its latest) as an
    HF model directory `out_dir`. dtype auto keeps the original model's dtype (config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = find_checkpoint(checkpoint)
    hf_dir = os.path.join(path, "hf")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise CheckpointError(f"checkpoint {path}: hf/config.json is missing; it cannot be exported")
    tensors = load_model_tensors(path, engine, verify=verify)
    config = AutoConfig.from_pretrained(hf_dir)
    if dtype == "auto":
        target = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if not isinstance(target, torch.dtype):
            target = DTYPES.get(str(target).removeprefix("torch."), torch.float32)
    elif dtype in DTYPES:
        target = DTYPES[dtype]
    else:
        raise CheckpointError(f"export dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    tensors = {k: v.to(target) for k, v in tensors.items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=target)
    result = model.load_state_dict(tensors, assign=True, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"checkpoint {path}: its {engine} weights do not fit the model in hf/config.json "
            f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, state_dict=dict(tensors), safe_serialization=True)  # it consumes the dict
    try:
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    except (OSError, ValueError) as e:
        log.warning("checkpoint %s: no tokenizer exported (%s)", path, e)
    log.info("exported %s (%s) from %s to %s", engine, str(target).removeprefix("torch."), path, out_dir)
    return out_dir
