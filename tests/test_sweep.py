"""Ablation sweeps: expanding a sweep file into runs, its errors, the Slurm array script, run/skip/fail logic,
the report; and one real sweep of two tiny training runs through the `spmdrl` command."""
import json
import os
import stat
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from spmdrl import cli, sweep
from spmdrl.cli import app
from spmdrl.errors import ConfigError

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"
BASE = """
[data]
train_files = ["data/train.parquet"]
max_prompt_length = 32
max_response_length = 8
train_batch_size = 4
[rollout]
n = 4
[actor]
micro_batch_size = 4
[model]
path = "model"
[trainer]
total_steps = 2
device = "cpu"
"""


def cli_run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, *needles):
    assert result.exit_code == 2, result.output
    err = result.stderr
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def write_sweep(tmp_path, body: str, base: str = BASE, name: str = "abl.toml", inputs: bool = True):
    """The sweep file, its base config and (inputs) the data file and model directory BASE names."""
    (tmp_path / "base.toml").write_text(base)
    if inputs:
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / "train.parquet").touch()
        (tmp_path / "model").mkdir(exist_ok=True)
    path = tmp_path / name
    path.write_text(body)
    return str(path)


GRID = """
base = "base.toml"
output_dir = "out/abl"
overrides = ["trainer.total_steps=3"]
seeds = [0, 1]
[axes]
"algorithm.adv_estimator" = ["grpo", "rloo"]
"actor.lr" = [1e-6, 3e-6]
"""


@pytest.mark.quick
def test_grid_runs_names_and_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sw = sweep.load_sweep(write_sweep(tmp_path, GRID))
    assert len(sw.runs) == 8 and sw.mode == "grid" and sw.nproc == 1
    assert [r.name for r in sw.runs[:3]] == [
        "adv_estimator-grpo__lr-1e-06__seed-0", "adv_estimator-grpo__lr-1e-06__seed-1", "adv_estimator-grpo__lr-3e-06__seed-0"]
    assert len({r.name for r in sw.runs}) == 8
    last = sw.runs[-1]
    assert last.name == "adv_estimator-rloo__lr-3e-06__seed-1"
    assert last.output_dir == os.path.join("out/abl", last.name)
    assert last.overrides == ["trainer.total_steps=3", "algorithm.adv_estimator=rloo", "actor.lr=3e-06",
                              "trainer.seed=1", f"trainer.output_dir={last.output_dir}", "logging.group=abl",
                              'logging.tags=["algorithm.adv_estimator=rloo", "actor.lr=3e-06", "trainer.seed=1"]']
    # wandb / MLflow: one group per sweep, each run tagged with its point
    assert last.cfg.logging.group == "abl"
    assert last.cfg.logging.tags == ["algorithm.adv_estimator=rloo", "actor.lr=3e-06", "trainer.seed=1"]
    assert (last.cfg.algorithm.adv_estimator, last.cfg.actor.lr, last.cfg.trainer.seed) == ("rloo", 3e-6, 1)
    assert last.total_steps == 3 and last.group == "adv_estimator-rloo__lr-3e-06"
    assert sw.base == "base.toml"  # relative to the sweep file, passed relative to the cwd

    result = cli_run("sweep", "plan", sw.path)
    assert result.exit_code == 0, result.output
    assert "8 runs (grid over algorithm.adv_estimator, actor.lr, trainer.seed)" in result.stdout
    assert "adv_estimator-rloo__lr-3e-06__seed-1  [new]  algorithm.adv_estimator=rloo actor.lr=3e-06 trainer.seed=1" in result.stdout


