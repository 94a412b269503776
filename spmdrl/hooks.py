"""Per-stage user hooks: Python functions that run at named stages of the RL step.

A hook file (named in `hooks.files`, as a path or an importable module) registers functions with the
decorator below; every rank imports it and runs the same hooks on its own part of the batch:

    from spmdrl.hooks import hook

    @hook("after_reward")
    def shape(ctx):
        ctx.batch["scores"] = ctx.batch["scores"] - 0.01 * ctx.batch["response_len"]
        ctx.log("shaping/penalty_mean", 0.01 * ctx.batch["response_len"].float().mean())

Hooks change the batch in place (`ctx.batch[...] = ...`, `ctx.batch.meta[...]`); samples are dropped with
`ctx.keep(mask)` at after_rollout / after_reward only. After each hook the runner checks the contract (the
batch object, its tensors' shapes, its row counts) so a violation fails at once with the hook named.
See docs/hooks.md for what each stage may change.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from spmdrl.errors import ConfigError, HookError

STAGES = (
    "after_rollout",    # responses generated; batch has prompts/responses/logprobs; may drop samples (ctx.keep)
    "after_reward",     # scores computed; may change batch["scores"] (token_level_scores are built from them), ctx.keep
    "after_advantage",  # advantages/returns computed; may change them (same shapes)
    "before_update",    # right before the actor/critic update
    "after_update",     # after the update, before the weight sync
    "after_step",       # metrics of the step are final (may add more)
    "on_validation",    # validation batch scored; may add metrics
)

FILTER_STAGES = ("after_rollout", "after_reward")  # before the trainer evens out sample counts over ranks

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

    def keep(self, mask) -> None:
        """Drop samples in place: keep the rows where `mask` (bool [B]) is True, or the rows listed (indices),
        in every tensor and meta list. Only at after_rollout and after_reward (docs/hooks.md, Filtering)."""
        if self.stage not in FILTER_STAGES:
            raise ValueError(f"ctx.keep is allowed at {' and '.join(FILTER_STAGES)} only, not at {self.stage} "
                             "(later stages run after the ranks' sample counts were evened out)")
        mask = torch.as_tensor(mask)
        if mask.numel() == 0:
            mask = mask.long()
        if mask.dtype.is_floating_point or mask.dtype.is_complex:
            raise ValueError(f"ctx.keep: mask is {mask.dtype}; give a bool mask (e.g. batch['truncated'] == 0) "
                             "or row indices")
        if mask.dtype == torch.bool and tuple(mask.shape) != (len(self.batch),):
            raise ValueError(f"ctx.keep: mask has shape {list(mask.shape)}, the batch has {len(self.batch)} samples")
        self.batch.keep_(mask)

    def decode(self, key: str = "responses") -> list[str]:
        """Decoded text of "responses" (default) or "prompts" in the batch, padding removed."""
        if key not in ("responses", "prompts"):
            raise ValueError(f"ctx.decode({key!r}): only 'responses' and 'prompts' hold token ids")
        lens = self.batch["response_len"] if key == "responses" else self.batch["prompt_len"]
        ids = self.batch[key]
        return self.tokenizer.batch_decode([ids[i, : int(lens[i])].tolist() for i in range(len(self.batch))],
                                           skip_special_tokens=True)


def _load(spec: str) -> None:
    if spec.endswith(".py") or os.sep in spec:
        path = os.path.abspath(os.path.expanduser(spec))
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
            if spec in sys.modules:  # imported before (e.g. it also holds the reward fn): run its decorators again
                importlib.reload(sys.modules[spec])
            else:
                importlib.import_module(spec)
        except ImportError as e:
            raise ConfigError(f"hooks.files: cannot import module {spec!r} ({e}); give a .py path or a module on sys.path") from e
        except Exception as e:
            raise ConfigError(f"hooks.files: importing {spec!r} failed: {type(e).__name__}: {e}") from e


class HookRunner:
    """The hooks registered by the files in `hooks.files`, in file order then definition order."""

    def __init__(self, files: list[str]):
        self.by_stage: dict[str, list[Callable]] = {s: [] for s in STAGES}
        self.names: dict[Callable, str] = {}  # fn -> "file-or-module:qualname", for error messages
        for spec in files:
            start = len(_PENDING)
            _load(spec)
            added = _PENDING[start:]
            del _PENDING[start:]
            if not added:
                raise ConfigError(f"hooks.files: {spec!r} registers no hooks; decorate functions with @spmdrl.hooks.hook(stage)")
            for stage, fn in added:
                self.by_stage[stage].append(fn)
                self.names[fn] = f"{spec}:{getattr(fn, '__qualname__', fn)}"

    def __bool__(self) -> bool:
        return any(self.by_stage.values())

    def run(self, stage: str, ctx: HookContext) -> dict[str, float]:
        for fn in self.by_stage[stage]:
            name = self.names.get(fn) or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
            batch, rows = ctx.batch, len(ctx.batch)
            shapes = {k: tuple(v.shape) for k, v in batch.tensors.items()}
            try:
                fn(ctx)
            except Exception as e:
                msg = " ".join(str(e).split())[:500]  # one line, however the hook's exception reads
                raise HookError(
                    f"hook {name} failed at stage {stage} (step {ctx.step}): {type(e).__name__}: {msg}"
                ) from e
            problem = _contract_violation(ctx, batch, rows, shapes)
            if problem:
                raise HookError(f"hook {name} at stage {stage} (step {ctx.step}) {problem} (see docs/hooks.md)")
        return ctx.metrics


class StageHooks:
    """The run's hooks bound to what every HookContext carries (config, meshes, tokenizer): what the loop's
    components call at each stage."""

    def __init__(self, runner: HookRunner, config, meshes, tokenizer):
        self.runner, self.config, self.meshes, self.tokenizer = runner, config, meshes, tokenizer

    def __call__(self, stage: str, step: int, batch, metrics: dict | None = None) -> dict[str, float]:
        """Run `stage`'s hooks on `batch`; the metrics they logged (none if no hook is registered there)."""
        if not self.runner.by_stage[stage]:
            return {}
        ctx = HookContext(stage, step, self.config, batch, self.meshes, self.tokenizer, metrics=metrics or {})
        before = set(ctx.metrics)
        self.runner.run(stage, ctx)
        return {k: v for k, v in ctx.metrics.items() if k not in before}


def _contract_violation(ctx: HookContext, batch, rows: int, shapes: dict[str, tuple]) -> str | None:
    """What a hook did to the batch that the trainer cannot follow, or None."""
    if ctx.batch is not batch:
        return ("replaced ctx.batch, which the trainer never sees; change its tensors and meta in place, "
                "or drop samples with ctx.keep(mask)")
    n = len(batch)
    if n != rows and ctx.stage not in FILTER_STAGES:
        return (f"changed the number of samples from {rows} to {n}; samples may be dropped at "
                f"{' and '.join(FILTER_STAGES)} only")
    for k, shape in shapes.items():
        if k not in batch.tensors:
            return f"removed tensor {k!r}; hooks may change values and add tensors, not remove them"
        now = tuple(batch.tensors[k].shape)
        if now[1:] != shape[1:]:
            return f"changed the shape of {k!r} from {list(shape)} to {list(now)}; tensors must keep their shapes"
    for k, v in [*batch.tensors.items(), *batch.meta.items()]:
        size = len(v) if hasattr(v, "__len__") else None
        if size != n:
            return f"left {k!r} with {size} rows while the batch has {n}; drop samples with ctx.keep(mask) only"
    return None
