"""wandb (offline mode) and MLflow (a local file store) as logging backends, with the real libraries: the same
metrics and steps as metrics.jsonl, the config as parameters, a resume continuing the same tracker run, a
tracker that breaks mid-run leaving training running, and the one-line errors before launch."""
from __future__ import annotations

import glob
import json
import math
import os
import struct

import pytest

from spmdrl.config import load_config, validate
from spmdrl.errors import ConfigError
from spmdrl.metrics import MetricsLogger, read_jsonl
from spmdrl.trackers import TrackerRun, read_ids

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts")
WANDB_INTERNAL = ("_step", "_timestamp", "_runtime")


def wandb_records(path: str):
    """The records of an offline run's .wandb file (a LevelDB-style log of protobuf Records: a 7-byte W&B header,
    32 KiB blocks, each chunk with a 7-byte header: crc32c, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def wandb_run(output_dir: str) -> dict:
    """Every offline run directory under output_dir/wandb, oldest first: run ids, names, groups, tags, config
    keys, and history rows keyed by spmdrl's `step`."""
    files = sorted(glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "run-*.wandb")))
    out = {"ids": [], "names": [], "groups": [], "tags": [], "config": {}, "history": []}
    for f in files:
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                out["ids"].append(rec.run.run_id)
                out["names"].append(rec.run.display_name)
                out["groups"].append(rec.run.run_group)
                out["tags"].append(list(rec.run.tags))
            elif kind == "config":
                out["config"].update({u.key: json.loads(u.value_json) for u in rec.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                out["history"].append({k: v for k, v in row.items() if k not in WANDB_INTERNAL})
    return out


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=1e-12)


def assert_same_rows(expected: list[dict], got: list[dict], where: str):
    assert [r["step"] for r in got] == [r["step"] for r in expected], where
    for e, g in zip(expected, got):
        assert set(g) == set(e), f"{where} step {e['step']}: {sorted(set(g) ^ set(e))}"
        bad = [k for k in e if not same(float(e[k]), float(g[k]))]
        assert not bad, f"{where} step {e['step']}: {bad}"


def mlflow_rows(client, run_id: str, keys) -> list[dict]:
    """The run's metric histories as jsonl-like rows, one per step (the last value of a step)."""
    by_step: dict[int, dict] = {}
    for k in keys:
        for m in sorted(client.get_metric_history(run_id, k), key=lambda m: m.timestamp):
            by_step.setdefault(m.step, {"step": m.step})[k] = m.value
    return [by_step[s] for s in sorted(by_step)]


# ------------------------------------------------------------------------------ a real 2-rank run, resumed


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Run A: 2 ranks, 2 steps, jsonl + wandb (offline) + mlflow (file store), checkpoint at step 2. Run B: the
    same resumed to step 4, whose hook deletes the MLflow run at step 4 (its later calls raise)."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from launching import run
    from spmdrl.data.synthetic import make_arith
    from spmdrl.tiny import build_tiny

    root = tmp_path_factory.mktemp("trackers")
    out, store = root / "run", root / "mlruns"
    model, data = build_tiny(str(root / "model"), seed=0), make_arith(str(root / "data"), n_train=64, n_val=4, seed=0)
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.val_files": f'["{data["val"]}"]',
        "data.max_prompt_length": 32, "data.max_response_length": 4, "data.train_batch_size": 4, "rollout.n": 2,
        "rollout.engine": "hf", "actor.micro_batch_size": 4, "actor.ppo_mini_batch_size": 4, "trainer.test_freq": 0,
        "trainer.val_before_train": "false", "trainer.device": "cpu", "trainer.dist_timeout_s": 120,
        "trainer.output_dir": str(out), "checkpoint.save_freq": 2, "logging.progress": "false",
        "logging.backends": '["jsonl", "wandb", "mlflow"]', "logging.wandb_mode": "offline",
        "logging.mlflow_tracking_uri": str(store), "logging.project": "spmdrl-test", "logging.group": "g1",
        "logging.tags": '["actor.lr=1e-06"]', "trainer.experiment_name": "tracked",
        "hooks.files": f'["{os.path.join(SCRIPTS, "tracker_break.py")}"]',
    }
    args = ["spmdrl.train", *[f"{k}={v}" for k, v in o.items()]]
    a = run([*args, "trainer.total_steps=2"], nproc=2, module=True, timeout=400)
    rows_a = read_jsonl(str(out / "metrics.jsonl"))
    ids_a = read_ids(str(out))
    b = run([*args, "trainer.total_steps=4"], nproc=2, module=True, timeout=400)
    return dict(out=str(out), store=f"file:{store}", a=a, b=b, rows_a=rows_a, ids_a=ids_a)


