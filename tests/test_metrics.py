"""MetricsLogger writes real tensorboard events and jsonl that read back; StageTimer and peak memory."""
import json
import os
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from spmdrl.errors import DataError
from spmdrl.metrics import MetricsLogger, StageTimer, peak_memory_gb, read_jsonl

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

STEPS = [
    {"train/reward_mean": 0.25, "actor/pg_loss": -0.5, "timing/step_s": 1.5, "perf/tokens_per_s": 1234.0},
    {"train/reward_mean": 0.5, "actor/pg_loss": -0.25, "val/accuracy": 0.75, "timing/step_s": 1.25},
    {"train/reward_mean": torch.tensor(0.75), "actor/pg_loss": 0.125, "timing/step_s": 1.0},
]


def _scalars(tb_dir):
    acc = EventAccumulator(tb_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_and_jsonl_read_back(tmp_path, capsys):
    out = str(tmp_path / "run")
    with MetricsLogger(out) as logger:
        for step, m in enumerate(STEPS, start=1):
            logger.log(step, m)
        # Each jsonl line is flushed as it is logged: readable while the run is still going.
        assert len(read_jsonl(os.path.join(out, "metrics.jsonl"))) == 3

    scalars = _scalars(os.path.join(out, "tensorboard"))
    assert scalars["train/reward_mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert scalars["actor/pg_loss"] == [(1, -0.5), (2, -0.25), (3, 0.125)]
    assert scalars["val/accuracy"] == [(2, 0.75)]
    assert scalars["perf/tokens_per_s"] == [(1, 1234.0)]

    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1] == {"step": 2, **STEPS[1]}
    assert records[2]["train/reward_mean"] == 0.75 and isinstance(records[2]["train/reward_mean"], float)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert all(json.loads(line)["step"] for line in f)  # one JSON object per line

    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1 |")
    assert "reward 0.25" in lines[0] and "pg_loss -0.5" in lines[0] and "tok/s 1234" in lines[0]
    assert "val_acc 0.75" in lines[1] and "val_acc" not in lines[0]


def test_non_zero_rank_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    logger = MetricsLogger(str(out), rank=1)
    logger.log(1, STEPS[0])
    logger.close()
    assert not out.exists()
    assert capsys.readouterr().out == ""


def test_sinks_can_be_switched_off(tmp_path, capsys):
    out = tmp_path / "run"
    with MetricsLogger(str(out), tensorboard=False, console=False) as logger:
        logger.log(1, STEPS[0])
    assert (out / "metrics.jsonl").exists() and not (out / "tensorboard").exists()
    assert capsys.readouterr().out == ""
    with MetricsLogger(str(tmp_path / "tb_only"), jsonl=False, console=False) as logger:
        logger.log(1, STEPS[0])
    assert not (tmp_path / "tb_only" / "metrics.jsonl").exists()
    assert _scalars(str(tmp_path / "tb_only" / "tensorboard"))["timing/step_s"] == [(1, 1.5)]


def test_jsonl_appends_on_resume_and_last_per_step(tmp_path):
    out = str(tmp_path / "run")
    with MetricsLogger(out, tensorboard=False, console=False) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"x": float(step)})
    with MetricsLogger(out, tensorboard=False, console=False) as logger:  # resumed from the step-2 checkpoint
        logger.log(3, {"x": 30.0})
        logger.log(4, {"x": 40.0})
    path = os.path.join(out, "metrics.jsonl")
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 3, 4]
    assert [r["x"] for r in read_jsonl(path, last_per_step=True)] == [1.0, 2.0, 30.0, 40.0]


