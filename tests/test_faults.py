"""Faults and bad input in the loop's helpers: reward functions that raise or run too long (raise / zero),
bad-step detection, the fault-injection spec, stage-named failures (collective errors, SIGTERM), and a hung
rank under real torchrun making the other give up after the configured timeout."""
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from spmdrl.errors import RewardError, SpmdrlError
from spmdrl.faults import inject_fault, injected_fault, is_bad_step, named_failures
from spmdrl.metrics import StageTimer
from spmdrl.rewards.custom import GuardedReward, RewardTimeout, call_with_timeout, compute_rewards

HERE = os.path.dirname(os.path.abspath(__file__))


def flaky(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise ValueError("cannot parse")
    if solution_str == "nan":
        return float("nan")
    if solution_str == "slow":
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:  # a broad except in user code must not swallow the timeout
                time.sleep(0.01)
            except Exception:
                pass
    return 1.0


def score(fn, texts):
    n = len(texts)
    return compute_rewards(fn, ["s"] * n, texts, ["gt"] * n, None)[0].tolist()


def test_reward_raise_names_the_sample():
    with pytest.raises(RewardError, match=r"raised on sample 1 \(data_source 's'\): ValueError: cannot parse"):
        score(GuardedReward(flaky, on_error="raise"), ["ok", "boom"])


def test_reward_zero_scores_failures_zero_and_counts_them():
    fn = GuardedReward(flaky, on_error="zero")
    assert score(fn, ["ok", "boom", "nan", "ok"]) == [1.0, 0.0, 0.0, 1.0]
    assert fn.take_counts() == (2, 0)
    assert fn.take_counts() == (0, 0)


def test_reward_timeout_interrupts_even_a_broad_except():
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"sample 1 .*RewardTimeout: took longer than reward\.timeout_s=0\.2s"):
        score(GuardedReward(flaky, on_error="raise", timeout_s=0.2), ["ok", "slow"])
    fn = GuardedReward(flaky, on_error="zero", timeout_s=0.2)
    assert score(fn, ["slow", "ok"]) == [0.0, 1.0]
    assert fn.take_counts() == (1, 1)
    assert time.monotonic() - t0 < 5
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.default_int_handler, None)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_reward_timeout_outside_the_main_thread_abandons_the_call():
    out = {}

    def run():
        try:
            call_with_timeout(lambda **kw: time.sleep(2), 0.2)
        except RewardTimeout as e:
            out["error"] = str(e)

    t = threading.Thread(target=run)
    t0 = time.monotonic()
    t.start()
    t.join()
    assert "background thread" in out["error"] and time.monotonic() - t0 < 1.5


def test_bad_step_detection():
    assert not is_bad_step({"actor/pg_loss": 0.1, "actor/grad_norm": 2.0, "actor/skipped_step": 0.0})
    assert is_bad_step({"actor/grad_norm": math.nan})
    assert is_bad_step({"actor/skipped_step": 0.5})
    assert is_bad_step({"critic/vf_loss": math.inf})
    assert not is_bad_step({"train/reward_std": math.nan})  # not a loss or gradient


def test_fault_spec():
    spec = "kill:rank=1:step=3; nan:step=5-6; hang:rank=0:step=9"
    assert injected_fault(1, 3, spec) == "kill"
    assert injected_fault(0, 3, spec) is None
    assert [injected_fault(0, s, spec) for s in (4, 5, 6, 7)] == [None, "nan", "nan", None]
    assert injected_fault(0, 9, spec) == "hang"
    assert injected_fault(0, 1, "") is None
    with pytest.raises(SpmdrlError, match="unknown fault 'explode'"):
        injected_fault(0, 1, "explode:step=1")


def nan_injection_round(engine, loss_fn, batch) -> dict:
    """One train_step after SPMDRL_FAULT_INJECT's nan (inject_fault, through the engine protocol), then one more:
    their metrics, and whether the parameters stayed bitwise put through the first and moved in the second."""
    def params():
        return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in engine.module.parameters()]

    before = params()
    inject_fault("nan", 0, 1, engine)
    poisoned = engine.train_step([batch, batch], loss_fn)
    kept = all(torch.equal(a, b) for a, b in zip(before, params()))
    clean = engine.train_step([batch], loss_fn)
    moved = any(not torch.equal(a, b) for a, b in zip(before, params()))
    return {"poisoned": poisoned, "kept": kept, "clean": clean, "moved": moved}


