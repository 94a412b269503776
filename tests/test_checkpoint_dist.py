"""Checkpoint, resume and export with the real Trainer under torchrun (tiny model, in-process vLLM, CPU).

One module-scoped set of runs, shared by the tests (independent ones overlap in time):
  A  2 ranks, 4 steps straight, checkpoints at steps 2 and 4; dumps the final actor's log-probs.
  B  the same config with rank 1 killed at the start of step 3 (SPMDRL_FAULT_INJECT), then relaunched
     unchanged: it resumes from step 2 and must log exactly A's metrics.
  D  the same config with the default checkpoint settings (no save before the end) under the launcher, SIGTERM to
     the launcher at a random point early in step 2, then relaunched unchanged: the stop saves the step in
     progress (or the one before), the relaunch resumes from it and must log exactly A's metrics.
  E  `spmdrl export` of A's final checkpoint (one plain process).
  C  1 rank, model.path = E, resumes from A's step-4 checkpoint (DCP reshards 2 -> 1 ranks), then NaN
     gradients at steps 6-7 with trainer.max_bad_steps = 2: the run aborts, keeping the step-5 checkpoint.
"""
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import types

import pytest
import torch

pytest.importorskip("vllm")

from launching import REPO, free_port  # noqa: E402
from spmdrl.data.synthetic import make_arith  # noqa: E402
from spmdrl.metrics import read_jsonl  # noqa: E402
from spmdrl.tiny import build_tiny  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dist_scripts", "ckpt_run.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_assets")
    return build_tiny(str(root / "model"), seed=0), make_arith(str(root / "data"), n_train=64, n_val=16, seed=0)


def overrides(assets, out, **extra):
    model, data = assets
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.val_files": f'["{data["val"]}"]',
        "data.max_prompt_length": 32, "data.max_response_length": 8, "data.train_batch_size": 4, "rollout.n": 4,
        "rollout.kv_cache_gb": 0.1, "actor.lr": 1e-3, "actor.micro_batch_size": 4, "actor.ppo_mini_batch_size": 2,
        "trainer.total_steps": 4, "trainer.device": "cpu", "trainer.output_dir": str(out), "trainer.dist_timeout_s": 60,
        "logging.progress": "false", "logging.tensorboard": "false", "checkpoint.save_freq": 2,
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "ckpt_reward.py") + ":score",
        "reward.on_error": "zero", "reward.timeout_s": 5,
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


class Launch:
    """A run started in the background (launching.run's command and environment), so independent runs overlap:
    most of a tiny run is start-up waiting, not CPU."""

    def __init__(self, args, nproc, module=False, env=None):
        target = ["-m", *args] if module else args
        if nproc is None:
            self.cmd = [sys.executable, *target]
        else:
            self.cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *target]
        full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                    "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SPMDRL_FAULT_INJECT"):
            if key not in (env or {}):
                full_env.pop(key, None)
        self.t0 = time.monotonic()
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # pipes could fill up
        self.proc = subprocess.Popen(self.cmd, env=full_env, cwd=REPO, text=True, stdout=self.out, stderr=self.err)

    def wait(self, check=True, timeout=600) -> subprocess.CompletedProcess:
        self.proc.wait(timeout=timeout)
        self.seconds = time.monotonic() - self.t0
        out, err = (f.seek(0) or f.read() for f in (self.out, self.err))
        done = subprocess.CompletedProcess(self.cmd, self.proc.returncode, out, err)
        if check:
            assert done.returncode == 0, f"{' '.join(self.cmd)} failed ({done.returncode}):\n{out[-4000:]}\n{err[-8000:]}"
        return done


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    from typer.testing import CliRunner

    from spmdrl.cli import app

    a, b, c, d, e = (tmp_path_factory.mktemp(n) for n in ("A", "B", "C", "D", "exported"))
    train_b = ["spmdrl.train", *overrides(assets, b)]
    # what `spmdrl train --nproc 2` runs, with checkpoint.save_freq at its default
    train_d = ["spmdrl.process.launcher", "--standalone", "--nproc-per-node", "2", "-m", "spmdrl.train",
               *overrides(assets, d, **{"checkpoint.save_freq": 0})]
    run_a = Launch([SCRIPT, "--out", str(a), "--dump", *overrides(assets, a)], nproc=2)
    killed = Launch(train_b, nproc=2, module=True, env={"SPMDRL_FAULT_INJECT": "kill:rank=1:step=3"})
    killed_res = killed.wait(check=False)
    resumed = Launch(train_b, nproc=2, module=True)
    run_a.wait()
    stopped = stop_during_a_step(Launch(train_d, nproc=None, module=True), d / "metrics.jsonl")
    relaunched = Launch(train_d, nproc=None, module=True)
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(a), "--out", str(e)])
    assert result.exit_code == 0, result.output
    run_c = Launch([SCRIPT, "--out", str(c), "--expect", str(a / "actor_logprobs.json"),
                    "--resume-from", str(a / "checkpoints" / "step_00000004"),
                    *overrides(assets, c, **{"model.path": str(e), "checkpoint.resume": "off", "trainer.total_steps": 7,
                                             "checkpoint.save_freq": 1, "trainer.max_bad_steps": 2})],
                   nproc=None, env={"SPMDRL_FAULT_INJECT": "nan:step=6-7"})
    return types.SimpleNamespace(a=a, b=b, c=c, d=d, exported=e, killed=killed_res, killed_s=killed.seconds,
                                 resumed=resumed.wait(), run_c=run_c.wait(check=False), stopped=stopped,
                                 relaunched=relaunched.wait())


