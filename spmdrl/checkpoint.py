"""Sharded checkpoints: torch.distributed.checkpoint (DCP) for tensors, JSON for everything else.

    output_dir/checkpoints/
        step_00000004/
            state/            DCP: each engine's model + optimizer tensors, sharded as they were trained
            trainer.json      step, sampler, optimizer param groups, LR schedulers, loop counters (rank 0)
            rng/rank_R.json   python / numpy / torch RNG states of rank R
            hf/               model config + tokenizer, so `spmdrl export` needs nothing else
            config.toml       the resolved config
            manifest.json     format, step, world size, parameter names/shapes, every file's size and sha256
            COMPLETE          the marker: a directory without it is never resumed from
        .tmp-step_00000006/   a save in progress (or one that crashed): never resumed from

A save writes into `.tmp-step_N`, agrees across ranks that every write succeeded, then rank 0 writes the
manifest, renames the directory into place and writes the marker last; older checkpoints are deleted only
after that.
A load checks the marker, the manifest (files, sizes, model, config) and the checksums before reading a
tensor. Nothing is unpickled except DCP's own `.metadata`, through an allowlist of DCP's metadata classes.
"""
from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import tomllib
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException

from spmdrl.errors import CheckpointError

log = logging.getLogger("spmdrl")

FORMAT = 1
MARKER = "COMPLETE"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"

# Config keys that may differ between a checkpoint and the run resuming from it: how long and where the run
# goes, its layout (DCP reshards), logging and memory knobs. Any other difference changes what the saved
# state means and is refused.
MAY_CHANGE_ON_RESUME = (
    "trainer.total_steps", "trainer.output_dir", "trainer.experiment_name", "trainer.device",
    "trainer.dist_timeout_s", "trainer.max_bad_steps", "trainer.test_freq", "trainer.val_before_train",
    "checkpoint.*", "logging.*", "placement.*", "ref.*",
    "model.path", "model.tokenizer_path", "model.gradient_checkpointing",
    "actor.micro_batch_size", "actor.logprob_chunk_size", "critic.micro_batch_size",
    "rollout.gpu_memory_utilization", "rollout.kv_cache_gb", "rollout.max_num_seqs",
    "rollout.max_num_batched_tokens", "rollout.enforce_eager", "rollout.enable_sleep_mode",
    "rollout.weight_sync_bucket_mb", "rollout.val_*", "data.val_files", "data.val_batch_size",
    "reward.timeout_s", "reward.on_error", "reward.model_micro_batch_size",
)


# ---- where checkpoints are ----------------------------------------------------------------------------

def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under `root` as (step, path), oldest first. Temporary and unmarked dirs are skipped."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and is_complete(path):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest_checkpoint(root: str) -> str | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def find_checkpoint(path: str) -> str:
    """A complete checkpoint directory from `path`: the checkpoint itself, or the latest one under a run's
    output_dir or its checkpoints/ directory."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: no such directory; give a checkpoint (.../checkpoints/step_N) or a run's output_dir")
    if is_complete(path):
        return path
    for root in (path, checkpoint_root(path)):
        latest = latest_checkpoint(root)
        if latest:
            return latest
    if _STEP_DIR.match(os.path.basename(os.path.normpath(path))) or os.path.basename(path).startswith(_TMP_PREFIX):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {MARKER} marker): it was being written when its run stopped; "
            "use an earlier checkpoint"
        )
    raise CheckpointError(f"checkpoint {path}: no complete checkpoint there or under {checkpoint_root(path)}")


def resolve_resume(cfg) -> str | None:
    """What checkpoint.resume asks for: None (start fresh) or a complete checkpoint directory."""
    mode = cfg.checkpoint.resume
    if mode == "off":
        return None
    if mode == "auto":
        return latest_checkpoint(checkpoint_root(cfg.trainer.output_dir))
    try:
        return find_checkpoint(mode)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint.resume = {mode!r}: {e}") from None


# ---- JSON-able state ------------------------------------------------------------------------------------

def rng_to_json(state: dict) -> dict:
    """spmdrl.rng.rng_state() as plain lists (no pickle on load)."""
    version, internal, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    out = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": state["torch"].tolist(),
    }
    if "cuda" in state:
        out["cuda"] = [s.tolist() for s in state["cuda"]]
    return out


def rng_from_json(d: dict) -> dict:
    try:
        version, internal, gauss = d["python"]
        kind, keys, pos, has_gauss, cached = d["numpy"]
        state = {
            "python": (int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss)),
            "numpy": (str(kind), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)),
            "torch": torch.tensor(d["torch"], dtype=torch.uint8),
        }
        if "cuda" in d:
            state["cuda"] = [torch.tensor(s, dtype=torch.uint8) for s in d["cuda"]]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"RNG state is malformed ({type(e).__name__}: {e})") from None
    return state


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{type(obj).__name__} is not JSON-able")


def _write_json(path: str, obj) -> None:
    _write_bytes(path, json.dumps(obj, indent=1).encode())


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{what}: file {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what}: file {path} is corrupted (not valid JSON: {e})") from None


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- DCP with no arbitrary unpickling -------------------------------------------------------------------

_ALLOWED_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; allow only the plain data classes it is made of."""

    def find_class(self, module: str, name: str):
        ok = (
            (module, name) in _ALLOWED_GLOBALS
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)))
        )
        if not ok:
            raise CheckpointError(
                f"DCP metadata refers to {module}.{name}, which checkpoint metadata never contains; refusing to "
                "unpickle it (the checkpoint was tampered with or is not an spmdrl checkpoint)"
            )
        return super().find_class(module, name)