def test_nan_injection_skips_one_real_fsdp2_update(tmp_path):
    """A real FSDP2 engine (one rank): the injected NaN reaches its gradients through train_step's loss, its grad
    norm is NaN, the step is skipped (skipped_step 1, weights bitwise unchanged) while the loss metric stays finite;
    the next step is normal (once only). tests/test_megatron_engine.py checks the same on the Megatron engine."""
    from launching import world_of_one
    from spmdrl.config import load_config
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import pack_sequences
    from spmdrl.engines.fsdp import FSDPEngine
    from spmdrl.tiny import build_tiny

    model = build_tiny(str(tmp_path / "m"), num_layers=1)
    tb = pack_sequences([torch.tensor([3, 4, 5])], [torch.tensor([6, 7])], 0)

    def loss_fn(mb, eng):
        loss = -eng.logprobs(mb)[0].mean()
        return loss, {"loss": loss.detach()}

    with world_of_one():
        mesh = RoleMeshes(plan_layout(load_config(None, [f"model.path={model}"]).placement, 1), 0, "cpu")["actor"]
        engine = FSDPEngine(model, mesh, torch.device("cpu"), trainable=True, optim=dict(lr=1e-2))
        got = nan_injection_round(engine, loss_fn, tb)
    assert got["poisoned"]["skipped_step"] == 1 and math.isnan(got["poisoned"]["grad_norm"]), got["poisoned"]
    assert math.isfinite(got["poisoned"]["loss"]) and got["kept"]
    assert got["clean"]["skipped_step"] == 0 and math.isfinite(got["clean"]["grad_norm"]) and got["moved"]


def test_failures_name_step_and_stage():
    timer = StageTimer()
    step = types.SimpleNamespace(n=3)
    with pytest.raises(RewardError, match=r"^step 3, stage 'reward': bad reward$"):
        with named_failures(lambda: step.n, 30):
            with timer("reward"):
                raise RewardError("bad reward")
    with pytest.raises(SpmdrlError, match=r"^step 3, after stage 'reward': a collective failed \(RuntimeError: "
                                          r"\[gloo\] Connection closed by peer\); another rank probably died .*"
                                          r"trainer\.dist_timeout_s=30s"):
        with named_failures(lambda: step.n, 30):
            with timer("reward"):
                pass
            raise RuntimeError("[gloo] Connection closed by peer")
    with pytest.raises(ZeroDivisionError) as info:  # a bug keeps its type and traceback, with a note
        with named_failures(lambda: step.n, 30):
            with timer("advantage"):
                1 / 0
    assert "spmdrl: raised in step 3, stage 'advantage'" in info.value.__notes__


def test_sigterm_becomes_a_stage_named_error():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SpmdrlError, match=r"^step 7, stage 'rollout': stopped by SIGTERM"):
        with named_failures(lambda: 7, 30):
            with StageTimer()("rollout"):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.dist
def test_hung_rank_makes_the_other_give_up_after_the_timeout():
    from launching import run

    t0 = time.monotonic()
    proc = run([os.path.join(HERE, "dist_scripts", "ckpt_hang.py"), "3"], nproc=2, timeout=120, check=False)
    assert proc.returncode != 0
    m = re.search(r"error \(rank 0\) after ([\d.]+)s: step 3, stage 'update_actor': a collective failed .*"
                  r"trainer\.dist_timeout_s=3s", proc.stderr)
    assert m, proc.stderr[-3000:]
    assert 2.5 <= float(m.group(1)) < 15
    assert "[fault injection] rank 1 hangs in step 3" in proc.stderr
    assert time.monotonic() - t0 < 90


# ----- stopping, errors once, safe path, overflow -----

def test_scores_are_checked_after_float32_conversion():
    """1e40 is a finite Python float but inf in the float32 scores: once every step trained nothing."""
    big = lambda **kw: 1e40  # noqa: E731
    with pytest.raises(RewardError, match=r"returned 1e\+40 for sample 0, which overflows float32"):
        score(big, ["x"])
    fn = GuardedReward(big, on_error="zero")
    assert score(fn, ["x", "y"]) == [0.0, 0.0] and fn.take_counts() == (2, 0)
    assert score(lambda **kw: 3.0e38, ["x"]) == [pytest.approx(3.0e38)]  # finite in float32: kept


def test_a_step_without_a_finite_signal_is_bad():
    assert is_bad_step({"actor/grad_norm": 0.0, "train/reward_mean": math.inf})
    assert is_bad_step({"actor/grad_norm": 0.0, "train/advantage_mean": math.nan})
    assert not is_bad_step({"actor/grad_norm": 0.0, "train/reward_mean": 0.5, "train/advantage_mean": 0.0})