def stop_during_a_step(job: Launch, metrics: str) -> types.SimpleNamespace:
    """SIGTERM to the launcher at a random moment within 0.2 s after step 1 is logged (a step takes 0.3 s or more
    here, so the signal lands in step 2, rarely 3); returns the finished run, the step in progress at the signal
    (the next one to be logged) and the seconds from the signal to the exit."""
    deadline = time.monotonic() + 300
    while job.proc.poll() is None and time.monotonic() < deadline:
        if os.path.exists(metrics) and any(json.loads(ln)["step"] == 1 for ln in open(metrics) if ln.strip()):
            break
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 0.2))
    in_progress = max(json.loads(ln)["step"] for ln in open(metrics) if ln.strip()) + 1
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    done = job.wait(check=False)
    return types.SimpleNamespace(proc=done, in_progress=in_progress, exit_s=time.monotonic() - t0)


def comparable(rows):
    measured = ("timing/", "perf/", "memory/", "weight_sync/transport_s")  # wall times and memory readings
    return [{k: v for k, v in r.items() if not k.startswith(measured)} for r in rows]


def test_checkpoints_are_complete_sharded_and_kept(runs):
    run_a = runs.a
    root = run_a / "checkpoints"
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004"]
    for name in os.listdir(root):
        d = root / name
        m = json.load(open(d / "manifest.json"))
        assert (d / "COMPLETE").exists() and m["world_size"] == 2
        assert {"state/actor/__0_0.distcp", "state/actor/__1_0.distcp", "rng/rank_0.json", "rng/rank_1.json", "trainer.json",
                "config.toml", "hf/config.json"} <= set(m["files"])
        assert not any(f.endswith((".pt", ".pkl", ".bin")) for f in m["files"])  # no pickles besides DCP's metadata
    rows = read_jsonl(str(run_a / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert sum(r["reward/errors"] for r in rows[1:]) > 0  # the flaky reward raised and was scored 0
    assert all(r["train/bad_steps"] == 0 for r in rows[1:])


def test_killed_rank_stops_the_others_naming_the_stage(runs):
    killed, killed_s = runs.killed, runs.killed_s
    assert killed.returncode != 0
    assert "[fault injection] rank 1 exits in step 3" in killed.stderr
    assert re.search(r"error \(rank 0\): step 3, (stage|after stage) '\w+': (a collective failed|stopped by SIGTERM)",
                     killed.stderr), killed.stderr[-3000:]
    assert killed_s < 240


def test_resume_after_a_kill_logs_exactly_the_uninterrupted_metrics(runs):
    run_a, out, resumed = runs.a, runs.b, runs.resumed
    assert "resumed from" in resumed.stdout and "step_00000002 at step 2" in resumed.stdout
    straight = read_jsonl(str(run_a / "metrics.jsonl"), last_per_step=True)
    raw = read_jsonl(str(out / "metrics.jsonl"))
    assert [r["step"] for r in raw] == [0, 1, 2, 3, 4]  # appended; no second validation at step 0
    assert comparable(raw) == comparable(straight)  # bitwise, every non-timing metric of every step
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000002", "step_00000004"]


def test_sigterm_saves_the_step_and_the_same_command_resumes_bitwise(runs):
    """With the default settings a SIGTERM lost every step since the start (or the last 30-minute save): the run
    stopped at once. It now ends the step in progress, saves it and says so in one line; the same command resumes
    from it and logs exactly the uninterrupted run's metrics."""
    stopped, relaunched = runs.stopped, runs.relaunched
    err = [ln for ln in stopped.proc.stderr.splitlines() if ln.startswith("error")]
    m = re.fullmatch(r"error \(rank \d\): stopped by SIGTERM after step (\d): saved checkpoint (\S+); relaunch the "
                     r"same command to resume from it", err[0] if len(err) == 1 else "")
    assert stopped.proc.returncode == 143 and m, stopped.proc.stderr[-3000:]
    saved = int(m.group(1))
    assert saved in (stopped.in_progress - 1, stopped.in_progress), (saved, stopped.in_progress)
    assert m.group(2) == str(runs.d / "checkpoints" / f"step_{saved:08d}")
    assert stopped.exit_s < 30, stopped.exit_s  # within torchrun's SIGTERM -> SIGKILL window
    print(f"SIGTERM -> exit {stopped.exit_s:.2f}s, saved step {saved} (step {stopped.in_progress} in progress)")
    assert f"resumed from {m.group(2)} at step {saved}" in relaunched.stdout
    straight = read_jsonl(str(runs.a / "metrics.jsonl"), last_per_step=True)
    resumed = read_jsonl(str(runs.d / "metrics.jsonl"), last_per_step=True)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert comparable(resumed) == comparable(straight)


def test_export_gives_the_trainers_logprobs_in_transformers(runs):
    run_a, exported = runs.a, runs.exported
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = set(os.listdir(exported))
    assert {"model.safetensors.index.json", "config.json", "tokenizer.json"} <= files  # streamed, sharded
    assert any(f.startswith("model-00001-of-") and f.endswith(".safetensors") for f in files)
    assert json.load(open(exported / "config.json"))["use_cache"] is True
    want = json.load(open(run_a / "actor_logprobs.json"))
    model = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    AutoTokenizer.from_pretrained(str(exported))
    worst = 0.0
    for p, r, lp in zip(want["prompts"], want["responses"], want["logprobs"]):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + r])).logits[0].float(), -1)
        got = [float(logp[len(p) - 1 + j, t]) for j, t in enumerate(r)]
        worst = max(worst, max(abs(a - b) for a, b in zip(got, lp)))
    assert worst < TOL, worst


