"""Failures in the loop: a bounded wait on dead or hung ranks, errors that name the step and stage, bad-step
accounting, and the test-only fault injection (env SPMDRL_FAULT_INJECT).

A rank that dies makes every collective of the others fail: at once when its sockets close (gloo), else after
trainer.dist_timeout_s, which `set_collective_timeout` applies to every process group this rank is in (the
role meshes' and vLLM's subgroups are created with torch's 30-minute default otherwise). Under torchrun the
agent also stops the surviving ranks with SIGTERM as soon as one fails; `named_failures` turns either into a
one-line error naming the step and stage the rank was in.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

import torch.distributed as dist

from spmdrl.errors import SpmdrlError, Stopped
from spmdrl.metrics import StageTimer

log = logging.getLogger("spmdrl")

FAULT_ENV = "SPMDRL_FAULT_INJECT"
FAULT_KINDS = ("kill", "hang", "nan", "slow_save", "slow_start")
SLOW_SAVE_S = 6.0
SLOW_START_S = 20.0


def set_collective_timeout(seconds: float) -> int:
    """Apply `seconds` to every process group this rank belongs to; returns how many."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    n = 0
    for pg in list(_world.pg_map):
        try:
            _set_pg_timeout(datetime.timedelta(seconds=seconds), pg)
            n += 1
        except (ValueError, AssertionError, RuntimeError):  # a group without gloo/nccl (e.g. fake backends)
            pass
    return n


_stop = {"signum": 0, "handled": False, "repeating": False, "gen": 0}  # this process's stop request (one per process)


