"""The sweep file: loading, validation, the expansion of axes into runs and their names."""
from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import tomllib

from spmdrl.errors import ConfigError, SpmdrlError

SEED_KEY = "trainer.seed"
OWNED = ("trainer.output_dir",)  # set per run by the sweep
TOP_KEYS = ("base", "output_dir", "nproc", "mode", "overrides", "seeds", "labels", "axes", "slurm")
SLURM_KEYS = {"nodes": int, "gpus_per_node": int, "cpus_per_task": int, "time": str, "partition": str,
              "account": str, "max_parallel": int, "extra": list}
# Differences in these keys do not make an existing run directory belong to another run.
NOT_RESULTS = ("logging.", "checkpoint.resume", "trainer.total_steps", "trainer.dist_timeout_s", "trainer.experiment_name")
# (column, summarize_run key) of the report table
COLUMNS = (
    ("steps", "steps"),
    ("val_acc final", "val/accuracy last"),
    ("val_acc best", "val/accuracy best"),
    ("reward last5", "train/reward last 5"),
    ("step_s", "timing/step_s (median)"),
    ("tok/s", "perf/tokens_per_s (median)"),
)
PLOTS = (("train/reward_mean", "reward.png"), ("val/accuracy", "val_accuracy.png"))


@dataclass
class Run:
    """One point of the sweep."""

    index: int
    name: str
    values: dict[str, Any]  # axis key -> value
    overrides: list[str]  # everything after `--config base` (shared overrides, axis values, output dir)
    output_dir: str
    total_steps: int
    cfg: Any = field(repr=False, default=None)
    missing: str = ""  # an input file that does not exist (spmdrl.preflight.check_inputs), shown by `sweep plan`

    @property
    def group(self) -> str:
        """The name without the seed: runs that differ only by seed share it."""
        return _name({k: v for k, v in self.values.items() if k != SEED_KEY}, list(self.values)) or "all"


@dataclass
class Sweep:
    path: str  # the sweep file
    base: str  # the base config, as passed to --config
    output_dir: str
    nproc: int
    mode: str
    overrides: list[str]
    axes: dict[str, list]
    slurm: dict[str, Any]
    runs: list[Run]

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]


def _tracker_overrides(lg, sweep_name: str, point: dict[str, Any], path: str) -> list[str]:
    """wandb / MLflow: the sweep is the group (unless logging.group is set), each run is tagged with its
    axis values (`actor.lr=1e-06`); the run name is the run directory's name."""
    out = [] if lg.group or "logging.group" in point else [f"logging.group={override_value(sweep_name, path)}"]
    if "logging.tags" not in point:
        tags = [*lg.tags, *(f"{k}={override_value(v, path, k)}" for k, v in point.items())]
        out.append(f"logging.tags={override_value(tags, path)}")
    return out


# --- loading, expanding, validating ---------------------------------------------------------------------


