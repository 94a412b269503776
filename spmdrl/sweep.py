"""Ablation sweeps: one base config, axes of overrides, one training run per point.

    spmdrl sweep plan configs/ablations/estimators.toml     # the runs, their overrides and state
    spmdrl sweep run configs/ablations/estimators.toml      # run them one after another (or --slurm)
    spmdrl sweep report configs/ablations/estimators.toml   # comparison table + reward / val accuracy plots

A sweep file:

    base = "../quickstart/grpo.toml"          # relative to the sweep file
    output_dir = "outputs/sweeps/estimators"  # run i goes to <output_dir>/<name i> (relative to the cwd)
    nproc = 2                                 # ranks per run (per node under Slurm)
    mode = "grid"                             # grid: every combination; zip: the i-th value of every axis
    overrides = ["trainer.total_steps=30"]    # applied to every run
    seeds = [0, 1]                            # trainer.seed, crossed with the other axes even in zip mode
    [axes]
    "algorithm.adv_estimator" = ["grpo", "rloo"]

Everything is checked before anything starts: every run's config is loaded and validated exactly as
`spmdrl train` would. A run is finished when its metrics.jsonl ends at trainer.total_steps.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable

from spmdrl.errors import ConfigError, DataError

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
    return ",".join(f"{_short(k, keys)}={_label(v)}" for k, v in values.items())


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
        names = [labels[i // per] + (f",seed={p[SEED_KEY]}" if seeds else "") for i, p in enumerate(points)]
    else:
        names = [_name(p, keys) or "base" for p in points]
    counts = {n: names.count(n) for n in names}
    return [n if counts[n] == 1 else f"{n},{hashlib.sha1(json.dumps(p, sort_keys=True).encode()).hexdigest()[:6]}"
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
        load_config(base, overrides)
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
    world = nproc * (slurm_opts.get("nodes", 1) if slurm else 1)
    runs = []
    for i, (name, point) in enumerate(zip(_names(points, labels, seeds), points)):
        out = os.path.join(output_dir, name)
        run_overrides = [*overrides, *(f"{k}={override_value(v, path, k)}" for k, v in point.items()),
                         f"trainer.output_dir={out}"]
        try:
            cfg = load_config(base, run_overrides)
            validate(cfg, world)
        except ConfigError as e:
            raise _err(path, f"run '{name}': {_strip_override_origin(e)}") from None
        runs.append(Run(i, name, point, run_overrides, out, cfg.trainer.total_steps, cfg))
    all_axes = {**axes, **({SEED_KEY: seeds} if seeds else {})}
    return Sweep(path, base, output_dir, nproc, mode, overrides, all_axes, slurm_opts, runs)


# --- state of a run's output directory ------------------------------------------------------------------


def steps_done(run: Run) -> int:
    """The step of the last record of the run's metrics.jsonl; -1 when there is none."""
    from spmdrl.metrics import read_jsonl

    path = os.path.join(run.output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return -1
    records = [r for r in read_jsonl(path) if "step" in r]
    return int(records[-1]["step"]) if records else -1


def is_finished(run: Run) -> bool:
    return steps_done(run) >= run.total_steps


def config_changes(run: Run) -> list[str]:
    """Keys on which the config.toml in the run's output directory differs from the planned config."""
    from spmdrl.config import load_config

    path = os.path.join(run.output_dir, "config.toml")
    if not os.path.isfile(path):
        return []
    try:
        old = dataclasses.asdict(load_config(path))
    except ConfigError:  # written by an older schema; nothing to compare against
        return []
    new = dataclasses.asdict(run.cfg)
    return [f"{sec}.{k}" for sec in new for k in new[sec]
            if old[sec][k] != new[sec][k] and not f"{sec}.{k}".startswith(NOT_RESULTS)]


def state(run: Run) -> str:
    """new | done | partial k/N, plus the changed keys when the directory holds a different run."""
    done = steps_done(run)
    s = "new" if done < 0 else "done" if done >= run.total_steps else f"partial {done}/{run.total_steps}"
    changed = config_changes(run) if done >= 0 else []
    return f"{s}, config changed: {', '.join(changed)}" if changed else s


def check_existing(sweep: Sweep) -> None:
    """Refuse to reuse an output directory that holds a run of another config (results would mix)."""
    for run in sweep.runs:
        changed = config_changes(run) if steps_done(run) >= 0 else []
        if changed:
            raise _err(sweep.path, f"run '{run.name}': {run.output_dir} holds a run with a different "
                                   f"{', '.join(changed)}; move it away to rerun, or change 'output_dir'")


def format_plan(sweep: Sweep) -> str:
    lines = [
        f"sweep {sweep.path}: {len(sweep.runs)} runs ({sweep.mode} over {', '.join(sweep.axes)}), "
        f"{sweep.nproc} rank(s) each",
        f"base: {sweep.base}",
        f"output: {sweep.output_dir}/<name>",
        f"every run: {' '.join(sweep.overrides) or '(no shared overrides)'}",
    ]
    width = max(len(r.name) for r in sweep.runs)
    for r in sweep.runs:
        axis_overrides = r.overrides[len(sweep.overrides):-1]
        lines.append(f"{r.index:>3}  {r.name.ljust(width)}  [{state(r)}]  {' '.join(axis_overrides)}")
    return "\n".join(lines)


# --- running --------------------------------------------------------------------------------------------


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    for k, v in (("OMP_NUM_THREADS", "1"), ("VLLM_LOGGING_LEVEL", "ERROR"), ("TOKENIZERS_PARALLELISM", "false")):
        env.setdefault(k, v)
    return env


def _execute(cmd: list[str], log_path: str, stream: bool) -> int:
    """Run cmd with stdout+stderr appended to log_path (and echoed when stream); returns the exit code."""
    with open(log_path, "ab") as log:
        log.write(f"\n$ {shlex.join(cmd)}  # {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if stream else log, stderr=subprocess.STDOUT, env=run_env())
        try:
            if stream:
                for line in proc.stdout:
                    log.write(line)
                    sys.stdout.buffer.write(line)
                    sys.stdout.flush()
            return proc.wait()
        except KeyboardInterrupt:  # the ranks got the same Ctrl-C; let them shut down, then stop the sweep
            proc.wait()
            raise


def _tail(path: str, n: int = 15) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.rstrip() for line in f.read().splitlines()[-n:]]


def run_local(sweep: Sweep, *, fail_fast: bool = False, dry_run: bool = False, stream: bool = False,
              echo: Callable[[str], None] = print) -> list[tuple[Run, int]]:
    """Run the unfinished runs one after another; returns the failed ones with their exit codes."""
    from spmdrl.cli import launch_command

    check_existing(sweep)
    failed = []
    n = len(sweep.runs)
    for run in sweep.runs:
        head = f"[{run.index + 1}/{n}] {run.name}"
        done = steps_done(run)
        if done >= run.total_steps:
            echo(f"{head}: finished ({done}/{run.total_steps} steps), skipped")
            continue
        cmd = launch_command("spmdrl.train", sweep.base, run.overrides, sweep.nproc)
        log_path = os.path.join(run.output_dir, "launch.log")
        if dry_run:
            echo(f"{head}: {shlex.join(cmd)}")
            continue
        again = f"again (stopped at step {done}/{run.total_steps}; resumes from its latest checkpoint, if any)"
        echo(f"{head}: starting{' ' + again if done >= 0 else ''}, log {log_path}")
        os.makedirs(run.output_dir, exist_ok=True)
        start = time.monotonic()
        rc = _execute(cmd, log_path, stream)
        took = time.monotonic() - start
        if rc == 0 and not is_finished(run):
            rc = -1  # exited cleanly without reaching the last step
        if rc == 0:
            echo(f"{head}: finished in {took:.0f} s")
            continue
        echo(f"{head}: FAILED (exit {rc}) after {took:.0f} s; last lines of {log_path}:")
        for line in _tail(log_path):
            echo(f"    {line}")
        failed.append((run, rc))
        if fail_fast:
            break
    return failed


# --- Slurm ----------------------------------------------------------------------------------------------


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (sbatch --array syntax)."""
    parts, start = [], None
    for i, x in enumerate(ids):
        start = x if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            parts.append(str(x) if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts)


def slurm_script(sweep: Sweep, runs: list[Run], workdir: str) -> str:
    """An sbatch array script: task i runs sweep.runs[i] (only the given runs' indices are submitted)."""
    s = sweep.slurm
    indices = _ranges([r.index for r in runs])
    throttle = f"%{s['max_parallel']}" if s.get("max_parallel") else ""
    gpus = s.get("gpus_per_node", sweep.nproc)
    header = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name=spmdrl-sweep-{sweep.name}",
        f"#SBATCH --array={indices}{throttle}",
        f"#SBATCH --nodes={s.get('nodes', 1)}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --output=slurm/logs/%x-%A_%a.out",
    ]
    if gpus:
        header.append(f"#SBATCH --gpus-per-node={gpus}")
    for key, opt in (("cpus_per_task", "cpus-per-task"), ("time", "time"), ("partition", "partition"), ("account", "account")):
        if key in s:
            header.append(f"#SBATCH --{opt}={s[key]}")
    header += [f"#SBATCH {x}" for x in s.get("extra", [])]
    body = [
        f"# Sweep {sweep.path}: {len(sweep.runs)} runs, {len(runs)} submitted (finished runs are left out).",
        f"# Written by `spmdrl sweep run --slurm {sweep.path}`; array task i runs run i of `spmdrl sweep plan`.",
        "set -euo pipefail",
        f"cd {shlex.quote(workdir)}",
        "mkdir -p slurm/logs",
        f"export GPUS_PER_NODE={sweep.nproc}",
        'case "${SLURM_ARRAY_TASK_ID:?submit this script with sbatch}" in',
    ]
    for r in sweep.runs:
        body.append(f"  {r.index}) RUN={shlex.quote(r.name)}; OVERRIDES=({' '.join(shlex.quote(o) for o in r.overrides)}) ;;")
    body += [
        '  *) echo "no run for SLURM_ARRAY_TASK_ID=$SLURM_ARRAY_TASK_ID" >&2; exit 1 ;;',
        "esac",
        'echo "sweep run $SLURM_ARRAY_TASK_ID: $RUN"',
        f"srun --ntasks-per-node=1 launch/torchrun_slurm.sh -m spmdrl.train --config {shlex.quote(sweep.base)} "
        '"${OVERRIDES[@]}"',
    ]
    return "\n".join(header + body) + "\n"


def write_slurm(sweep: Sweep, out_dir: str = "slurm") -> tuple[str | None, list[Run]]:
    """Write slurm/sweep_<name>.sbatch for the unfinished runs; (path or None when all finished, those runs)."""
    check_existing(sweep)
    todo = [r for r in sweep.runs if not is_finished(r)]
    if not todo:
        return None, []
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"sweep_{sweep.name}.sbatch")
    with open(path, "w", encoding="utf-8") as f:
        f.write(slurm_script(sweep, todo, os.getcwd()))
    os.chmod(path, 0o755)
    return path, todo