class Terminated(BaseException):
    """A stop signal that stops at once: SIGTERM/SIGINT/SIGUSR1 outside the training loop, or inside it a second
    signal or a step that outlasted checkpoint.grace_s (torchrun stops the other ranks with SIGTERM when one
    fails, and forwards Ctrl-C or a kill of the launcher to the ranks)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        _stop["signum"] = _stop["signum"] or signum


# SIGUSR1: a scheduler's early warning (Slurm's `--signal=USR1@N`, slurm/*.sbatch); its default action would end
# the process without a word
EARLY_SIGNAL = signal.SIGUSR1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, EARLY_SIGNAL)
REPEAT_S = 2.0


def _raise_terminated(signum, frame):
    if not _stop["repeating"]:
        _stop["repeating"] = True
        threading.Thread(target=_repeat_until_handled, args=(_stop["gen"],), daemon=True, name="spmdrl-stop").start()
    raise Terminated(signum)


def _repeat_until_handled(gen: int) -> None:
    """An exception raised where Python ignores it (a __del__, a callback) would lose the stop: deliver the
    signal again every REPEAT_S seconds until the loop or the entry point has taken it (`stop_handled`)."""
    while True:
        time.sleep(REPEAT_S)
        if _stop["handled"] or _stop["gen"] != gen:
            return
        os.kill(os.getpid(), _stop["signum"])


def stop_handled() -> None:
    """The stop became an error on its way out: no more repeats."""
    _stop["handled"] = True


def stop_requested() -> int:
    """The signal that asked this process to stop (through the loop's handlers), else 0."""
    return _stop["signum"]


def _install(handler) -> dict:
    """handler for STOP_SIGNALS (main thread only: Python delivers signals there); returns the previous ones."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS}


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Within: SIGTERM, SIGINT and SIGUSR1 raise Terminated (one line at the entry point, no KeyboardInterrupt
    traceback)."""
    handlers = _install(_raise_terminated)
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def ignore_stop_signals() -> None:
    """A rank on its way out after a stop: a further signal (torchrun stopping the ranks once the first has left)
    must not raise in the middle of its one line (stop_signals restores the handlers it found on exit)."""
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


# ---- a stop that saves first (the training loop) ------------------------------------------------------------

SAME_REQUEST_S = 1.0  # a scheduler signals every process of a job and torchrun forwards it: one request, twice
_graceful = {"active": False, "grace_s": 0.0, "at": 0.0, "boundary": False, "hard": False, "late": False}


def _stops_at_once(signum: int) -> bool:
    """Whether stop signal `signum` ends the run at once; otherwise it is recorded as a request to save at the next
    step boundary (the first SIGTERM, SIGINT or SIGUSR1 inside `graceful_stop`). Stops at once: any signal outside
    it, a second signal (not a copy of the first within SAME_REQUEST_S; SIGUSR1 only warns, so a repeat of it is
    never a second one), and every signal once a step has outlasted checkpoint.grace_s."""
    g = _graceful
    if not g["active"] or g["hard"]:
        return True
    if _stop["signum"]:
        again = signum != EARLY_SIGNAL and time.monotonic() - g["at"] >= SAME_REQUEST_S
        g["hard"] = again
        return again
    _stop["signum"], g["at"] = signum, time.monotonic()
    threading.Thread(target=_grace_timer, args=(signum,), daemon=True, name="spmdrl-grace").start()
    return False


def _grace_timer(signum: int) -> None:
    """Say what the request does (rank 0), then, for SIGTERM and SIGINT (the launcher SIGKILLs 30 s after them), stop
    at once if the rank has not reached the step boundary within checkpoint.grace_s. A save in progress is let
    finish (a periodic one: the stop follows it). SIGUSR1 has no budget of its own: the scheduler's SIGTERM at the
    end of the time it announced is the second signal."""
    g, name = _graceful, signal.Signals(signum).name
    budget = signum != EARLY_SIGNAL
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        within = f" if it ends within checkpoint.grace_s = {g['grace_s']:g}s" if budget else ""
        print(f"[spmdrl] {name}: finishing this step and saving a checkpoint{within}; a second signal stops at once",
              file=sys.stderr, flush=True)
    if not budget:
        return
    deadline = g["at"] + g["grace_s"]
    while not g["boundary"] and (time.monotonic() < deadline or _deferred["depth"]):
        time.sleep(0.05)
    if not g["boundary"] and not g["hard"]:
        g["hard"] = g["late"] = True
        os.kill(os.getpid(), signum)


def _request_stop(signum, frame):
    if _stops_at_once(signum):
        _raise_terminated(signum, frame)


@contextlib.contextmanager
def graceful_stop(grace_s: float) -> Iterator[None]:
    """Within (the training loop): the first SIGTERM, SIGINT or SIGUSR1 asks for a checkpoint at the next step
    boundary (`at_step_boundary`) instead of raising; see `_stops_at_once` for what stops at once. grace_s <= 0:
    every signal stops at once (as `stop_signals`)."""
    if grace_s <= 0:
        yield
        return
    if _stop["handled"]:  # a stop this process already acted on (a process that goes on: a test)
        _stop.update(signum=0, handled=False, repeating=False, gen=_stop["gen"] + 1)
    _graceful.update(active=True, grace_s=float(grace_s), boundary=False, hard=False, late=False)
    handlers = _install(_request_stop)
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        _graceful["active"] = False


def at_step_boundary() -> int:
    """This rank's stop request, called at the step boundary before the ranks agree on it: from here the grace
    timer leaves the rank alone (it saves, or the agreement fails because a peer left)."""
    if _stop["signum"] and not _graceful["hard"]:
        _graceful["boundary"] = True
    return _stop["signum"]


def stop_reason(signum: int) -> str:
    """Why a stop signal stopped the run at once, for its one line."""
    name = signal.Signals(signum).name
    who = {signal.SIGINT: "Ctrl-C", EARLY_SIGNAL: "the scheduler's early warning"}.get(
        signum, "a kill of the launcher, a scheduler, or the launcher stopping every rank after one failed: the "
                "launcher's summary names that rank")
    if _graceful["late"]:
        return (f"stopped by {name} ({who}): the step did not end within checkpoint.grace_s = "
                f"{_graceful['grace_s']:g}s of the signal, so it was not saved")
    if _graceful["hard"]:
        return f"stopped at once by a second signal ({name}) without saving"
    return f"stopped by {name} ({who})"


STOP_GRACE_S = 5.0
_deferred = {"depth": 0}  # DeferredStop blocks active in this process (a save: it agrees on the stop itself)


def watch_stop_signals(on_stuck: Callable[[int], None], grace_s: float = STOP_GRACE_S) -> Callable[[], None] | None:
    """Leave when a stop signal cannot be acted on: the signal handlers (installed by stop_signals and
    named_failures) run only when the main thread returns to Python, and a rank blocked in C++ (a process-group
    rendezvous or a store wait for a peer that died) would otherwise sit there until the launcher's SIGKILL. The
    C-level handler writes each signal to a wakeup socket (signal.set_wakeup_fd) that a thread watches; a stop
    signal not followed by the process's exit within `grace_s` calls on_stuck(signum) (one line, unless the
    loop already printed its own) and os._exit(128 + signum). Inside a checkpoint save (DeferredStop) the save
    agrees on the stop itself, and a stop request of the training loop (graceful_stop) has its own timer: both are
    left alone. Main thread only; returns `unwatch`, which ends the thread and
    hands the wakeup fd back (the entry point calls it on its way out, so a process that goes on after it, a test
    calling the entry point, keeps no watcher that would end it at its next signal)."""
    import socket

    if threading.current_thread() is not threading.main_thread():
        return None
    r, w = socket.socketpair()
    w.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):
        r.close()
        w.close()
        return None
    closing = threading.Event()

    def watch():
        deadline, pending, first = None, 0, 0.0
        while not closing.is_set():
            r.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.01))
            try:
                data = r.recv(64)
            except socket.timeout:
                data = b""
            if closing.is_set():
                break
            for b in data:
                if b in STOP_SIGNALS and deadline is None:
                    deadline, pending, first = time.monotonic() + grace_s, b, time.monotonic()
                elif b in STOP_SIGNALS and b != EARLY_SIGNAL and time.monotonic() - first >= SAME_REQUEST_S:
                    _graceful["hard"] = True  # a second signal, seen here even while the main thread is blocked
            if deadline is not None and time.monotonic() >= deadline:
                if _deferred["depth"] or _saving_first():  # a save, or a step ending before one: wait for it
                    deadline = time.monotonic() + grace_s  # (bounded by checkpoint.grace_s and the launcher's SIGKILL)
                    continue
                if not _stop["handled"]:
                    on_stuck(pending)
                from spmdrl.process.launcher import exit_now

                exit_now(128 + pending)
        r.close()  # the thread holds both sockets (the C handler writes to w's fd while it runs)
        w.close()

    t = threading.Thread(target=watch, daemon=True, name="spmdrl-stop-watch")
    t.start()

    def unwatch() -> None:
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(previous)
        closing.set()
        try:
            w.send(b"\0")  # wake the thread (0 is no signal number)
        except OSError:
            pass
        t.join(timeout=1.0)

    return unwatch


