"""Checks before a checkpoint is loaded: the marker, the manifest, every file's size, the model's parameters,
the engines and the config; and which checkpoint a run resumes from (checkpoint.resume). Each failure is a
one-line CheckpointError saying what does not match."""
from __future__ import annotations

import fnmatch
import logging
import os
import tomllib

from spmdrl.errors import CheckpointError

from .dcp import engine_manifest
from .files import (
    _STEP_DIR, FORMAT, MANIFEST, MARKER, checkpoint_root, find_checkpoint, is_complete, list_checkpoints, read_json,
)

log = logging.getLogger("spmdrl")

# Config keys that may differ between a checkpoint and the run resuming from it: how long and where the run
# goes, its layout (DCP reshards), logging and memory knobs. Any other difference changes what the saved
# state means and is refused.
MAY_CHANGE_ON_RESUME = (
    "trainer.total_steps", "trainer.output_dir", "trainer.overwrite", "trainer.experiment_name", "trainer.device",
    "trainer.dist_timeout_s", "trainer.max_bad_steps", "trainer.test_freq", "trainer.val_before_train",
    "checkpoint.*", "logging.*", "placement.*", "ref.*",
    "model.path", "model.tokenizer_path", "model.gradient_checkpointing", "model.attn_implementation",
    "actor.micro_batch_size", "actor.logprob_chunk_size", "critic.micro_batch_size",
    "rollout.gpu_memory_utilization", "rollout.kv_cache_gb", "rollout.max_num_seqs",
    "rollout.max_num_batched_tokens", "rollout.enforce_eager", "rollout.enable_sleep_mode",
    "rollout.weight_sync_bucket_mb", "rollout.val_*", "data.val_files", "data.val_batch_size",
    "reward.timeout_s", "reward.on_error", "reward.model_micro_batch_size",
)


def read_manifest(path: str) -> dict:
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: no such directory")
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker); use an earlier checkpoint")
    m = read_json(os.path.join(path, MANIFEST), f"checkpoint {path}")
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict) or not isinstance(m.get("engines"), dict):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed (needs 'files' and 'engines')")
    if m.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {m.get('format')!r}, this spmdrl reads format {FORMAT}")
    problem = _manifest_problem(m)
    named = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if not problem and named and int(named.group(1)) != m.get("step", int(named.group(1))):
        problem = f"step {m.get('step')} in a directory named for step {int(named.group(1))}"
    if problem:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed ({problem}); the checkpoint was edited or "
                              "damaged, use an earlier one")
    return m


def _manifest_problem(m: dict) -> str | None:
    """What is structurally wrong with a manifest that parsed as JSON (an edited one), else None."""
    for rel, info in m["files"].items():
        if not isinstance(info, dict) or not isinstance(info.get("size"), int) or not isinstance(info.get("sha256"), str):
            return f"files[{rel!r}] needs an integer 'size' and a string 'sha256'"
        if os.path.isabs(rel) or ".." in rel.split("/"):
            return f"files[{rel!r}] is not a path inside the checkpoint"
    if not isinstance(m.get("step", 0), int) or isinstance(m.get("step", 0), bool):
        return f"step {m.get('step')!r} is not an integer"
    for name, eng in m["engines"].items():
        if not isinstance(eng, dict) or not isinstance(eng.get("params"), list):
            return f"engines[{name!r}] needs a 'params' list"
        for p in eng["params"]:
            if not (isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and isinstance(p[2], str)
                    and isinstance(p[1], list) and all(isinstance(d, int) for d in p[1])):
                return f"engines[{name!r}].params holds {p!r}, not [name, shape, dtype]"
    return None


def check_files(path: str, manifest: dict) -> None:
    """Every file the manifest lists is there with its size (cheap; checksums are checked separately)."""
    for rel, info in sorted(manifest["files"].items()):
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            raise CheckpointError(
                f"checkpoint {path}: file {rel} is missing; the checkpoint is damaged, use an earlier one"
            )
        size = os.path.getsize(p)
        if size != info.get("size"):
            how = "truncated" if size < info["size"] else "grown: bytes were appended or it was overwritten"
            raise CheckpointError(
                f"checkpoint {path}: file {rel} has {size} bytes, the manifest says {info['size']} ({how}); use an "
                "earlier checkpoint"
            )