def test_wandb_offline_history_is_metrics_jsonl_and_resume_continues_the_run(tracked):
    rows = read_jsonl(os.path.join(tracked["out"], "metrics.jsonl"), last_per_step=True)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    w = wandb_run(tracked["out"])
    run_id = tracked["ids_a"]["wandb"]["id"]
    assert w["ids"] == [run_id, run_id]  # the resume continued the same run (one offline directory per launch)
    assert w["names"] == ["tracked"] * 2 and w["groups"] == ["g1"] * 2 and w["tags"][0] == ["actor.lr=1e-06"]
    assert w["config"]["actor"]["lr"] == 1e-6 and w["config"]["logging"]["project"] == "spmdrl-test"
    # every metric, same name and step; the failure counter of the broken MLflow run appears in neither before it
    assert_same_rows(rows, w["history"], "wandb")


def test_mlflow_file_store_holds_metrics_params_steps_and_the_resume(tracked):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=tracked["store"])
    ids = read_ids(tracked["out"])["mlflow"]
    assert ids["run_id"] == tracked["ids_a"]["mlflow"]["run_id"] and ids["experiment"] == "spmdrl-test/g1"
    client.restore_run(ids["run_id"])  # the hook deleted it at step 4
    run = client.get_run(ids["run_id"])
    assert run.info.run_name == "tracked" and run.data.tags["actor.lr"] == "1e-06"
    assert run.data.params["actor.lr"] == "1e-06" and run.data.params["trainer.total_steps"] == "2"
    assert run.data.params["data.train_files"].startswith('["') and len(run.data.params) > 150
    assert [a.path for a in client.list_artifacts(ids["run_id"])] == ["config.toml"]
    rows = read_jsonl(os.path.join(tracked["out"], "metrics.jsonl"), last_per_step=True)[:3]  # step 4 never got in
    assert_same_rows(rows, mlflow_rows(client, ids["run_id"], {k for r in rows for k in r} - {"step"}), "mlflow")


def test_a_tracker_raising_mid_run_does_not_stop_training(tracked):
    b = tracked["b"]  # exit 0 (launching.run checks it): step 4 trained, checkpointed and logged elsewhere
    assert "mlflow: logging step 4 failed" in b.stdout + b.stderr
    assert "mlflow: 2 logging call(s) failed or were dropped during this run" in b.stdout + b.stderr  # step 4, finish
    assert os.path.isdir(os.path.join(tracked["out"], "checkpoints", "step_00000004"))


# ------------------------------------------------------------------------------ in one process, no launch