def _saving_first() -> bool:
    """A stop request of graceful_stop in progress (the step ends, then the checkpoint), not yet a stop at once."""
    return _graceful["active"] and bool(_stop["signum"]) and not _graceful["hard"]


class DeferredStop:
    """Within `with DeferredStop() as stop:` SIGTERM/SIGINT are recorded (`stop.signum`), not raised: code
    between collectives (a checkpoint save) finishes its part, and every rank learns of the stop at the
    next agreement all-reduce, so all leave at the same collective. Inside the training loop (graceful_stop) the
    first signal is not a reason to abandon the save: it is recorded as the loop's request (acted on at the step
    boundary right after), and only a signal that stops at once is. A signal nobody acted on (`consume`) is
    delivered again to the previous handler on exit."""

    def __init__(self):
        self.signum = 0
        self._handlers: dict = {}

    def __enter__(self) -> "DeferredStop":
        def record(signum, frame):
            if _stops_at_once(signum):
                self.signum = self.signum or signum

        self._handlers = _install(record)
        _deferred["depth"] += 1
        return self

    def consume(self) -> None:
        self.signum = 0

    def __exit__(self, *exc) -> None:
        _deferred["depth"] -= 1
        for s, h in self._handlers.items():
            signal.signal(s, h)
        if self.signum and self._handlers:
            os.kill(os.getpid(), self.signum)