def _dcp_reader(path: str):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open(os.path.join(str(self.path), name), "rb") as f:
                try:
                    md = _MetadataUnpickler(io.BytesIO(f.read())).load()
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(f"checkpoint {path}: DCP metadata is corrupted ({type(e).__name__}: {e})") from None
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeFileSystemReader(path)


def _dcp_planner():
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
def _single_process_quiet():
    """DCP warns that it 'assumes the intent' when it runs without a process group; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def _dcp_error(e: BaseException) -> BaseException:
    """The first underlying exception of a DCP CheckpointException (which wraps each rank's failure)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return e


def _describe(e: BaseException) -> str:
    e = _dcp_error(e)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"no space left on device ({e}); free space or lower checkpoint.keep_last"
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# ---- engines' state ---------------------------------------------------------------------------------------

def param_spec(module: torch.nn.Module) -> list[list]:
    """[name, global shape, dtype] of every parameter (DTensor shapes are the unsharded ones)."""
    return [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in module.named_parameters()]


def _spec_hash(spec: list) -> str:
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def _hf_prefix(engine) -> str:
    hf = getattr(engine, "hf", None)
    if hf is None or hf is engine.module:
        return ""
    for name, mod in engine.module.named_modules():
        if mod is hf:
            return name + "."
    return ""


def _engine_state(engine) -> tuple[dict, dict]:
    """(tensors for DCP, JSON: optimizer param groups + LR scheduler) of an engine (`.module`, optional
    `.optimizer` and `.scheduler`), through DCP's state-dict API so FSDP2 shards save and reshard."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    opt = getattr(engine, "optimizer", None)
    if opt is None:
        return {"model": get_model_state_dict(engine.module)}, {}
    msd, osd = get_state_dict(engine.module, opt)
    sched = getattr(engine, "scheduler", None)
    meta = {"param_groups": _jsonable(osd["param_groups"])}
    if sched is not None:
        meta["scheduler"] = _jsonable({k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"})
    return {"model": msd, "optim": osd["state"]}, meta


# ---- the manager ------------------------------------------------------------------------------------------

class CheckpointManager:
    """Atomic sharded save, verified load and keep-last retention under one root directory.

    Every rank calls `save` and `load` (they are collective when a process group exists; without one they
    run in a single process, as `spmdrl export` and the unit tests do).
    """

    def __init__(self, root: str, *, keep_last: int = 2, device: torch.device | str = "cpu"):
        self.root = root
        self.keep_last = keep_last
        self.device = torch.device(device)
        self.dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.dist else 0
        self.world_size = dist.get_world_size() if self.dist else 1

    # -- collectives on one small tensor; everyone learns who failed
    def _first_failure(self, failed: bool) -> int:
        """-1 when every rank succeeded, else the lowest failing rank."""
        if not self.dist:
            return self.rank if failed else -1
        t = torch.tensor([self.world_size - self.rank if failed else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        v = int(t.item())
        return self.world_size - v if v else -1

    def _any(self, flags: list[bool]) -> list[bool]:
        if not self.dist:
            return flags
        t = torch.tensor([int(f) for f in flags] or [0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(x) for x in t.tolist()][: len(flags)]

    # -- save
    def save(self, step: int, *, engines: dict[str, Any], trainer_state: dict, config_toml: str,
             rng: dict | None = None, hf_files=None) -> str:
        """Write checkpoint `step`. engines: name -> engine; trainer_state: JSON-able (rank 0's is kept);
        rng: this rank's spmdrl.rng.rng_state(); hf_files(dir): rank 0 writes the HF config and tokenizer."""
        t0 = time.perf_counter()
        final, tmp = step_dir(self.root, step), os.path.join(self.root, f"{_TMP_PREFIX}step_{step:08d}")
        err: BaseException | None = None
        if self.rank == 0:
            try:
                os.makedirs(self.root, exist_ok=True)
                for name in os.listdir(self.root):  # a crashed save's leftovers
                    if name.startswith(_TMP_PREFIX):
                        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                os.makedirs(os.path.join(tmp, "rng"))
            except OSError as e:
                err = e
        self._raise_if_failed(err, step, tmp, "preparing")
        try:
            from torch.distributed.checkpoint import FileSystemWriter, save as dcp_save

            tensors, meta = {}, {}
            for name, engine in engines.items():
                tensors[name], meta[name] = _engine_state(engine)
            with _single_process_quiet():
                dcp_save(tensors, storage_writer=FileSystemWriter(os.path.join(tmp, "state")), no_dist=not self.dist)
        except (Exception, _CheckpointException) as e:  # DCP's exception is a BaseException
            err = _dcp_error(e)
        if err is None:  # DCP already agreed: its failures raise on every rank
            try:
                if rng is not None:
                    _write_json(os.path.join(tmp, "rng", f"rank_{self.rank}.json"), rng_to_json(rng))
                if self.rank == 0:
                    state = {"step": step, **_jsonable(trainer_state), "engines": meta}
                    _write_json(os.path.join(tmp, "trainer.json"), state)
                    _write_bytes(os.path.join(tmp, "config.toml"), config_toml.encode())
                    if hf_files is not None:
                        hf_files(os.path.join(tmp, "hf"))
            except Exception as e:
                err = e
        self._raise_if_failed(err, step, tmp, "writing")
        try:
            self._write_hashes(tmp)
        except OSError as e:
            err = e
        self._raise_if_failed(err, step, tmp, "checksumming")
        if self.rank == 0:
            try:
                manifest = self._manifest(step, engines, tmp)
                _write_json(os.path.join(tmp, MANIFEST), manifest)
                _commit(tmp, final, {"step": step, "time": time.time()})
            except OSError as e:
                err = e
        self._raise_if_failed(err, step, tmp, "committing")
        if self.rank == 0:
            self._retain()
            log.info("checkpoint step %d saved to %s in %.1fs", step, final, time.perf_counter() - t0)
        return final

    def _raise_if_failed(self, err: BaseException | None, step: int, tmp: str, what: str) -> None:
        bad = self._first_failure(err is not None)
        if bad < 0:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_checkpoint(self.root)
        keep = f"the previous checkpoint {prev} is intact" if prev else "there is no earlier checkpoint"
        cause = _describe(err) if err is not None else f"see rank {bad}'s error"
        raise CheckpointError(f"saving checkpoint step {step} under {self.root} failed while {what} on rank {bad}: "
                              f"{cause}; {keep}")

    def _files(self, d: str) -> list[str]:
        out = []
        for base, _, names in os.walk(d):
            for n in names:
                rel = os.path.relpath(os.path.join(base, n), d)
                if rel not in (MANIFEST, MARKER) and not rel.startswith(".sha-rank"):
                    out.append(rel)
        return sorted(out)

    def _write_hashes(self, tmp: str) -> None:
        files = self._files(tmp)
        mine = {rel: _sha256(os.path.join(tmp, rel)) for rel in files[self.rank:: self.world_size]}
        _write_json(os.path.join(tmp, f".sha-rank{self.rank}.json"), mine)

    def _manifest(self, step: int, engines: dict, tmp: str) -> dict:
        hashes = {}
        for r in range(self.world_size):
            p = os.path.join(tmp, f".sha-rank{r}.json")
            hashes.update(_read_json(p, "checkpoint save"))
            os.remove(p)
        files = {rel: {"size": os.path.getsize(os.path.join(tmp, rel)), "sha256": hashes[rel]} for rel in self._files(tmp)}
        return {
            "format": FORMAT, "step": step, "world_size": self.world_size, "torch": torch.__version__,
            "engines": {name: engine_manifest(e) for name, e in engines.items()},
            "files": files,
        }

    def _retain(self) -> None:
        if self.keep_last <= 0:
            return
        for _, path in list_checkpoints(self.root)[: -self.keep_last]:
            try:
                os.remove(os.path.join(path, MARKER))  # first: a half-deleted checkpoint is never complete
                shutil.rmtree(path)
            except OSError as e:
                log.warning("could not delete old checkpoint %s: %s", path, e)

    # -- load
    def load(self, path: str, *, engines: dict[str, Any], config_toml: str | None = None) -> dict:
        """Verify `path` against these engines and config, then load the engines in place. Returns the
        trainer state (JSON) with "rng" set to this rank's RNG state when the world size is unchanged."""
        manifest = read_manifest(path)
        check_files(path, manifest)
        check_compatible(path, manifest, engines, config_toml)
        self._verify_checksums(path, manifest)
        state = _read_json(os.path.join(path, "trainer.json"), f"checkpoint {path}")
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        targets = {name: _engine_state(e)[0] for name, e in engines.items()}
        try:
            with _single_process_quiet():
                dcp_load(targets, storage_reader=_dcp_reader(os.path.join(path, "state")), planner=_dcp_planner(),
                         no_dist=not self.dist)
        except (Exception, _CheckpointException) as e:
            inner = _dcp_error(e)
            if isinstance(inner, CheckpointError):
                raise inner from None
            raise CheckpointError(f"checkpoint {path}: loading tensors failed ({_describe(inner)})") from None
        for name, engine in engines.items():
            meta = state.get("engines", {}).get(name, {})
            opt = getattr(engine, "optimizer", None)
            if opt is None:
                set_model_state_dict(engine.module, targets[name]["model"])
                continue
            groups = [{k: tuple(v) if isinstance(opt.defaults.get(k), tuple) else v for k, v in g.items()}
                      for g in meta["param_groups"]]  # JSON made tuples (betas) lists
            set_state_dict(engine.module, opt, model_state_dict=targets[name]["model"],
                           optim_state_dict={"state": targets[name]["optim"], "param_groups": groups})
            sched = getattr(engine, "scheduler", None)
            if sched is not None and "scheduler" in meta:
                sched.load_state_dict({**sched.state_dict(), **meta["scheduler"]})
        rng_path = os.path.join(path, "rng", f"rank_{self.rank}.json")
        if manifest["world_size"] == self.world_size and os.path.isfile(rng_path):
            state["rng"] = rng_from_json(_read_json(rng_path, f"checkpoint {path}"))
        return state

    def _verify_checksums(self, path: str, manifest: dict) -> None:
        files = sorted(manifest["files"])
        bad = [False] * len(files)
        for i in range(self.rank, len(files), self.world_size):
            bad[i] = _sha256(os.path.join(path, files[i])) != manifest["files"][files[i]]["sha256"]
        bad = self._any(bad)
        if any(bad):
            names = [f for f, b in zip(files, bad) if b]
            raise CheckpointError(f"checkpoint {path}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
                                  "failed the checksum (corrupted on disk); use an earlier checkpoint")


def _commit(tmp: str, final: str, marker: dict) -> None:
    """Rename the finished directory into place, then write the marker: the checkpoint exists from then on."""
    if os.path.exists(final):  # a checkpoint of the same step from an earlier attempt
        old = os.path.join(os.path.dirname(final), _TMP_PREFIX + "old-" + os.path.basename(final))
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    _write_json(os.path.join(final, MARKER), marker)
    _fsync_dir(final)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def engine_manifest(engine) -> dict:
    spec = param_spec(engine.module)
    return {"params": spec, "params_hash": _spec_hash(spec), "hf_prefix": _hf_prefix(engine),
            "optimizer": type(engine.optimizer).__name__ if getattr(engine, "optimizer", None) is not None else None}


def read_manifest(path: str) -> dict:
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: no such directory")
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker); use an earlier checkpoint")
    m = _read_json(os.path.join(path, MANIFEST), f"checkpoint {path}")
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict) or not isinstance(m.get("engines"), dict):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed (needs 'files' and 'engines')")
    if m.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {m.get('format')!r}, this spmdrl reads format {FORMAT}")
    return m


