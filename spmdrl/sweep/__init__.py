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

from .report import format_report, summaries, write_plots
from .runner import check_existing, format_plan, is_finished, run_local, slurm_script, state, steps_done, write_slurm
from .spec import Run, Sweep, _names, expand, load_sweep, override_value

__all__ = ["Run", "Sweep", "_names", "check_existing", "expand", "format_plan", "format_report", "is_finished",
           "load_sweep", "override_value", "run_local", "slurm_script", "state", "steps_done", "summaries",
           "write_plots", "write_slurm"]