def test_in_the_loop_the_first_signal_asks_for_a_save_and_a_second_stops_at_once():
    """graceful_stop (the training loop): the first SIGTERM is a request (the step goes on), its copy from a
    scheduler that signals every process of the job is the same request, a later signal stops at once, and a
    step that outlasts checkpoint.grace_s is stopped without a save."""
    from spmdrl.faults import Terminated, at_step_boundary, graceful_stop, stop_handled, stop_reason, stop_requested

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        with graceful_stop(30.0):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher's forwarded copy
            time.sleep(0.3)
            assert stop_requested() == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGUSR1)  # an early warning after it: still the same request
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal
            time.sleep(5)
    assert stop_reason(signal.SIGTERM) == "stopped at once by a second signal (SIGTERM) without saving"
    stop_handled()
    assert signal.getsignal(signal.SIGTERM) is before
    t0 = time.monotonic()
    with pytest.raises(Terminated):
        with graceful_stop(0.5):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # a step longer than the grace
    assert 0.4 < time.monotonic() - t0 < 3
    assert stop_reason(signal.SIGINT).startswith("stopped by SIGINT (Ctrl-C): the step did not end within "
                                                 "checkpoint.grace_s = 0.5s of the signal, so it was not saved")
    stop_handled()
    with graceful_stop(0.5):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert at_step_boundary() == signal.SIGTERM  # reached in time: the timer leaves the rank to its save
        time.sleep(1.0)
    stop_handled()