def test_zip_crosses_seeds_and_names_stay_unique(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sw = sweep.load_sweep(write_sweep(tmp_path, """
base = "base.toml"
output_dir = "out"
mode = "zip"
seeds = [7]
[axes]
"actor.lr" = [1e-6, 1e-5, 1e-4]
"critic.lr" = [1e-5, 1e-4, 1e-3]
"data.train_files" = [["a/x.parquet"], ["b/x.parquet"], ["a/x.parquet", "b/x.parquet"]]
"""))
    assert [r.name for r in sw.runs] == [
        "actor.lr-1e-06__critic.lr-1e-05__train_files-a_x.parquet__seed-7",
        "actor.lr-1e-05__critic.lr-0.0001__train_files-b_x.parquet__seed-7",
        "actor.lr-0.0001__critic.lr-0.001__train_files-a_x.parquet+b_x.parquet__seed-7",
    ]
    assert sw.runs[2].cfg.data.train_files == ["a/x.parquet", "b/x.parquet"]
    # values that sanitize to the same name get a hash of the values
    points = [{"model.path": "m/a"}, {"model.path": "m_a"}]
    names = sweep._names(points)
    assert names[0] != names[1] and all(n.startswith("path-m_a__") for n in names)
    # strings that would parse as another type stay strings
    assert sweep.override_value("1e-6") == '"1e-6"' and sweep.override_value("grpo") == "grpo"
    assert sweep.override_value(True) == "true" and sweep.override_value(["a b", 1]) == '["a b", 1]'


@pytest.mark.parametrize("body,needles", [
    ('base = "base.toml"\noutput_dir = "o"\n[axes]\n"actor.lrr" = [1e-6]\n', ['axes."actor.lrr"', "actor.lr"]),
    ('base = "base.toml"\noutput_dir = "o"\n[axes]\n"actor.lr" = ["fast"]\n', ['axes."actor.lr"', "expects float"]),
    ('base = "base.toml"\noutput_dir = "o"\n[axes]\n"actor.lr" = []\n', ['axes."actor.lr" is empty']),
    ('base = "base.toml"\noutput_dir = "o"\n[axes]\n"actor.lr" = 1e-6\n', ['axes."actor.lr" must be a list']),
    ('base = "base.toml"\noutput_dir = "o"\n', ["no axes"]),
    ('base = "base.toml"\noutput_dir = "o"\n[axes]\n', ["no axes"]),
    ('base = "nope.toml"\noutput_dir = "o"\n[axes]\n"actor.lr" = [1e-6]\n', ["base config not found", "nope.toml"]),
    ('output_dir = "o"\n[axes]\n"actor.lr" = [1e-6]\n', ["missing key 'base'"]),
    ('base = "base.toml"\n[axes]\n"actor.lr" = [1e-6]\n', ["missing key 'output_dir'"]),
    ('base = "base.toml"\noutput_dir = "o"\nmode = "zip"\n[axes]\n"actor.lr" = [1e-6, 2e-6]\n"rollout.n" = [4]\n',
     ['mode = "zip" needs axes of equal length', '"actor.lr" has 2', '"rollout.n" has 1']),
    ('base = "base.toml"\noutput_dir = "o"\nmode = "cartesian"\n[axes]\n"actor.lr" = [1e-6]\n', ["'mode' must be"]),
    ('base = "base.toml"\noutput_dir = "o"\nseed = [0]\n[axes]\n"actor.lr" = [1e-6]\n', ["unknown key 'seed'", "'seeds'"]),
    ('base = "base.toml"\noutput_dir = "o"\noverrides = ["actor.lr"]\nseeds = [0]\n', ["overrides:", "section.key=value"]),
    ('base = "base.toml"\noutput_dir = "o"\noverrides = ["trainer.output_dir=x"]\nseeds = [0]\n', ["trainer.output_dir"]),
    ('base = "base.toml"\noutput_dir = "o"\n[axes]\n"algorithm.adv_estimator" = ["grpo", "nope"]\n',
     ["run 'adv_estimator-nope'", "algorithm.adv_estimator", "not registered"]),
    ('base = "base.toml"\noutput_dir = "o"\nnproc = 3\n[axes]\n"rollout.n" = [4]\n', ["run 'n-4'"]),  # 4 prompts, 3 ranks
    ('base = "base.toml"\noutput_dir = "o"\nseeds = [0]\n[axes]\n"trainer.seed" = [1]\n', ["'seeds'", "trainer.seed"]),
    ('base = "base.toml"\noutput_dir = "o"\n[slurm]\nnodes = "2"\n[axes]\n"actor.lr" = [1e-6]\n', ["slurm.nodes"]),
    ('base = "base.toml"\noutput_dir = "o"\n[axes\n', ["invalid TOML"]),
], ids=["unknown-key", "wrong-type", "empty-axis", "axis-not-list", "no-axes", "empty-axes", "missing-base",
        "no-base", "no-output-dir", "zip-unequal", "bad-mode", "unknown-top-key", "bad-override", "owned-override",
        "invalid-run", "layout", "seed-twice", "slurm-type", "bad-toml"])
@pytest.mark.quick
def test_errors_are_one_line_and_name_file_and_key(tmp_path, body, needles):
    path = write_sweep(tmp_path, body)
    assert_user_error(cli_run("sweep", "plan", path), path, *needles)


def test_missing_sweep_file(tmp_path):
    assert_user_error(cli_run("sweep", "run", tmp_path / "none.toml"), "sweep file not found", "none.toml")


def fake_metrics(run_dir, steps, reward=0.5, total=None):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "val/accuracy": 0.1}) + "\n")
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "train/reward_mean": reward * s, "timing/step_s": 1.0,
                                "perf/tokens_per_s": 100.0, **({"val/accuracy": 0.1 * s} if s == steps else {})}) + "\n")