def check_files(path: str, manifest: dict) -> None:
    """Every file the manifest lists is there with its size (cheap; checksums are checked separately)."""
    for rel, info in sorted(manifest["files"].items()):
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            raise CheckpointError(f"checkpoint {path}: file {rel} is missing; the checkpoint is damaged, use an earlier one")
        size = os.path.getsize(p)
        if size != info.get("size"):
            raise CheckpointError(
                f"checkpoint {path}: file {rel} has {size} bytes, the manifest says {info.get('size')} (truncated or "
                "overwritten); use an earlier checkpoint"
            )


def check_compatible(path: str, manifest: dict, engines: dict, config_toml: str | None) -> None:
    """One-line CheckpointError naming what differs between the checkpoint and this run."""
    saved = manifest["engines"]
    if set(saved) != set(engines):
        raise CheckpointError(f"checkpoint {path} holds engines {sorted(saved)}, this run has {sorted(engines)} "
                              "(e.g. a critic was enabled or disabled since)")
    for name, engine in engines.items():
        mine, theirs = engine_manifest(engine), saved[name]
        if mine["params_hash"] == theirs.get("params_hash"):
            continue
        a = {p[0]: p for p in theirs.get("params", [])}
        b = {p[0]: p for p in mine["params"]}
        only_ckpt, only_run = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        diffs = [f"{k}: {a[k][1]} {a[k][2]} in the checkpoint, {b[k][1]} {b[k][2]} here"
                 for k in a if k in b and a[k] != b[k]]
        detail = "; ".join(
            ([f"only in the checkpoint: {', '.join(only_ckpt[:3])}{' ...' if len(only_ckpt) > 3 else ''}"] if only_ckpt else [])
            + ([f"only in this model: {', '.join(only_run[:3])}{' ...' if len(only_run) > 3 else ''}"] if only_run else [])
            + diffs[:3]
        )
        raise CheckpointError(f"checkpoint {path} is for a different {name} model ({detail}); check model.path")
    if config_toml is not None:
        saved_toml = os.path.join(path, "config.toml")
        try:
            with open(saved_toml, encoding="utf-8") as f:
                theirs = tomllib.loads(f.read())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"checkpoint {path}: config.toml is unreadable ({e})") from None
        diffs = config_differences(theirs, tomllib.loads(config_toml))
        if diffs:
            raise CheckpointError(
                f"checkpoint {path} was written with a different config: {'; '.join(diffs[:4])}"
                f"{' ...' if len(diffs) > 4 else ''}; resume with its values (its config.toml) or checkpoint.resume=off"
            )


def config_differences(saved: dict, current: dict) -> list[str]:
    """'key: X in the checkpoint, Y here' for keys set in both that differ and may not change on resume."""
    out = []
    for sec, vals in current.items():
        if not isinstance(vals, dict) or not isinstance(saved.get(sec), dict):
            continue
        for key, v in vals.items():
            full = f"{sec}.{key}"
            if key not in saved[sec] or saved[sec][key] == v:
                continue
            if any(fnmatch.fnmatchcase(full, pat) for pat in MAY_CHANGE_ON_RESUME):
                continue
            out.append(f"{full} = {saved[sec][key]!r} in the checkpoint, {v!r} here")
    return out
