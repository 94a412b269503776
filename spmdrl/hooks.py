"""Per-stage user hooks: Python functions that run at named stages of the RL step.

A hook file (named in `hooks.files`, as a path or an importable module) registers functions with the
decorator below; every rank imports it and runs the same hooks on its own part of the batch:

    from spmdrl.hooks import hook

    @hook("after_reward")
    def shape(ctx):
        ctx.batch["scores"] = ctx.batch["scores"] - 0.01 * ctx.batch["response_len"]
        ctx.log("shaping/penalty_mean", 0.01 * ctx.batch["response_len"].float().mean())

See docs/hooks.md for what each stage may change.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from spmdrl.errors import ConfigError, HookError

STAGES = (
    "after_rollout",    # responses generated; batch has prompts/responses/logprobs; may drop samples (whole groups)
    "after_reward",     # scores computed; may change batch["scores"] (token_level_scores are rebuilt from them)
    "after_advantage",  # advantages/returns computed; may change them (same shapes)
    "before_update",    # right before the actor/critic update
    "after_update",     # after the update, before the weight sync
    "after_step",       # metrics of the step are final (may add more)
    "on_validation",    # validation batch scored; may add metrics
)

_PENDING: list[tuple[str, Callable]] = []


def hook(stage: str):
    """Register the decorated function `fn(ctx: HookContext) -> None` for `stage`."""
    if stage not in STAGES:
        raise ConfigError(f"unknown hook stage {stage!r}; stages: {', '.join(STAGES)}")

    def deco(fn: Callable) -> Callable:
        _PENDING.append((stage, fn))
        return fn

    return deco


@dataclass
class HookContext:
    """What a hook sees. `batch` is this rank's Batch (tensors + per-sample meta such as data_source,
    ground_truth and response_text); `mesh` is this rank's RoleMeshes; `metrics` collects what `log` adds
    (averaged over ranks with the step's other metrics)."""

    stage: str
    step: int
    config: Any
    batch: Any
    mesh: Any
    tokenizer: Any = None
    metrics: dict[str, float] = field(default_factory=dict)

    def log(self, name: str, value) -> None:
        self.metrics[name] = float(value)

    def decode(self, key: str = "responses") -> list[str]:
        """Decoded text of a token tensor in the batch (responses by default), padding removed."""
        lens = self.batch["response_len"] if key == "responses" else self.batch["prompt_len"]
        ids = self.batch[key]
        return self.tokenizer.batch_decode([ids[i, : int(lens[i])].tolist() for i in range(len(self.batch))],
                                           skip_special_tokens=True)


def _load(spec: str) -> None:
    if spec.endswith(".py") or os.sep in spec:
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise ConfigError(f"hooks.files: {spec!r} is not a file; give a .py path or an importable module")
        name = f"spmdrl_user_hooks_{abs(hash(path))}"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise ConfigError(f"hooks.files: importing {spec!r} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            importlib.import_module(spec)
        except ImportError as e:
            raise ConfigError(f"hooks.files: cannot import module {spec!r} ({e}); give a .py path or a module on sys.path") from e


class HookRunner:
    """The hooks registered by the files in `hooks.files`, in file order then definition order."""

    def __init__(self, files: list[str]):
        self.by_stage: dict[str, list[Callable]] = {s: [] for s in STAGES}
        for spec in files:
            start = len(_PENDING)
            _load(spec)
            added = _PENDING[start:]
            del _PENDING[start:]
            if not added:
                raise ConfigError(f"hooks.files: {spec!r} registers no hooks; decorate functions with @spmdrl.hooks.hook(stage)")
            for stage, fn in added:
                self.by_stage[stage].append(fn)

    def __bool__(self) -> bool:
        return any(self.by_stage.values())

    def run(self, stage: str, ctx: HookContext) -> dict[str, float]:
        for fn in self.by_stage[stage]:
            try:
                fn(ctx)
            except Exception as e:
                name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
                raise HookError(f"hook {name} failed at stage {stage} (step {ctx.step}): {type(e).__name__}: {e}") from e
        return ctx.metrics