def test_plan_lists_missing_inputs_and_run_refuses_them(tmp_path, monkeypatch):
    """`sweep plan` validated the configs but not their files: a run whose data or model is missing is listed
    under its line, and `sweep run` refuses before the first run starts."""
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, 'base = "base.toml"\noutput_dir = "out"\n[axes]\n"data.train_files" = '
                       '[["data/train.parquet"], ["data/other.parquet"]]\n')
    result = cli_run("sweep", "plan", path)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    i = next(k for k, line in enumerate(lines) if "train_files-data_other.parquet" in line)
    assert lines[i + 1] == "     missing input: data.train_files: 'data/other.parquet': no such file (check the path; " \
                           "`spmdrl data` writes example files)"
    assert lines[-1] == "1 of 2 runs miss input files; `spmdrl sweep run` refuses to start until they exist"
    assert sum("missing input" in line for line in lines) == 1
    assert_user_error(cli_run("sweep", "run", path), "run 'train_files-data_other.parquet'", "'data/other.parquet': no such file")
    assert not os.path.exists("out")


def test_state_skip_resume_and_changed_config(tmp_path, monkeypatch):
    from spmdrl.config import to_toml

    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, GRID.replace("seeds = [0, 1]", "seeds = [0]"))
    sw = sweep.load_sweep(path)
    r0, r1, r2 = sw.runs[:3]
    fake_metrics(r0.output_dir, 3)
    fake_metrics(r1.output_dir, 1)
    assert [sweep.state(r) for r in sw.runs[:3]] == ["done", "partial 1/3", "new"]
    assert sweep.is_finished(r0) and not sweep.is_finished(r1)
    out = cli_run("sweep", "run", "--dry-run", path).stdout
    assert f"[1/4] {r0.name}: finished (3/3 steps), skipped" in out
    assert f"[2/4] {r1.name}: " in out and "--config base.toml" in out and f"trainer.output_dir={r1.output_dir}" in out

    # the directory holds a run of another config: plan shows it, run refuses before starting anything
    with open(os.path.join(r0.output_dir, "config.toml"), "w") as f:
        f.write(to_toml(r1.cfg).replace(r1.output_dir, r0.output_dir))
    assert sweep.state(r0).startswith("done, config changed: actor.lr")
    assert_user_error(cli_run("sweep", "run", path), f"run '{r0.name}'", "different actor.lr", "move it away")
    with open(os.path.join(r0.output_dir, "config.toml"), "w") as f:  # only the logging differs: the same run
        f.write(to_toml(r0.cfg).replace("progress = true", "progress = false"))
    assert sweep.state(r0) == "done"


def test_run_continues_past_failures_and_fail_fast(tmp_path, monkeypatch):
    """Runs launched through cli.launch_command: a stand-in 'trainer' that writes metrics, fails, or stops early."""
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, 'base = "base.toml"\noutput_dir = "out"\n[axes]\n"actor.lr" = [1e-6, 2e-6, 3e-6, 4e-6]\n')
    fake = tmp_path / "fake_train.py"
    fake.write_text(
        "import json, os, sys\n"
        "args = dict(a.split('=', 1) for a in sys.argv[1:] if '=' in a)\n"
        "out, lr = args['trainer.output_dir'], float(args['actor.lr'])\n"
        "assert os.environ['OMP_NUM_THREADS'] and os.environ['VLLM_LOGGING_LEVEL']\n"
        "if lr == 2e-6: print('boom'); sys.exit(3)\n"
        "steps = 1 if lr == 3e-6 else 2\n"
        "with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:\n"
        "    for s in range(steps + 1): f.write(json.dumps({'step': s}) + '\\n')\n"
    )
    calls = []

    def launch_command(module, config, overrides, nproc):
        calls.append(overrides[-1])
        return [sys.executable, str(fake), *overrides]

    monkeypatch.setattr(cli, "launch_command", launch_command)
    result = cli_run("sweep", "run", path)
    assert result.exit_code == 1, result.output
    assert len(calls) == 4  # went on past the failure
    assert "lr-2e-06: FAILED (exit 3)" in result.stdout and "    boom" in result.stdout
    assert "lr-3e-06: FAILED (exit -1)" in result.stdout  # exited 0 before the last step
    assert "2 of 4 runs failed: lr-2e-06 (exit 3" in result.stderr
    assert "boom" in open("out/lr-2e-06/launch.log").read()

    calls.clear()
    result = cli_run("sweep", "run", "--fail-fast", path)
    assert result.exit_code == 1 and len(calls) == 1, result.output  # the finished runs are skipped
    assert "lr-1e-06: finished (2/2 steps), skipped" in result.stdout