_COMM_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "timed out waiting",
                 "broken pipe", "processgroup")


def is_collective_failure(e: BaseException) -> bool:
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(m in text for m in _COMM_MARKERS)


def _one_line(e: BaseException, limit: int = 300) -> str:
    return " ".join(str(e).split())[:limit]


@contextlib.contextmanager
def named_failures(step: Callable[[], int], timeout_s: float,
                   advice: Callable[[], str] | None = None) -> Iterator[None]:
    """Failures inside name the step and the stage (StageTimer.current) they happened in.

    advice() says what a relaunch does (spmdrl.checkpoint.resume_advice: the checkpoint it resumes from, or that
    none was saved); without it the messages say "resume from the last complete checkpoint".

    The stage is StageTimer's view of this process: the one the exception escaped from or is in, else the
    last one finished. A collective failing (a peer died or hung) and a SIGTERM from the launcher become
    one-line SpmdrlErrors; SpmdrlErrors get the step and stage in front; anything else (a bug) keeps its
    traceback, with a note.
    """
    handlers = _install(_raise_terminated)
    _graceful.update(hard=False, late=False)  # how an earlier stop in this process went (a test) is not this one's
    try:
        yield
    except Stopped:  # a stop at a step boundary: its line names the step and the checkpoint already
        stop_handled()
        raise
    except (Exception, Terminated) as e:
        if isinstance(e, Terminated):
            stop_handled()
        stage, last = StageTimer.failed or StageTimer.current, StageTimer.last
        place = f"stage {stage!r}" if stage else f"after stage {last!r}" if last else "before the first stage"
        where = f"step {step()}, {place}"
        then = advice() if advice else "relaunch the same command to resume from the last complete checkpoint"
        if isinstance(e, Terminated):
            raise Stopped(f"{where}: {stop_reason(e.signum)}; {then}", e.signum) from None
        if is_collective_failure(e):
            raise SpmdrlError(
                f"{where}: a collective failed ({type(e).__name__}: {_one_line(e)}); another rank probably died "
                f"or hung (collectives give up after trainer.dist_timeout_s={timeout_s:g}s); {then}"
            ) from None
        if isinstance(e, SpmdrlError):
            try:
                wrapped = type(e)(f"{where}: {e}")
            except Exception:
                raise e
            raise wrapped from e
        e.add_note(f"spmdrl: raised in {where}")
        raise
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


# ---- bad steps ----------------------------------------------------------------------------------------

_SIGNAL_METRICS = ("train/reward_mean", "train/advantage_mean")


def is_bad_step(metrics: dict[str, float]) -> bool:
    """A step with a skipped optimizer update (non-finite grad norm), a non-finite loss or grad norm, no
    finite learning signal (non-finite reward or advantage mean), or no token left to train on (rollout
    correction's rejection dropped them all)."""
    for key, v in metrics.items():
        name = key.rsplit("/", 1)[-1]
        if name == "skipped_step" and v > 0:
            return True
        if name == "rollout_rs_masked_fraction" and v >= 1.0:  # rollout correction rejected every token
            return True
        if (name == "grad_norm" or name.endswith("loss") or key in _SIGNAL_METRICS) and not math.isfinite(v):
            return True
    return False


# ---- test-only fault injection --------------------------------------------------------------------------

