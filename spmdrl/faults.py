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

from spmdrl.errors import SpmdrlError
from spmdrl.metrics import StageTimer

log = logging.getLogger("spmdrl")

FAULT_ENV = "SPMDRL_FAULT_INJECT"


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


class Terminated(BaseException):
    """SIGTERM/SIGINT arrived (torchrun stops the other ranks this way when one fails)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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
def named_failures(step: Callable[[], int], timeout_s: float) -> Iterator[None]:
    """Failures inside name the step and the stage (StageTimer.current) they happened in.

    The stage is StageTimer's view of this process: the one the exception escaped from or is in, else the
    last one finished. A collective failing (a peer died or hung) and a SIGTERM from the launcher become
    one-line SpmdrlErrors; SpmdrlErrors get the step and stage in front; anything else (a bug) keeps its
    traceback, with a note.
    """
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(signum, frame):
            raise Terminated(signum)

        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM,)}
    try:
        yield
    except KeyboardInterrupt:
        raise
    except (Exception, Terminated) as e:
        stage, last = StageTimer.failed or StageTimer.current, StageTimer.last
        place = f"stage {stage!r}" if stage else f"after stage {last!r}" if last else "before the first stage"
        where = f"step {step()}, {place}"
        if isinstance(e, Terminated):
            raise SpmdrlError(
                f"{where}: stopped by {e} (a launcher stops every rank when one fails; the first failing rank's "
                "log has the cause); relaunch to resume from the last complete checkpoint"
            ) from None
        if is_collective_failure(e):
            raise SpmdrlError(
                f"{where}: a collective failed ({type(e).__name__}: {_one_line(e)}); another rank probably died "
                f"or hung (collectives give up after trainer.dist_timeout_s={timeout_s:g}s); relaunch to resume "
                "from the last complete checkpoint"
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

def is_bad_step(metrics: dict[str, float]) -> bool:
    """A step with a skipped optimizer update (non-finite grad norm) or a non-finite loss or grad norm."""
    for key, v in metrics.items():
        name = key.rsplit("/", 1)[-1]
        if name == "skipped_step" and v > 0:
            return True
        if (name == "grad_norm" or name.endswith("loss")) and not math.isfinite(v):
            return True
    return False


# ---- test-only fault injection --------------------------------------------------------------------------

def injected_fault(rank: int, step: int, spec: str | None = None) -> str | None:
    """The fault SPMDRL_FAULT_INJECT asks of `rank` at `step`: "kill" | "hang" | "nan" | None.

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
        if kind not in ("kill", "hang", "nan"):
            raise SpmdrlError(f"{FAULT_ENV}: unknown fault {kind!r} in {item!r}; use kill, hang or nan")
        return kind
    return None


def inject_fault(kind: str | None, rank: int, step: int, engine) -> None:
    """kill: exit at once, like a lost node; hang: block forever; nan: a NaN gradient in `engine`'s next
    optimizer step (the real grad-norm path sees it)."""
    if kind == "kill":
        print(f"[fault injection] rank {rank} exits in step {step}", file=sys.stderr, flush=True)
        os._exit(1)
    if kind == "hang":
        print(f"[fault injection] rank {rank} hangs in step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    if kind == "nan":
        def poisoned_clip_grad_norm():
            del engine.clip_grad_norm  # once: back to the class's method
            for p in engine.module.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
                    break
            return engine.clip_grad_norm()

        engine.clip_grad_norm = poisoned_clip_grad_norm


__all__ = ["FAULT_ENV", "Terminated", "inject_fault", "injected_fault", "is_bad_step", "is_collective_failure",
           "named_failures", "set_collective_timeout"]
