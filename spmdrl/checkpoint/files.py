"""The small files of a checkpoint: where checkpoints are, fsynced JSON, checksums, RNG states as JSON."""
from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np
import torch

from spmdrl.errors import CheckpointError

FORMAT = 1
MARKER = "COMPLETE"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"


# ---- where checkpoints are ----------------------------------------------------------------------------

def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def state_dir(path: str, engine: str) -> str:
    """The DCP directory of `engine`'s tensors in checkpoint `path`: state/<engine>/, or state/ itself in a
    checkpoint written before each engine had its own (one DCP directory for every engine)."""
    legacy = os.path.join(path, "state")
    return legacy if os.path.isfile(os.path.join(legacy, ".metadata")) else os.path.join(legacy, engine)


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


def resume_advice(output_dir: str) -> str:
    """What relaunching the same command does, for a stop or failure message: resume from the newest complete
    checkpoint under output_dir, or, with none saved yet, start over (and how to save one next time)."""
    latest = latest_checkpoint(checkpoint_root(output_dir))
    if latest:
        return f"relaunch the same command to resume from {latest}"
    return ("no checkpoint was saved yet, so relaunching the same command starts over at step 0 (it moves this "
            "attempt's metrics to output_dir/previous/); set checkpoint.save_freq (steps) or checkpoint.save_every_min "
            "to save during a run")


def find_checkpoint(path: str) -> str:
    """A complete checkpoint directory from `path`: the checkpoint itself, or the latest one under a run's
    output_dir or its checkpoints/ directory."""
    if not os.path.isdir(path):
        raise CheckpointError(
            f"checkpoint {path}: no such directory; give a checkpoint (.../checkpoints/step_N) or a run's output_dir"
        )
    if is_complete(path):
        return path
    for root in (path, checkpoint_root(path)):
        latest = latest_checkpoint(root)
        if latest:
            return latest
    if _STEP_DIR.match(os.path.basename(os.path.normpath(path))) or os.path.basename(path).startswith(TMP_PREFIX):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {MARKER} marker): it was being written when its run stopped; "
            "use an earlier checkpoint"
        )
    raise CheckpointError(f"checkpoint {path}: no complete checkpoint there or under {checkpoint_root(path)}")


# ---- JSON, checksums ------------------------------------------------------------------------------------

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


def jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{type(obj).__name__} is not JSON-able")


def write_json(path: str, obj) -> None:
    write_bytes(path, json.dumps(obj, indent=1).encode())


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{what}: file {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what}: file {path} is corrupted (not valid JSON: {e})") from None


def fsync_dir(path: str) -> None:
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


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
