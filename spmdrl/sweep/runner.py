"""Running a sweep: run state, local execution one run after another, Slurm array scripts."""
from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from typing import Callable

from spmdrl.errors import ConfigError

from .spec import NOT_RESULTS, OWNED, SEED_KEY, Run, Sweep, _err, _get  # noqa: F401


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
    for cfg in (old, new):  # a run records its output directory made absolute (spmdrl/train.py)
        if cfg["trainer"]["output_dir"]:
            cfg["trainer"]["output_dir"] = os.path.abspath(cfg["trainer"]["output_dir"])
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


def check_inputs_exist(sweep: Sweep) -> None:
    """Refuse to start while a run's data or model files are missing (`sweep plan` lists them all)."""
    for run in sweep.runs:
        if run.missing:
            raise _err(sweep.path, f"run '{run.name}': {run.missing}")


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
        if r.missing:
            lines.append(f"     missing input: {r.missing}")
    missing = sum(bool(r.missing) for r in sweep.runs)
    if missing:
        lines.append(f"{missing} of {len(sweep.runs)} runs miss input files; `spmdrl sweep run` refuses to start until "
                     "they exist")
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
              echo: Callable[[str], None] = print, launch_command: Callable | None = None) -> list[tuple[Run, int]]:
    """Run the unfinished runs one after another; returns the failed ones with their exit codes.
    launch_command(module, config, overrides, nproc) -> argv is the CLI's (`spmdrl train`'s) launcher."""
    if launch_command is None:
        raise ValueError("run_local needs the launcher: pass launch_command=spmdrl.cli.launch_command")

    check_existing(sweep)
    if not dry_run:
        check_inputs_exist(sweep)
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
    check_inputs_exist(sweep)
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
