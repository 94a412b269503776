"""Load an object from user code named by a spec: 'path/to/file.py:name' or 'package.module:name'.

Reward functions (rewards/custom.py) and tools (tools/registry.py) are named this way in the config. Every
failure is a one-line error naming the spec, the config key and what to do. A file is imported once per path
(under a private module name), so one file can hold a reward function and tools.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
import threading

SPEC_FORMS = "'path/to/file.py:function' or 'package.module:function'"


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]


def _load_file(path: str, spec: str, what: str, error: type[Exception]):
    digest = hashlib.sha1(path.encode()).hexdigest()[:8]
    stem = os.path.splitext(os.path.basename(path))[0]
    mod_name = f"_spmdrl_user_{stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{what} {spec!r}: cannot load {path} as a Python file; point at a .py file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look modules up here
    folder = os.path.dirname(path)
    if folder not in sys.path:  # `import helpers` of a sibling helpers.py; last, so it shadows no installed module
        sys.path.append(folder)
    try:
        with _slow_import_notice(path, spec, what):
            module_spec.loader.exec_module(module)
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # sys.exit() at import is a bad file, not an exit
        del sys.modules[mod_name]
        raise error(f"{what} {spec!r}: importing {path} raised {type(e).__name__}: {one_line(e) or '(no message)'}; "
                    "fix the file") from e
    return module


SLOW_IMPORT_S = 30.0


@contextlib.contextmanager
def _slow_import_notice(target: str, spec: str, what: str):
    """One line on stderr when an import takes over SLOW_IMPORT_S (a module that blocks at import: a server
    started at top level, input(), a lock), so a run that seems stuck says where."""
    def notice():
        print(f"[spmdrl] {what} {spec!r}: importing {target} has taken over {SLOW_IMPORT_S:g}s and goes on; a module "
              "that blocks at import (a loop, input(), a server started at top level) keeps the run waiting here",
              file=sys.stderr, flush=True)

    timer = threading.Timer(SLOW_IMPORT_S, notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _import_module(target: str, spec: str, what: str, error: type[Exception]):
    try:
        with _slow_import_notice(target, spec, what):
            return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise error(
                f"{what} {spec!r}: module {target!r} not found; install it, add it to PYTHONPATH, or use {SPEC_FORMS}"
            ) from e
        raise error(f"{what} {spec!r}: importing {target} raised ModuleNotFoundError: {one_line(e)}") from e
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        raise error(f"{what} {spec!r}: importing {target} raised {type(e).__name__}: "
                    f"{one_line(e) or '(no message)'}") from e


def load_object(spec: str, *, what: str, key: str, error: type[Exception]):
    """The object `spec` names. `what` starts every message ("reward function"), `key` is the config key
    that holds the spec, `error` the exception class raised."""
    if not isinstance(spec, str) or ":" not in spec:
        raise error(f"{what} {spec!r}: expected {SPEC_FORMS}")
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise error(f"{what} {spec!r}: expected {SPEC_FORMS}")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise error(f"{what} {spec!r}: file {target} not found; check {key}")
        module = _load_file(path, spec, what, error)
    else:
        module = _import_module(target, spec, what, error)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise error(
                f"{what} {spec!r}: {target} has no {attr!r} (callables there: "
                f"{', '.join(defined) or 'none'}); fix the name after ':'"
            )
        obj = getattr(obj, part)
    return obj

