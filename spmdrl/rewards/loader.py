"""Resolving a reward function spec ("path/to/file.py:fn" or "package.module:fn") to a callable; every failure
is a one-line RewardError naming the spec."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Callable

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