def test_export_loads_in_vllm_and_resume_reshards_two_ranks_to_one(runs):
    out = runs.c
    res = json.load(open(out / "expect_rank0.json"))
    # vLLM and the FSDP actor built from the exported directory give the trainer's log-probs...
    assert res["export_vllm"] < TOL and res["export_actor"] < TOL, res
    # ...and so do they after loading the 2-rank checkpoint on 1 rank (DCP reshards; weights synced to vLLM)
    assert res["resumed_vllm"] < TOL and res["resumed_actor"] < TOL and res["step"] == 4, res


def test_nan_steps_are_skipped_counted_then_abort_keeping_the_last_good_checkpoint(runs):
    out, proc = runs.c, runs.run_c
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(r"2 consecutive steps \(up to step 7\) trained nothing \(a non-finite loss or grad norm, .*"
                     r"\(trainer\.max_bad_steps = 2\); the last good checkpoint is \S+step_00000005", proc.stderr)
    rows = {r["step"]: r for r in read_jsonl(str(out / "metrics.jsonl"))}
    assert sorted(rows) == [5, 6, 7]
    assert rows[5]["actor/skipped_step"] == 0 and math.isfinite(rows[5]["actor/grad_norm"])
    assert rows[6]["actor/skipped_step"] > 0 and math.isnan(rows[6]["actor/grad_norm"])
    assert [rows[s]["train/bad_steps"] for s in (5, 6, 7)] == [0, 1, 2]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000005"]
