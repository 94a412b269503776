"""Hub ids in the config, downloaded once per node and replaced by the local snapshot directory.

`localise_models(cfg)` runs on every rank once the process group exists, before anything reads a model. Each
model key that names a hub id (model.path, model.tokenizer_path, critic.path when the critic is on,
reward.model_path, reward.model_tokenizer_path, distill.teacher_path, distill.teacher_tokenizer_path) is downloaded by the first rank of every node into that node's
HF cache (huggingface_hub.snapshot_download, which returns at once when the snapshot is already there) while
the node's other ranks wait (spmdrl.dist.node.once_per_node). The config returned names the snapshot
directory instead, so the engines, vLLM and the tokenizers read local files only and never call the hub.
Model keys download the safetensors weights with the configs, tokenizer and remote-code files; tokenizer keys
download no weights. A key that names a local directory is left as it is (spmdrl.preflight has already
refused a local-looking path that does not exist).
"""
from __future__ import annotations

import dataclasses
import logging
import os

from spmdrl.dist.node import once_per_node
from spmdrl.errors import ConfigError
from spmdrl.preflight import looks_local

log = logging.getLogger("spmdrl")

# (section, key, enabled-when key or None, the key needs the weights)
MODEL_KEYS = (
    ("model", "path", None, True),
    ("model", "tokenizer_path", None, False),
    ("critic", "path", "enable", True),
    ("reward", "model_path", None, True),
    ("reward", "model_tokenizer_path", None, False),
    ("distill", "teacher_path", None, True),
    ("distill", "teacher_tokenizer_path", None, False),
)
FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]  # configs, tokenizers, remote code
WEIGHTS = ["*.safetensors"]
SKIP = ["original/*", "consolidated*.safetensors"]  # the same weights in another layout (Llama, Mistral repos)


def is_hub_id(path: str) -> bool:
    """An 'org/name' (or 'name') that is not a local directory."""
    return bool(path) and not looks_local(path) and not os.path.isdir(os.path.expanduser(path))


def hub_ids(cfg) -> dict[str, tuple[list[str], bool]]:
    """hub id -> (the keys naming it, whether any of them needs the weights), for the keys `cfg` has."""
    out: dict[str, tuple[list[str], bool]] = {}
    for sec, key, enabled, weights in MODEL_KEYS:
        section = getattr(cfg, sec, None)
        if section is None or (enabled and not getattr(section, enabled)):
            continue
        path = getattr(section, key)
        if is_hub_id(path):
            keys, w = out.get(path, ([], False))
            out[path] = (keys + [f"{sec}.{key}"], w or weights)
    return out


def download(repo_id: str, weights: bool) -> str:
    """The local snapshot directory of hub model `repo_id`, downloaded into the HF cache if missing."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, allow_patterns=FILES + (WEIGHTS if weights else []), ignore_patterns=SKIP)


def _download_all(wanted: dict[str, tuple[list[str], bool]]) -> dict[str, str]:
    local = {}
    for repo_id, (keys, weights) in wanted.items():
        try:
            local[repo_id] = download(repo_id, weights)
        except Exception as e:  # offline and not cached, no such repo, gated, disk full
            why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            raise ConfigError(f"{keys[0]} = {repo_id!r} is not a local directory and its download from the hub "
                              f"failed ({why}); give a local model directory, or check the id, the network and "
                              "HF_TOKEN") from None
    return local


def localise_models(cfg):
    """`cfg` with every hub id among its model keys replaced by the node-local snapshot directory (module
    docstring); `cfg` itself is not changed. Collective when the config names a hub id (every rank sees the
    same config)."""
    wanted = hub_ids(cfg)
    if not wanted:
        return cfg
    local = once_per_node(lambda: _download_all(wanted))
    sections = {}
    for sec, key, _, _ in MODEL_KEYS:
        section = sections.get(sec, getattr(cfg, sec, None))
        if section is not None and getattr(section, key) in local:
            sections[sec] = dataclasses.replace(section, **{key: local[getattr(section, key)]})
    from spmdrl.models.checkpoint import check_weights

    for repo_id, (keys, weights) in wanted.items():
        if weights:  # a download cut short
            check_weights(keys[0], local[repo_id])
        log.info("%s = %r: read from %s", " / ".join(keys), repo_id, local[repo_id])
    return dataclasses.replace(cfg, **sections)
