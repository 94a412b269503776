"""User reward functions ("path/to/file.py:fn" or "package.module:fn") and batch scoring.

A reward function has verl's signature and is called with keywords:
    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float | {"score": float, ...}
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import sys
from typing import Callable

import torch

from spmdrl.errors import RewardError

_SPEC_FORMS = "'path/to/file.py:function' or 'package.module:function'"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]


def reward_fn_name(fn: Callable) -> str:
    """How errors name a reward function: its spec when loaded from one, else module:qualname."""
    name = getattr(fn, "__spmdrl_spec__", None)
    if name:
        return name
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{module}:{qualname}"


def _load_file(path: str, spec: str):
    digest = hashlib.sha1(path.encode()).hexdigest()[:8]
    stem = os.path.splitext(os.path.basename(path))[0]
    mod_name = f"_spmdrl_reward_{stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"reward function {spec!r}: cannot load {path} as a Python file; point at a .py file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look modules up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise RewardError(
            f"reward function {spec!r}: importing {path} raised {type(e).__name__}: {_one_line(e)}; fix the file"
        ) from e
    return module


def _import_module(target: str, spec: str):
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise RewardError(
                f"reward function {spec!r}: module {target!r} not found; install it, add it to PYTHONPATH, "
                f"or use {_SPEC_FORMS}"
            ) from e
        raise RewardError(
            f"reward function {spec!r}: importing {target} raised ModuleNotFoundError: {_one_line(e)}"
        ) from e
    except Exception as e:
        raise RewardError(
            f"reward function {spec!r}: importing {target} raised {type(e).__name__}: {_one_line(e)}"
        ) from e


def load_reward_fn(spec: str) -> Callable:
    """Resolve `spec` to a callable; every failure is a one-line RewardError naming the spec."""
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardError(f"reward function {spec!r}: expected {_SPEC_FORMS}")
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise RewardError(f"reward function {spec!r}: expected {_SPEC_FORMS}")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise RewardError(f"reward function {spec!r}: file {target} not found; check reward.custom_fn")
        module = _load_file(path, spec)
    else:
        module = _import_module(target, spec)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise RewardError(
                f"reward function {spec!r}: {target} has no {attr!r} (callables there: "
                f"{', '.join(defined) or 'none'}); fix the name after ':'"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"reward function {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    try:
        obj.__spmdrl_spec__ = spec
    except (AttributeError, TypeError):
        pass
    return obj


def _as_score(value, name: str, i: int) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {name} returned {type(value).__name__} for sample {i}; "
            "return a float or a dict with a float 'score'"
        )
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"reward function {name} returned {value} for sample {i}; scores must be finite")
    return value


def compute_rewards(
    fn: Callable,
    data_sources: list[str],
    solution_strs: list[str],
    ground_truths: list[str],
    extra_infos: list[dict] | None = None,
) -> tuple[torch.Tensor, dict[str, list]]:
    """Score a batch: (scores float32 [B], extras {key: list of B values, None where a sample lacked it})."""
    n = len(solution_strs)
    extra_infos = [None] * n if extra_infos is None else extra_infos
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError(
            f"compute_rewards got {len(data_sources)} data sources, {n} solutions, {len(ground_truths)} ground "
            f"truths and {len(extra_infos)} extra infos; they must match"
        )
    name = reward_fn_name(fn)
    scores, rows = [], []
    for i in range(n):
        try:
            out = fn(
                data_source=data_sources[i],
                solution_str=solution_strs[i],
                ground_truth=ground_truths[i],
                extra_info=extra_infos[i],
            )
        except Exception as e:
            raise RewardError(
                f"reward function {name} raised on sample {i} (data_source {data_sources[i]!r}): "
                f"{type(e).__name__}: {_one_line(e)}"
            ) from e
        if isinstance(out, dict):
            if "score" not in out:
                raise RewardError(
                    f"reward function {name} returned a dict without 'score' for sample {i} "
                    f"(keys: {', '.join(map(str, out))}); add a 'score' entry"
                )
            scores.append(_as_score(out["score"], name, i))
            rows.append({k: v for k, v in out.items() if k != "score"})
        else:
            scores.append(_as_score(out, name, i))
            rows.append({})
    keys = list(dict.fromkeys(k for row in rows for k in row))
    extras = {k: [row.get(k) for row in rows] for k in keys}
    return torch.tensor(scores, dtype=torch.float32), extras