def check_compatible(path: str, manifest: dict, engines: dict, config_toml: str | None) -> None:
    """One-line CheckpointError naming what differs between the checkpoint and this run."""
    saved = manifest["engines"]
    if engines and set(saved) != set(engines):  # a rank holding no engine (split placement's rollout ranks) checks none
        raise CheckpointError(f"checkpoint {path} holds engines {sorted(saved)}, this run has {sorted(engines)} "
                              "(e.g. a critic was enabled or disabled since)")
    for name, engine in engines.items():
        mine, theirs = engine_manifest(engine), saved[name]
        if ("adapter" in mine) != ("adapter" in theirs):
            held = "LoRA adapters" if "adapter" in theirs else "the whole model"
            raise CheckpointError(f"checkpoint {path} holds {held} for {name}, this run trains "
                                  f"{'LoRA adapters' if 'adapter' in mine else 'the whole model'}; set lora.enable = "
                                  f"{'true' if 'adapter' in theirs else 'false'} to resume it")
        if "adapter" in mine and mine["adapter"].get("base_model_name_or_path") != theirs["adapter"].get("base_model_name_or_path"):
            log.warning("checkpoint %s: its %s adapters were trained on %s, this run's base model is %s", path, name,
                        theirs["adapter"].get("base_model_name_or_path"), mine["adapter"].get("base_model_name_or_path"))
        if mine["params_hash"] == theirs.get("params_hash"):
            continue
        a = {p[0]: p for p in theirs.get("params", [])}
        b = {p[0]: p for p in mine["params"]}
        only_ckpt, only_run = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        diffs = [f"{k}: {a[k][1]} {a[k][2]} in the checkpoint, {b[k][1]} {b[k][2]} here"
                 for k in a if k in b and a[k] != b[k]]
        detail = "; ".join(
            ([f"only in the checkpoint: {_first(only_ckpt)}"] if only_ckpt else [])
            + ([f"only in this model: {_first(only_run)}"] if only_run else [])
            + diffs[:3]
        )
        hint = "check model.path and lora.rank / lora.target_modules" if "adapter" in mine else "check model.path"
        raise CheckpointError(f"checkpoint {path} is for a different {name} model ({detail}); {hint}")
    if config_toml is not None:
        check_saved_config(path, config_toml)


def _first(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "")


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


def check_metadata(path: str, manifest: dict) -> None:
    """Every DCP `.metadata` file the manifest lists unpickles through the allowlist (dcp.safe_reader) into DCP's
    Metadata: a crafted or damaged one is refused here, in one line, before any rank enters DCP's collectives
    (which would wrap the refusal in their own assertion)."""
    from .dcp import safe_reader

    for rel in sorted(manifest["files"]):
        if os.path.basename(rel) == ".metadata":
            safe_reader(os.path.join(path, os.path.dirname(rel))).read_metadata()


def check_trainer_state(path: str, manifest: dict) -> None:
    """trainer.json agrees with the manifest on the step (an edited manifest would make a run skip steps or
    claim there is nothing left to train)."""
    state = read_json(os.path.join(path, "trainer.json"), f"checkpoint {path}")
    if not isinstance(state, dict) or state.get("step") != manifest.get("step"):
        got = state.get("step") if isinstance(state, dict) else state
        raise CheckpointError(f"checkpoint {path}: trainer.json is at step {got!r}, {MANIFEST} says step "
                              f"{manifest.get('step')!r}; the checkpoint was edited or damaged, use an earlier one")


def intact(path: str) -> str | None:
    """None when `path` looks loadable without reading tensors (marker, manifest, every file and its size, the
    step recorded in each place, DCP's metadata), else why not."""
    try:
        manifest = read_manifest(path)
        check_files(path, manifest)
        if "trainer.json" in manifest["files"]:
            check_trainer_state(path, manifest)
        check_metadata(path, manifest)
        return None
    except CheckpointError as e:
        return str(e)


def newest_intact(root: str) -> str | None:
    """The newest complete checkpoint under `root` that passes `intact`, warning about each newer damaged one."""
    for _, path in reversed(list_checkpoints(root)):
        why = intact(path)
        if why is None:
            return path
        log.warning("checkpoint.resume = auto: skipping damaged checkpoint %s (%s); trying an earlier one", path, why)
    return None


def check_saved_config(path: str, config_toml: str) -> None:
    """Refuse a checkpoint whose config.toml differs from the run's in a key that changes what it means."""
    try:
        with open(os.path.join(path, "config.toml"), encoding="utf-8") as f:
            theirs = tomllib.loads(f.read())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: config.toml is unreadable ({e})") from None
    diffs = config_differences(theirs, tomllib.loads(config_toml))
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} was written with a different config: {'; '.join(diffs[:4])}"
            f"{' ...' if len(diffs) > 4 else ''}; resume with its values (its config.toml) or checkpoint.resume=off"
        )


def resolve_resume(cfg) -> str | None:
    """What checkpoint.resume asks for: None (start fresh) or a complete checkpoint directory."""
    mode = cfg.checkpoint.resume
    if mode == "off":
        return None
    if mode == "auto":  # the newest intact one: a damaged newest is skipped with a warning
        return newest_intact(checkpoint_root(cfg.trainer.output_dir))
    try:
        return find_checkpoint(mode)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint.resume = {mode!r}: {e}") from None