def test_slurm_array_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, GRID.replace("seeds = [0, 1]", "seeds = [0]\nnproc = 4").replace(
        'overrides = ["trainer.total_steps=3"]', 'overrides = ["trainer.total_steps=3", "trainer.experiment_name=\\"a b\\"", "data.train_batch_size=8"]'
    ).replace("[axes]", '[slurm]\nnodes = 2\ntime = "04:00:00"\nmax_parallel = 2\nextra = ["--exclusive"]\n[axes]'))
    sw = sweep.load_sweep(path, slurm=True)
    # the world is nproc * slurm.nodes under Slurm: 4 prompts do not split over 8 ranks
    small = write_sweep(tmp_path, open(path).read().replace("data.train_batch_size=8", "data.train_batch_size=4"), name="small.toml")
    assert cli_run("sweep", "plan", small).exit_code == 0
    assert_user_error(cli_run("sweep", "plan", "--slurm", small), "small.toml", "rollout data-parallel size 8")
    fake_metrics(sw.runs[0].output_dir, 3)  # finished: left out of the array
    result = cli_run("sweep", "run", "--slurm", path)
    assert result.exit_code == 0, result.output
    script = tmp_path / "slurm" / "sweep_abl.sbatch"
    assert f"sbatch {os.path.join('slurm', 'sweep_abl.sbatch')}" in result.stdout and "3 of 4 runs" in result.stdout
    text = script.read_text()
    for line in ("#SBATCH --array=1-3%2", "#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --time=04:00:00",
                 "#SBATCH --exclusive", "export GPUS_PER_NODE=4", "launch/torchrun_slurm.sh -m spmdrl.train --config base.toml"):
        assert line in text, text
    assert script.stat().st_mode & stat.S_IXUSR
    subprocess.run(["bash", "-n", str(script)], check=True)

    # each array task launches its own run's overrides: run the script with a stand-in srun
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (bindir / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "SLURM_ARRAY_TASK_ID": "2"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True)
    run2 = sw.runs[2]
    assert proc.stdout.splitlines() == [f"sweep run 2: {run2.name}", "--ntasks-per-node=1", "launch/torchrun_slurm.sh",
                                        "-m", "spmdrl.train", "--config", "base.toml", *run2.overrides]
    assert 'trainer.experiment_name="a b"' in run2.overrides
    bad = subprocess.run(["bash", str(script)], env={**env, "SLURM_ARRAY_TASK_ID": "9"}, capture_output=True, text=True)
    assert bad.returncode == 1 and "no run for SLURM_ARRAY_TASK_ID=9" in bad.stderr


def test_report_table_seed_means_and_plots(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, 'base = "base.toml"\noutput_dir = "out"\nseeds = [0, 1]\n'
                                 '[axes]\n"algorithm.adv_estimator" = ["grpo", "rloo"]\n')
    sw = sweep.load_sweep(path)
    for i, r in enumerate(sw.runs[:3]):  # the last run never started
        fake_metrics(r.output_dir, 2, reward=0.1 * (i + 1))
    result = cli_run("sweep", "report", path, "--out", tmp_path / "plots")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "val_acc final" in out and "tok/s" in out and "mean ± std over seeds" in out
    row = next(line for line in out.splitlines() if line.startswith("adv_estimator-grpo__seed-1"))
    assert row.split() == ["adv_estimator-grpo__seed-1", "done", "2", "0.2", "0.2", "0.3", "1", "100"]
    assert next(line for line in out.splitlines() if line.startswith("adv_estimator-rloo__seed-1")).split()[1:3] == ["new", "-"]
    assert "adv_estimator-grpo      2" in out  # grpo: two seeds in the mean
    for name in ("reward.png", "val_accuracy.png"):
        assert (tmp_path / "plots" / name).read_bytes().startswith(PNG)