def _err(path: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {msg}")


def _strip_override_origin(e: Exception) -> str:
    from spmdrl.config.loader import OVERRIDE

    msg = str(e)
    return msg[len(OVERRIDE) + 2:] if msg.startswith(OVERRIDE + ": ") else msg


def override_value(v: Any, path: str = "sweep", key: str = "") -> str:
    """A TOML value as an override's right-hand side: plain words stay bare, other strings are quoted."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        if re.fullmatch(r"[A-Za-z0-9_./:+-]+", v) and v.lower() not in ("none", "null"):
            try:
                tomllib.loads(f"v = {v}")  # parses as a number, bool or date: quote it to keep it a string
            except tomllib.TOMLDecodeError:
                return v
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(json.dumps(x, ensure_ascii=False) if isinstance(x, str) else override_value(x, path, key)
                               for x in v) + "]"
    raise _err(path, f"axes.\"{key}\": value {v!r} is a table; axis values are strings, numbers, booleans or lists")


def _short(key: str, keys: list[str]) -> str:
    last = key.rsplit(".", 1)[-1]
    return last if sum(k.rsplit(".", 1)[-1] == last for k in keys) == 1 else key


def _label(v: Any) -> str:
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, list):
        s = "+".join(_label(x) for x in v) or "none"
    else:
        s = repr(v) if isinstance(v, float) else str(v)
    s = re.sub(r"[^A-Za-z0-9._+-]", "_", s)
    if len(s) > 40:
        s = s[:32] + "~" + hashlib.sha1(s.encode()).hexdigest()[:6]
    return s


def _name(values: dict[str, Any], keys: list[str]) -> str:
    return "__".join(f"{_short(k, keys)}-{_label(v)}" for k, v in values.items())


def expand(axes: dict[str, list], mode: str, seeds: list | None = None) -> list[dict[str, Any]]:
    """The points of the sweep, in order: axis key -> value. Seeds are crossed with the points in both modes."""
    keys = list(axes)
    if mode == "zip":
        points = [dict(zip(keys, vals)) for vals in zip(*axes.values())] if keys else [{}]
    else:
        points = [dict(zip(keys, vals)) for vals in itertools.product(*axes.values())]
    if seeds:
        points = [{**p, SEED_KEY: s} for p in points for s in seeds]
    return points


def _names(points: list[dict[str, Any]], labels: list[str] | None = None, seeds: list | None = None) -> list[str]:
    """Short, filesystem-safe names from the axis values (or the zip points' `labels`, plus the seed); a hash
    of the values keeps colliding names apart."""
    keys = list(points[0]) if points else []
    if labels:
        per = len(seeds) if seeds else 1
        names = [labels[i // per] + (f"__seed-{p[SEED_KEY]}" if seeds else "") for i, p in enumerate(points)]
    else:
        names = [_name(p, keys) or "base" for p in points]
    counts = {n: names.count(n) for n in names}
    return [n if counts[n] == 1 else f"{n}__{hashlib.sha1(json.dumps(p, sort_keys=True).encode()).hexdigest()[:6]}"
            for n, p in zip(names, points)]


def _get(cfg, key: str):
    sec, name = key.split(".", 1)
    return getattr(getattr(cfg, sec), name)


def _check_type(path: str, key: str, v, tp, what: str):
    ok = isinstance(v, tp) and not (tp is int and isinstance(v, bool))
    if not ok:
        raise _err(path, f"'{key}' must be {what}, found {v!r}")
    return v


def load_sweep(path: str, nproc: int | None = None, slurm: bool = False) -> Sweep:
    """Read, expand and validate a sweep file: every run's config is loaded and validated for its world size
    (nproc ranks; nproc * slurm.nodes with slurm=True)."""
    from spmdrl.config import load_config, validate
    from spmdrl.preflight import check_inputs, resolve_total_epochs

    if not os.path.isfile(path):
        raise ConfigError(f"sweep file not found: {path}; check the path")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise _err(path, f"invalid TOML: {e}") from None
    for k in data:
        if k not in TOP_KEYS:
            match = difflib.get_close_matches(k, TOP_KEYS, n=1, cutoff=0.5)
            hint = f"did you mean '{match[0]}'?" if match else f"valid keys: {', '.join(TOP_KEYS)}"
            raise _err(path, f"unknown key '{k}'; {hint} (config keys go in [axes] or overrides)")
    if "base" not in data:
        raise _err(path, "missing key 'base': the base config file, relative to the sweep file")
    base = _check_type(path, "base", data["base"], str, "a path string")
    base = base if os.path.isabs(base) else os.path.join(os.path.dirname(os.path.abspath(path)), base)
    if not os.path.isfile(base):
        raise _err(path, f"base config not found: {base}; 'base' is relative to the sweep file")
    rel = os.path.relpath(base)
    base = base if rel.startswith("..") else rel
    if "output_dir" not in data:
        raise _err(path, "missing key 'output_dir': each run goes to <output_dir>/<run name>")
    output_dir = _check_type(path, "output_dir", data["output_dir"], str, "a path string")
    if not output_dir:
        raise _err(path, "'output_dir' is empty")
    nproc = nproc if nproc is not None else _check_type(path, "nproc", data.get("nproc", 1), int, "an integer")
    if nproc < 1:
        raise _err(path, f"'nproc' must be >= 1, found {nproc}")
    mode = data.get("mode", "grid")
    if mode not in ("grid", "zip"):
        raise _err(path, f"'mode' must be \"grid\" or \"zip\", found {mode!r}")
    overrides = _check_type(path, "overrides", data.get("overrides", []), list, "a list of \"section.key=value\" strings")
    if not all(isinstance(o, str) for o in overrides):
        raise _err(path, f"'overrides' must be a list of \"section.key=value\" strings, found {overrides!r}")
    overrides = [o[2:] if o.startswith("--") else o for o in overrides]
    axes = _check_type(path, "axes", data.get("axes", {}), dict, "a table [axes] of \"section.key\" = [values]")
    seeds = data.get("seeds")
    if seeds is not None:
        _check_type(path, "seeds", seeds, list, "a list of integers")
        if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            raise _err(path, f"'seeds' must be a non-empty list of integers, found {seeds!r}")
        if SEED_KEY in axes:
            raise _err(path, f"both 'seeds' and axes.\"{SEED_KEY}\" are set; keep one")
    labels = data.get("labels")
    if labels is not None:
        n_points = len(next(iter(axes.values()), []))
        if mode != "zip" or not isinstance(labels, list) or len(labels) != n_points or not all(
                isinstance(x, str) and re.fullmatch(r"[A-Za-z0-9._+-]+", x) for x in labels) or len(set(labels)) != len(labels):
            raise _err(path, f"'labels' names the zip points: mode = \"zip\", one distinct name per point ({n_points}), "
                             f"letters, digits and ._+- only; found {labels!r}")
    slurm_opts = _check_type(path, "slurm", data.get("slurm", {}), dict, "a table [slurm]")
    for k, v in slurm_opts.items():
        if k not in SLURM_KEYS:
            raise _err(path, f"unknown key 'slurm.{k}'; valid keys: {', '.join(SLURM_KEYS)}")
        _check_type(path, f"slurm.{k}", v, SLURM_KEYS[k], f"of type {SLURM_KEYS[k].__name__}")
        if k == "extra" and not all(isinstance(x, str) for x in v):
            raise _err(path, f"'slurm.extra' must be a list of sbatch option strings, found {v!r}")
    if not axes and not seeds:
        raise _err(path, "no axes: add a table [axes] with \"section.key\" = [values], or 'seeds'")

    # the base and the shared overrides alone
    try:
        load_config(base)
    except ConfigError as e:
        raise _err(path, f"base = {data['base']!r}: {e}") from None
    for o in overrides:
        if o.split("=", 1)[0].strip() in OWNED:
            raise _err(path, f"overrides: {o.split('=', 1)[0]} is set per run to <output_dir>/<run name>; "
                             "set 'output_dir' at the top of the sweep file instead")
    try:
        shared = load_config(base, overrides)
    except ConfigError as e:
        raise _err(path, f"overrides: {_strip_override_origin(e)}") from None
    # each axis value alone, so an error names its axis
    for key, values in axes.items():
        where = f"axes.\"{key}\""
        if key in OWNED:
            raise _err(path, f"{where}: set per run to <output_dir>/<run name>; it cannot be an axis")
        if not isinstance(values, list):
            raise _err(path, f"{where} must be a list of values, found {values!r}")
        if not values:
            raise _err(path, f"{where} is empty; give at least one value")
        for v in values:
            try:
                cfg = load_config(base, [*overrides, f"{key}={override_value(v, path, key)}"])
            except ConfigError as e:
                raise _err(path, f"{where}: {_strip_override_origin(e)}") from None
            if _get(cfg, key) != v:  # the value did not survive the trip through an override string
                raise _err(path, f"{where}: value {v!r} resolves to {_get(cfg, key)!r}; write it as the key's type")
    if mode == "zip" and len({len(v) for v in axes.values()}) > 1:
        lengths = ", ".join(f"\"{k}\" has {len(v)}" for k, v in axes.items())
        raise _err(path, f"mode = \"zip\" needs axes of equal length: {lengths}")

    points = expand(axes, mode, seeds)
    sweep_name = os.path.splitext(os.path.basename(path))[0]
    world = nproc * (slurm_opts.get("nodes", 1) if slurm else 1)
    runs = []
    for i, (name, point) in enumerate(zip(_names(points, labels, seeds), points)):
        out = os.path.join(output_dir, name)
        run_overrides = [*overrides, *(f"{k}={override_value(v, path, k)}" for k, v in point.items()),
                         f"trainer.output_dir={out}", *_tracker_overrides(shared.logging, sweep_name, point, path)]
        try:
            cfg = load_config(base, run_overrides)
            validate(cfg, world)
        except ConfigError as e:
            raise _err(path, f"run '{name}': {_strip_override_origin(e)}") from None
        try:
            check_inputs(cfg)
            resolve_total_epochs(cfg)
            missing = ""
        except SpmdrlError as e:
            missing = str(e)
        runs.append(Run(i, name, point, run_overrides, out, cfg.trainer.total_steps, cfg, missing))
    all_axes = {**axes, **({SEED_KEY: seeds} if seeds else {})}
    return Sweep(path, base, output_dir, nproc, mode, overrides, all_axes, slurm_opts, runs)


# --- state of a run's output directory ------------------------------------------------------------------
