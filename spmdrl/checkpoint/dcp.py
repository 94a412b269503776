"""torch.distributed.checkpoint without arbitrary unpickling, and an engine's state through DCP's state-dict API.

DCP pickles two things: its `.metadata` (read here through an allowlist of DCP's own metadata classes) and
non-tensor values (which spmdrl never stores, so the load planner refuses them). Tensors are read with
torch.load(weights_only=True) by DCP itself.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import io
import json
import os
import pickle
import pickletools
import warnings
from typing import Any

import torch

from spmdrl.errors import CheckpointError

from .files import jsonable

_METADATA = "torch.distributed.checkpoint.metadata"
# Exact (module, name) pairs DCP's `.metadata` is made of (torch 2.x): its dataclasses, torch.Size, the
# dtype/layout/memory-format constants and the helpers torch pickles them with. Nothing else resolves: no
# dotted names (protocol 4 would walk attributes, e.g. metadata -> os -> system), no other member of an
# allowed module.
_ALLOWED_GLOBALS = frozenset({
    *((_METADATA, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                               "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    *(("torch", n) for n, v in vars(torch).items()
      if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)) and "." not in n),
})
# Opcodes that reach code or state outside the pickle without find_class (persistent ids, the copyreg
# extension registry, out-of-band buffers) or instantiate classes the old way; DCP never writes them.
_REFUSED_OPCODES = frozenset({"PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "INST", "OBJ", "NEXT_BUFFER",
                              "READONLY_BUFFER"})


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(
        f"DCP metadata {what}, which checkpoint metadata never contains; refusing to unpickle it (the checkpoint was "
        "tampered with or is not an spmdrl checkpoint)"
    )


class _MetadataUnpickler(pickle._Unpickler):
    """DCP's `.metadata` is a pickle; resolve only the exact names in _ALLOWED_GLOBALS.

    The pure-Python unpickler, so BUILD can be checked too: BUILD on a class would set attributes of an
    allowed class (state applied to a type, not an instance)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise _refuse(f"refers to {module}.{name}")
        return getattr(importlib.import_module(module), name)  # a plain attribute: never a dotted walk

    def load_build(self):
        if isinstance(self.stack[-2], type):
            raise _refuse(f"sets attributes of the class {self.stack[-2].__qualname__}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build


def unpickle_metadata(data: bytes):
    """The object in DCP metadata bytes `data`, refusing every global outside _ALLOWED_GLOBALS and every
    opcode in _REFUSED_OPCODES (CheckpointError); pickle errors propagate."""
    for op, _, _ in pickletools.genops(data):
        if op.name in _REFUSED_OPCODES:
            raise _refuse(f"uses the pickle opcode {op.name}")
    return _MetadataUnpickler(io.BytesIO(data)).load()


def safe_reader(path: str):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open(os.path.join(str(self.path), name), "rb") as f:
                try:
                    md = unpickle_metadata(f.read())
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(
                        f"checkpoint {path}: DCP metadata is corrupted ({type(e).__name__}: {e})"
                    ) from None
            from torch.distributed.checkpoint.metadata import Metadata

            if not isinstance(md, Metadata):
                raise CheckpointError(f"checkpoint {path}: DCP metadata is corrupted (it holds a "
                                      f"{type(md).__name__}, not DCP's Metadata)")
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeFileSystemReader(path)


def tensor_only_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorOnlyLoadPlanner(DefaultLoadPlanner):
        """Our DCP state holds tensors only; DCP would torch.load (unrestricted) any other object."""

        def load_bytes(self, read_item, value):
            raise CheckpointError(
                f"checkpoint holds a pickled object at {read_item.dest_index.fqn!r}; spmdrl checkpoints hold tensors "
                "only, refusing to unpickle it"
            )

    return TensorOnlyLoadPlanner()


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it 'assumes the intent' when it runs without a process group; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def dcp_error(e: BaseException) -> BaseException:
    """The first underlying exception of a DCP CheckpointException (which wraps each rank's failure)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return e


def describe_error(e: BaseException) -> str:
    e = dcp_error(e)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"no space left on device ({e}); free space or lower checkpoint.keep_last"
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# ---- engines' state ------------------------------------------------------------------------------------

def param_spec(module: torch.nn.Module) -> list[list]:
    """[name, global shape, dtype] of every parameter (DTensor shapes are the unsharded ones)."""
    return [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in module.named_parameters()]


def param_hash(spec: list) -> str:
    """The manifest's params_hash of an engine's [name, shape, dtype] list."""
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def _options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None


def module_state(module, optimizer=None, scheduler=None, trainable_only: bool = False) -> tuple[dict, dict]:
    """(tensors for DCP, JSON: optimizer param groups + LR scheduler) of a module and its optimizer, through
    DCP's state-dict API so FSDP2 shards save and reshard. trainable_only: the parameters that require grad
    (LoRA adapters; the frozen base comes from the base model)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(module, options=_options(trainable_only))}, {}
    msd, osd = get_state_dict(module, optimizer, options=_options(trainable_only))
    meta = {"param_groups": jsonable(osd["param_groups"])}
    if scheduler is not None:
        meta["scheduler"] = jsonable({k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"})
    return {"model": msd, "optim": osd["state"]}, meta


def load_module_state(module, optimizer, scheduler, tensors: dict, meta: dict, trainable_only: bool = False) -> None:
    """Put DCP-loaded tensors (and the JSON metadata) back into a module, its optimizer and scheduler."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if optimizer is None:
        set_model_state_dict(module, tensors["model"], options=_options(trainable_only))
        return
    groups = [{k: tuple(v) if isinstance(optimizer.defaults.get(k), tuple) else v for k, v in g.items()}
              for g in meta["param_groups"]]  # JSON made tuples (betas) lists
    set_state_dict(module, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optim"], "param_groups": groups}, options=_options(trainable_only))
    if scheduler is not None and "scheduler" in meta:
        scheduler.load_state_dict({**scheduler.state_dict(), **meta["scheduler"]})


def engine_state(engine) -> tuple[dict, dict]:
    """(tensors for DCP, JSON metadata) of a training engine (engines/base.py)."""
    return engine.checkpoint_state()


def engine_manifest(engine) -> dict:
    spec = engine.param_manifest()
    out = {"params": spec, "params_hash": param_hash(spec), "hf_prefix": engine.hf_prefix(),
           "optimizer": "AdamW" if engine.trainable else None}
    if engine.lora is not None:  # adapters only: the base weights are the model at adapter_config's base path
        out["adapter"] = engine.adapter_config()
    return out
