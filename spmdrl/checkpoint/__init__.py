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
from .files import (
    MANIFEST, MARKER, checkpoint_root, find_checkpoint, is_complete, latest_checkpoint, list_checkpoints,
    resume_advice, rng_from_json, rng_to_json, step_dir,
)
from .manager import CheckpointManager
from .verify import (
    MAY_CHANGE_ON_RESUME, check_compatible, check_files, config_differences, read_manifest, resolve_resume,
)

__all__ = [
    "MANIFEST", "MARKER", "MAY_CHANGE_ON_RESUME", "CheckpointManager", "check_compatible", "check_files",
    "checkpoint_root", "config_differences", "find_checkpoint", "is_complete", "latest_checkpoint",
    "list_checkpoints", "read_manifest", "resolve_resume", "resume_advice", "rng_from_json", "rng_to_json", "step_dir",
]