# --- report ---------------------------------------------------------------------------------------------


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(header), "-" * len(line(header)), *(line(r) for r in rows)])


def summaries(sweep: Sweep) -> list[tuple[Run, dict[str, float] | None]]:
    from spmdrl.metrics import summarize_run

    return [(r, summarize_run(r.output_dir) if steps_done(r) >= 0 else None) for r in sweep.runs]


def format_report(sweep: Sweep, rows: list[tuple[Run, dict[str, float] | None]]) -> str:
    """One line per run; with several seeds, a second table of mean ± std over the seeds."""
    if not any(s for _, s in rows):
        raise DataError(f"{sweep.path}: no run has metrics under {sweep.output_dir}; run `spmdrl sweep run {sweep.path}`")
    header = ["run", "state", *(c for c, _ in COLUMNS)]
    table = [[r.name, state(r).split(",")[0], *(_fmt(s.get(k)) if s else "-" for _, k in COLUMNS)] for r, s in rows]
    out = [_table(header, table)]
    groups: dict[str, list[dict[str, float]]] = {}
    for r, s in rows:
        if s:
            groups.setdefault(r.group, []).append(s)
    if SEED_KEY in sweep.axes and any(len(g) > 1 for g in groups.values()):
        def cell(vals):
            if not vals:
                return "-"
            return _fmt(vals[0]) if len(vals) == 1 else f"{statistics.fmean(vals):.4g} ± {statistics.stdev(vals):.3g}"

        agg = [[g, str(len(ss)), *(cell([s[k] for s in ss if k in s]) for _, k in COLUMNS[1:])] for g, ss in groups.items()]
        out += ["", "mean ± std over seeds:", _table(["config", "seeds", *(c for c, _ in COLUMNS[1:])], agg)]
    return "\n".join(out)