def test_report_without_any_run_is_an_error(tmp_path):
    path = write_sweep(tmp_path, 'base = "base.toml"\noutput_dir = "out"\nseeds = [0]\n')
    assert_user_error(cli_run("sweep", "report", path), "no run has metrics", "spmdrl sweep run")


@pytest.mark.quick
def test_example_sweep_plans():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sw = sweep.load_sweep(os.path.join(repo, "configs", "ablations", "estimators.toml"))
    assert len(sw.runs) == 8 and sw.nproc == 2
    assert {r.cfg.algorithm.adv_estimator for r in sw.runs} == {"grpo", "rloo", "reinforce_plus_plus_baseline", "drgrpo"}


def test_zip_labels_name_the_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    body = """
base = "base.toml"
output_dir = "out"
mode = "zip"
labels = ["small", "big"]
seeds = [0, 1]
[axes]
"actor.lr" = [1e-6, 1e-4]
"""
    sw = sweep.load_sweep(write_sweep(tmp_path, body))
    assert [r.name for r in sw.runs] == ["small__seed-0", "small__seed-1", "big__seed-0", "big__seed-1"]
    assert [r.cfg.actor.lr for r in sw.runs] == [1e-6, 1e-6, 1e-4, 1e-4]
    with pytest.raises(ConfigError, match="labels"):
        sweep.load_sweep(write_sweep(tmp_path, body.replace('["small", "big"]', '["small"]')))


def test_algorithm_family_sweep_plans():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sw = sweep.load_sweep(os.path.join(repo, "configs", "ablations", "algorithms.toml"))
    assert [r.name for r in sw.runs][-1] == "ppo_gae" and sw.runs[-1].cfg.critic.enable
    assert sw.runs[2].cfg.algorithm.filter_groups and sw.runs[7].cfg.actor.policy_loss == "gspo"


@pytest.mark.dist
def test_real_sweep_run_skip_report(tmp_path):
    from spmdrl.data.synthetic import make_arith
    from spmdrl.tiny import build_tiny

    model = build_tiny(str(tmp_path / "model"), seed=0)
    data = make_arith(str(tmp_path / "data"), n_train=64, n_val=16, seed=0)
    base = (BASE.replace('path = "model"', f'path = "{model}"')
            .replace('train_files = ["data/train.parquet"]', f'train_files = ["{data["train"]}"]\nval_files = ["{data["val"]}"]')
            .replace("[rollout]", "[rollout]\nkv_cache_gb = 0.1") + "[logging]\nprogress = false\ntensorboard = false\n")
    # Timing on 2 busy cores (load ~8), one run: 2 ranks + vLLM ~85 s, 1 process + vLLM ~40 s, 1 process + the
    # transformers rollout ~25 s. The sweep machinery is the same for all; vLLM under torchrun is test_grpo_dist's.
    path = write_sweep(tmp_path, 'base = "base.toml"\noutput_dir = "out"\nnproc = 1\noverrides = ["actor.lr=1e-3", "rollout.engine=hf"]\n'
                                 '[axes]\n"algorithm.adv_estimator" = ["grpo", "rloo"]\n', base=base)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}

    def spmdrl(*args, timeout=300):
        return subprocess.run([sys.executable, "-m", "spmdrl", "sweep", *args, path], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout)

    proc = spmdrl("run")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in ("adv_estimator-grpo", "adv_estimator-rloo"):
        assert f"{name}: finished in" in proc.stdout
        rows = [json.loads(line) for line in open(tmp_path / "out" / name / "metrics.jsonl")]
        assert rows[-1]["step"] == 2 and "train/reward_mean" in rows[-1]

    start = time.monotonic()
    proc = spmdrl("run", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("finished (2/2 steps), skipped") == 2 and time.monotonic() - start < 30

    proc = spmdrl("report")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name in ("adv_estimator-grpo", "adv_estimator-rloo"):
        assert next(line for line in lines if line.startswith(name + " ")).split()[1:3] == ["done", "2"]
    for png in ("reward.png", "val_accuracy.png"):
        assert (tmp_path / "out" / "report" / png).read_bytes().startswith(PNG)