def injected_fault(rank: int, step: int, spec: str | None = None) -> str | None:
    """The fault SPMDRL_FAULT_INJECT asks of `rank` at `step`: "kill" | "hang" | "nan" | "slow_save" | None.

    Items `kind:rank=R:step=S` or `step=S-E`, separated by ';'; no rank means every rank. For tests only.
    """
    spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, *fields = item.split(":")
        kv = dict(f.split("=", 1) for f in fields if "=" in f)
        lo, _, hi = kv.get("step", "").partition("-")
        if "rank" in kv and int(kv["rank"]) != rank:
            continue
        if lo and not int(lo) <= step <= int(hi or lo):
            continue
        if kind not in FAULT_KINDS:
            raise SpmdrlError(f"{FAULT_ENV}: unknown fault {kind!r} in {item!r}; use {', '.join(FAULT_KINDS)}")
        return kind
    return None


def inject_fault(kind: str | None, rank: int, step: int, engine) -> None:
    """kill: exit at once, like a lost node; hang: block forever; nan: NaN gradients in `engine`'s next
    optimizer step (poison_next_update; the backend's real grad-norm path sees them). slow_save acts inside
    CheckpointManager.save (`slow_save_if_injected`)."""
    if kind == "kill":
        print(f"[fault injection] rank {rank} exits in step {step}", file=sys.stderr, flush=True)
        os._exit(1)
    if kind == "hang":
        print(f"[fault injection] rank {rank} hangs in step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    if kind == "nan":
        poison_next_update(engine)


def poison_next_update(engine) -> None:
    """The next `train_step` of `engine` (any TrainEngine, spmdrl/engines/base.py) computes NaN gradients: its
    first micro-batch's loss, as the caller's loss_fn returns it, is multiplied by NaN, so every gradient that loss
    reaches is NaN. The step then goes down the backend's own path as a real NaN would (FSDP2 and Megatron's grad
    norm, megatron's distributed optimizer on a GPU) and is skipped and counted as a bad step; the loss metrics,
    which loss_fn computes apart, stay finite. Once: later steps are untouched."""
    train_step = engine.train_step

    def poisoned_train_step(micro_batches, loss_fn):
        del engine.train_step  # once: back to the class's method
        first = [True]

        def nan_loss(micro, eng):
            loss, metrics = loss_fn(micro, eng)
            if first[0]:
                first[0] = False
                loss = loss * float("nan")
            return loss, metrics

        return train_step(micro_batches, nan_loss)

    engine.train_step = poisoned_train_step


def inject_fault_if_asked(rank: int, step: int, engine) -> None:
    """Test-only: the fault SPMDRL_FAULT_INJECT asks of this rank at this step, if any (the trainer calls this
    at the start of every step)."""
    if FAULT_ENV in os.environ:
        inject_fault(injected_fault(rank, step), rank, step, engine)


def slow_save_if_injected(rank: int, step: int) -> None:
    """Test-only: a checkpoint write slowed down on purpose (a signal during it must not deadlock the save)."""
    if FAULT_ENV in os.environ and injected_fault(rank, step) == "slow_save":
        print(f"[fault injection] rank {rank} slows the save of step {step}", file=sys.stderr, flush=True)
        end = time.monotonic() + SLOW_SAVE_S
        while time.monotonic() < end:
            time.sleep(0.1)


def slow_start_if_injected(rank: int) -> None:
    """Test-only: this rank reads its config SLOW_START_S late (another rank then fails first)."""
    if FAULT_ENV in os.environ and injected_fault(rank, 0) == "slow_start":
        end = time.monotonic() + SLOW_START_S
        while time.monotonic() < end:
            time.sleep(0.1)


__all__ = [
    "FAULT_ENV", "DeferredStop", "STOP_SIGNALS", "Stopped", "Terminated", "inject_fault", "inject_fault_if_asked",
    "injected_fault", "is_bad_step", "is_collective_failure", "named_failures", "poison_next_update",
    "set_collective_timeout", "slow_save_if_injected", "slow_start_if_injected", "stop_handled", "stop_requested",
    "stop_signals", "watch_stop_signals", "EARLY_SIGNAL", "at_step_boundary", "graceful_stop", "ignore_stop_signals",
    "stop_reason",
]