def write_plots(sweep: Sweep, out_dir: str) -> list[str]:
    """reward.png and val_accuracy.png: one line per run; runs that differ only by seed share a colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from spmdrl.metrics import read_jsonl

    os.makedirs(out_dir, exist_ok=True)
    curves = {r.name: read_jsonl(os.path.join(r.output_dir, "metrics.jsonl"), last_per_step=True)
              for r in sweep.runs if steps_done(r) >= 0}
    groups = list(dict.fromkeys(r.group for r in sweep.runs))
    styles = ("-", "--", ":", "-.")
    written = []
    for key, filename in PLOTS:
        fig, ax = plt.subplots(figsize=(9, 5))
        seen_in_group: dict[str, int] = {}
        for r in sweep.runs:
            pts = [(row["step"], row[key]) for row in curves.get(r.name, []) if key in row]
            if not pts:
                continue
            k = seen_in_group[r.group] = seen_in_group.get(r.group, -1) + 1
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=r.name, color=f"C{groups.index(r.group) % 10}", linestyle=styles[k % len(styles)],
                    marker="o" if len(pts) < 30 else None, markersize=3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(f"{sweep.name}: {key}")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        path = os.path.join(out_dir, filename)
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


__all__ = ["Run", "Sweep", "expand", "format_plan", "format_report", "load_sweep", "run_local", "slurm_script",
           "state", "summaries", "write_plots", "write_slurm"]