def test_failure_counter_reaches_the_other_backends(tmp_path):
    """A backend that raises on every call (metrics.jsonl made a directory's name: its file handle is closed
    under it) is counted, and the count is logged to the rest from the next step on."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    cfg = load_config(None, [f"trainer.output_dir={tmp_path / 'out'}", f"logging.mlflow_tracking_uri={store}"])
    run = TrackerRun(str(tmp_path / "out"), "r", "p", config={"actor": {"lr": 1e-6}})
    logger = MetricsLogger(str(tmp_path / "out"), backends=["jsonl", "mlflow"], console=False, run=run,
                           logging_config=cfg.logging)
    logger.log(1, {"a/x": 1.0})
    logger._sinks["jsonl"].file.close()  # the disk under metrics.jsonl is gone: every write raises
    logger.log(2, {"a/x": 2.0})
    logger.log(3, {"a/x": 3.0})
    logger.close()
    client = MlflowClient(tracking_uri=f"file:{store}")
    run_id = read_ids(str(tmp_path / "out"))["mlflow"]["run_id"]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "a/x")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "logging/jsonl_failures")] == [(3, 1.0)]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_backend_errors_before_launch(monkeypatch):
    def check(*overrides):
        with pytest.raises(ConfigError) as e:
            validate(load_config(None, ["model.path=m", 'data.train_files=["t.parquet"]', *overrides]), 1)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "is not one of tensorboard, jsonl, wandb, mlflow" in check('logging.backends=["wanb"]')
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent")
    msg = check('logging.backends=["wandb"]')
    assert "WANDB_API_KEY" in msg and 'logging.wandb_mode = "offline"' in msg
    validate(load_config(None, ["model.path=m", 'data.train_files=["t.parquet"]', 'logging.backends=["wandb"]', "logging.wandb_mode=offline"]), 1)
    monkeypatch.setenv("WANDB_MODE", "offline")
    validate(load_config(None, ["model.path=m", 'data.train_files=["t.parquet"]', 'logging.backends=["wandb"]']), 1)
    assert load_config(None, ["logging.tensorboard=false"]).logging.backends == ["tensorboard", "jsonl"]
    from spmdrl.trackers import selected_backends

    assert selected_backends(load_config(None, ["logging.tensorboard=false"]).logging) == ["jsonl"]


def test_generations_reach_the_jsonl_file_tensorboard_wandb_and_mlflow(tmp_path):
    """logging.log_generations: the rows go to generations.jsonl, a tensorboard text, a wandb table (offline)
    and an MLflow artifact, each readable back."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    import glob
    import json

    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    store, out = tmp_path / "mlruns", tmp_path / "out"
    cfg = load_config(None, [f"trainer.output_dir={out}", f"logging.mlflow_tracking_uri={store}",
                             "logging.wandb_mode=offline", "logging.tracker_timeout_s=300"])
    run = TrackerRun(str(out), "r", "p", config={"actor": {"lr": 1e-6}})
    rows = [{"step": 3, "split": "val", "prompt": "user: 1+2=", "response": "3", "reward": 1.0,
             "turns": [{"text": "t", "tool_calls": []}]}]
    logger = MetricsLogger(str(out), backends=["tensorboard", "jsonl", "wandb", "mlflow"], console=False, run=run,
                           logging_config=cfg.logging)
    logger.log(3, {"a/x": 1.0})
    logger.log_generations(3, "val", rows)
    logger.close()
    assert [json.loads(line) for line in open(out / "generations.jsonl")] == rows
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    (text,) = events.Tensors("generations/val/text_summary")
    assert text.step == 3 and b'"response": "3"' in text.tensor_proto.string_val[0]
    run_id = read_ids(str(out))["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=f"file:{store}")
    path = client.download_artifacts(run_id, "generations/val/step_00000003.jsonl", str(tmp_path))
    assert [json.loads(line) for line in open(path)] == rows
    (table,) = glob.glob(str(out / "wandb" / "offline-run-*" / "files" / "media" / "table" / "generations" / "val_*.table.json"))
    data = json.load(open(table))
    assert data["columns"][:3] == ["step", "split", "prompt"] and data["data"][0][3] == "3"


_DYING_TRACKERS = r'''
import os, signal, subprocess, sys, time
from multiprocessing import shared_memory

from spmdrl.train import apply_verbosity, setup_logging

apply_verbosity("info")
setup_logging(0)
from spmdrl.config.schema import LoggingConfig
from spmdrl.process.launcher import leave
from spmdrl.trackers import TrackerRun, open_tracker

out = sys.argv[1]
segment = shared_memory.SharedMemory(create=True, size=4096)  # left for the resource tracker, as vLLM's queues are
segment.close()
lg = LoggingConfig(wandb_mode="offline", mlflow_tracking_uri="http://127.0.0.1:9", tracker_timeout_s=3.0)
wandb = open_tracker("wandb", TrackerRun(output_dir=out, name="n", project="p"), lg)
deadline = time.monotonic() + 180
while not wandb._opened and time.monotonic() < deadline:
    time.sleep(0.1)
ps = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
services = [int(line.split()[0]) for line in ps.splitlines() if "wandb" in line]
assert services, ps
for pid in services:
    os.kill(pid, signal.SIGKILL)  # the service dies mid-run
time.sleep(0.5)
wandb.log(1, {"a": 1.0})
mlflow = open_tracker("mlflow", TrackerRun(output_dir=out, name="n", project="p"), lg)  # nothing listens there
mlflow.log(1, {"a": 1.0})
t0 = time.monotonic()
wandb.close(False)
mlflow.close(False)
print(f"closed in {time.monotonic() - t0:.1f}", flush=True)
leave(0)
'''


def test_a_dead_tracker_costs_the_timeout_and_one_line_no_traceback(tmp_path):
    """A killed wandb service ended in wandb's traceback at exit (its atexit hook), an unreachable MLflow printed
    urllib3's retry lines, and every TP-2 CPU run printed the resource tracker's leaked-shared_memory warning."""
    import subprocess
    import sys

    script = tmp_path / "trackers.py"
    script.write_text(_DYING_TRACKERS)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "VLLM_LOGGING_LEVEL", "WANDB_SERVICE")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=240, env={**env, "WANDB_SILENT": "true"}, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "Retrying" not in out and "leaked shared_memory" not in out, out
    closed = float(out.split("closed in ")[1].split()[0])
    assert closed < 3.0 + 2.0, out  # the MLflow thread is still retrying: bounded by tracker_timeout_s
    warnings = [line for line in out.splitlines() if "] wandb: " in line or "] mlflow: " in line]
    assert len([w for w in warnings if "] wandb: " in w]) == 1, out  # its first failure; finishing fails quietly
    assert any("mlflow: still starting the run (is its service reachable?) after logging.tracker_timeout_s = 3 s" in w
               for w in warnings), out