def test_read_jsonl_truncated_tail_and_corruption(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')  # killed mid-write
    assert read_jsonl(str(path)) == [{"step": 1, "x": 1.0}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(DataError, match="line 2"):
        read_jsonl(str(path))
    with pytest.raises(DataError, match="not found"):
        read_jsonl(str(tmp_path / "missing.jsonl"))


def test_stage_timer():
    timer = StageTimer("cpu")
    with timer("rollout"):
        time.sleep(0.05)
    with timer("update"):
        time.sleep(0.01)
    with timer("update"):  # repeated entries add up
        time.sleep(0.01)
    with pytest.raises(RuntimeError), timer("failing"):
        raise RuntimeError("boom")
    m = timer.as_metrics()
    assert set(m) == {"timing/rollout_s", "timing/update_s", "timing/failing_s"}
    assert 0.05 <= m["timing/rollout_s"] < 1.0
    assert 0.02 <= m["timing/update_s"] < 1.0
    timer.reset()
    assert timer.as_metrics() == {}


def test_peak_memory_cpu():
    gb = peak_memory_gb("cpu")
    assert 0.01 < gb < 1024  # a Python process with torch loaded holds tens of MiB at least
    assert peak_memory_gb(torch.device("cpu")) >= gb


@pytest.mark.parametrize("level", ["info", "debug"])
def test_verbosity_quiets_library_warnings_unless_debug(level):
    """logging.verbosity: info hides vLLM / Triton / megatron-core warnings (and vLLM below ERROR); debug shows
    them; spmdrl's own warnings show either way."""
    import subprocess
    import sys

    code = (
        "import logging, os, sys, warnings\n"
        "from spmdrl.train import apply_verbosity, setup_logging\n"
        "setup_logging(0)\n"
        f"apply_verbosity({level!r})\n"
        "warnings.warn_explicit('megatron says', UserWarning, 'x.py', 1, module='megatron.core.tensor_parallel')\n"
        "warnings.warn_explicit('triton says', FutureWarning, 'y.py', 1, module='triton.runtime')\n"
        "warnings.warn_explicit('spmdrl says', UserWarning, 'z.py', 1, module='spmdrl.loop.trainer')\n"
        "logging.getLogger('vllm.triton_utils').warning('vllm logs')\n"
        "print('VLLM_LOGGING_LEVEL', os.environ.get('VLLM_LOGGING_LEVEL'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "SPMDRL_VERBOSITY", "PYTHONWARNINGS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "spmdrl says" in out
    quiet = level == "info"
    for text in ("megatron says", "triton says", "vllm logs"):
        assert (text in out) != quiet, (text, out)
    assert ("VLLM_LOGGING_LEVEL ERROR" in out) == quiet


def test_console_line_every_n_steps_and_the_tool_metrics_on_it(tmp_path, capsys):
    """An SFT run printed 350 step lines: logger_for gives it about 20 (the last step always); an RL run keeps a
    line per step, with the multi-turn figures on it when it has them."""
    from spmdrl.config import load_config
    from spmdrl.config.schema import SFTConfig
    from spmdrl.metrics import logger_for

    sft = load_config(None, [f"trainer.output_dir={tmp_path / 'sft'}", "logging.progress=false"], root_cls=SFTConfig)
    with logger_for(sft, 0, resume=False, progress_total=350) as logger:
        for step in range(1, 351):
            logger.log(step, {"sft/loss": 1.0})
    steps = [int(line.split()[1]) for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert steps == list(range(17, 351, 17)) + [350]
    rl = load_config(None, [f"trainer.output_dir={tmp_path / 'rl'}", "logging.progress=false"])
    with logger_for(rl, 0, resume=False, progress_total=3) as logger:
        for step in range(1, 4):
            logger.log(step, {"train/reward_mean": 0.5, "multi_turn/turns_mean": 2.0, "tools/calls": 12.0,
                              "tools/failures": 1.0})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert lines == [f"step {s} | reward 0.5 | turns 2 | tool_calls 12 | tool_fail 1" for s in (1, 2, 3)]


def test_console_line_shows_distillation_and_routing_replay_when_in_use(tmp_path, capsys):
    """distill/kl_mean and the routing replay's agreement were in metrics.jsonl only; a run without those features
    keeps its line as it was."""
    with MetricsLogger(str(tmp_path), tensorboard=False, jsonl=False) as logger:
        logger.log(1, {"train/reward_mean": 0.0, "actor/pg_loss": 0.25, "distill/kl_mean": 0.2342,
                       "moe/router_agreement": 0.9375, "moe/route_agreement": 1.0})
        logger.log(2, {"train/reward_mean": 0.5, "actor/pg_loss": 0.25})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert lines == ["step 1 | reward 0 | pg_loss 0.25 | distill_kl 0.2342 | router_agree 0.9375",
                     "step 2 | reward 0.5 | pg_loss 0.25"]