def test_a_stop_during_a_save_waits_for_the_agreement_point():
    from spmdrl.faults import DeferredStop

    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with DeferredStop() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the code between collectives runs on
            assert stop.signum == signal.SIGTERM and got == []
            stop.consume()  # the agreement acted on it
        assert got == []
        with DeferredStop():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        time.sleep(0.2)
        assert got == [signal.SIGTERM]  # not acted on: delivered to the previous handler on exit
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.dist
def test_a_rank_error_is_one_line_once_with_exit_2(tmp_path):
    """A user error found on every rank under the launcher (torchrun): printed once, torchrun's summary and
    traceback replaced by the ranks' line (error files), exit 2; before any model is loaded."""
    from launching import run as launch

    proc = launch(["spmdrl.process.launcher", "--standalone", "--nproc-per-node", "2", "-m", "spmdrl.train",
                   "model.path=/nonexistent/model", "data.train_files=[\"x.parquet\"]", f"trainer.output_dir={tmp_path}/run"],
                  nproc=None, module=True, timeout=300, check=False)
    err = [re.sub(r"^error \(rank \d\)", "error (rank R)", ln) for ln in proc.stderr.splitlines()
           if "Warning" not in ln and ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert err == ["error (rank R): model.path = '/nonexistent/model': no such directory; give an HF model directory "
                   "or a hub id"], proc.stderr[-3000:]


@pytest.mark.dist
def test_a_config_typo_is_shown_whichever_rank_fails_first(tmp_path, monkeypatch):
    """`python -m spmdrl.process.launcher ... actor.lrr=1e-4` with 2 ranks, 10 times: when rank 1 failed first, the
    launcher stopped rank 0 before it printed and blamed 'a kill from outside spmdrl' (exit 1), hiding the
    typo. One rank is made to read its config late on most tries (SPMDRL_FAULT_INJECT=slow_start), so the other
    always fails first there; every try shows the typo's line, and only it, with exit 2."""
    from launching import run as launch

    expected = "error (rank R): command-line override: unknown key 'actor.lrr'; did you mean 'actor.lr'?"
    for attempt in range(10):
        late = attempt % 3  # rank 0 late, rank 1 late, or both on time
        if late < 2:
            monkeypatch.setenv("SPMDRL_FAULT_INJECT", f"slow_start:rank={late}")
        else:
            monkeypatch.delenv("SPMDRL_FAULT_INJECT", raising=False)
        proc = launch(["spmdrl.process.launcher", "--standalone", "--nproc-per-node", "2", "-m", "spmdrl.train",
                       "actor.lrr=1e-4", f"trainer.output_dir={tmp_path}/run"],
                      nproc=None, module=True, timeout=300, check=False)
        err = [re.sub(r"^error \(rank \d\)", "error (rank R)", ln) for ln in proc.stderr.splitlines()
               if "Warning" not in ln and ln.strip()]
        assert (proc.returncode, err) == (2, [expected]), (attempt, proc.returncode, proc.stderr[-3000:])


def test_the_launch_directory_cannot_shadow_an_import(tmp_path):
    """`python -m spmdrl.train` from a directory holding tomllib.py: the standard module is used."""
    (tmp_path / "tomllib.py").write_text(f"open({str(tmp_path / 'SHADOWED')!r}, 'w').close()\nraise SystemExit(7)\n")
    (tmp_path / "run.toml").write_text("[trainer]\nnot_a_key = 1\n")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    env.pop("PYTHONSAFEPATH", None)
    proc = subprocess.run([sys.executable, "-m", "spmdrl.train", "--config", "run.toml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert not (tmp_path / "SHADOWED").exists()
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "unknown key 'trainer.not_a_key'" in proc.stderr


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory):
    """The fault scripts' run: an empty config file and the overrides for the tiny model and data (built once)."""
    from spmdrl.data.synthetic import make_arith
    from spmdrl.tiny import build_tiny

    root = tmp_path_factory.mktemp("fault_assets")
    model = build_tiny(str(root / "model"), seed=0)
    data = make_arith(str(root / "data"), n_train=64, n_val=8, seed=0)
    (root / "run.toml").write_text("")
    return str(root / "run.toml"), [
        f"model.path={model}", f'data.train_files=["{data["train"]}"]', "data.max_prompt_length=32",
        "data.max_response_length=8", "data.train_batch_size=4", "rollout.n=4", "rollout.kv_cache_gb=0.1",
        "actor.micro_batch_size=4", "trainer.total_steps=4", "trainer.device=cpu", "trainer.dist_timeout_s=60",
        "logging.progress=false", "logging.tensorboard=false"]


@pytest.mark.dist
def test_fault_script_kill_and_sigterm_of_the_launcher_and_resume(fault_run, tmp_path):
    """launch/fault_check.py on the tiny model (2 ranks): kill -9 of `spmdrl train` and SIGTERM to it during
    a checkpoint save slowed on purpose (rank 0 sleeps 6 s inside the save) leave no process of the job after
    30 s, the SIGTERM lets the save finish and gives one line naming it, no torn checkpoint, and a relaunch
    resumes and finishes. (Its
    kill -9 of a rank is test_checkpoint_dist's killed run; skipped here to save a launch.)"""
    config, ov = fault_run
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE), "OMP_NUM_THREADS": "1",
           "SPMDRL_FAULT_INJECT": "slow_save:rank=0:step=2"}
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "launch", "fault_check.py"),
                           "--config", config, "--nproc", "2", "--out", str(tmp_path / "check"),
                           "--checks", "launcher-kill,launcher-term,resume", *ov], check=False, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == [
        "PASS  kill -9 launcher", "PASS  SIGTERM launcher during a save", "PASS  SIGTERM", "PASS  SIGTERM",
        "PASS  resume"], proc.stdout
    # the SIGTERM landed in a save: the save finished and the run stopped after it, naming it (the kill -9 of the
    # launcher before it had saved its own step already: the ranks finish their step and save when it dies)
    assert re.search(r"SIGTERM: one line: error \(rank \d\): stopped by SIGTERM after step (\d): saved checkpoint "
                     r"\S+step_0000000\1; relaunch the same command to resume from it", proc.stdout), proc.stdout
    print(proc.stdout)  # the measured times, with -s


@pytest.mark.dist
def test_fault_script_config_typo_and_rank_kills(fault_run, tmp_path):
    """launch/fault_check.py on the tiny model (2 ranks): a typo under the launcher is one line with exit 2; kill -9
    of rank 1 during a checkpoint save (slowed on rank 0) and of rank 0 during start-up end the job with the
    killed rank named by the launcher and exit 1; no torn checkpoint."""
    config, ov = fault_run
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE), "OMP_NUM_THREADS": "1",
           "SPMDRL_FAULT_INJECT": "slow_save:rank=0:step=1"}
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "launch", "fault_check.py"),
                           "--config", config, "--nproc", "2", "--out", str(tmp_path / "check"),
                           "--checks", "config-typo,rank-kill-save,rank0-kill-start", *ov], check=False, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [ln.split(":")[0] for ln in proc.stdout.splitlines()] == [
        "PASS  config typo under the launcher", "PASS  kill -9 rank during a save", "PASS  kill -9 rank 0 at start-up"], proc.stdout
