"""How `spmdrl train` starts ranks, how they stop, and how a rank's error reaches the user once.

    spmdrl train --nproc N  ==exec==>  python -P -m spmdrl.process.launcher <torchrun args> -m spmdrl.train ...
                                           (torchrun's agent, in this process: the PID the user started)
                                           └── N ranks: python -u -m spmdrl.train ... (PYTHONSAFEPATH=1)

- The CLI execs (no extra parent): a signal to the PID the user started reaches torchrun's agent, which
  stops every rank (SIGTERM, SIGKILL after 30 s) and then exits.
- SIGKILL of that PID cannot be caught: each rank watches its parent (`watch_parent`) and stops itself when
  it is gone (SIGTERM to itself, os._exit after a grace period), so no rank outlives the job.
- Safe-path mode (-P, PYTHONSAFEPATH=1, inherited by the ranks): the working directory is never put on
  sys.path, so a file such as ./tomllib.py cannot shadow an import.
- A user error (SpmdrlError) is printed by the first failing rank only (a marker file next to torchrun's
  per-rank error files) and written to torchrun's error file, so torchrun's summary names it as the root
  cause; this wrapper then exits 2 for a user error (printing it when the ranks that found it were all
  stopped before they could), names each rank that died without a word (kill -9, the OOM killer) and exits
  1, and prints no traceback of its own (`summarise_failures`). It takes torchrun's arguments, so
  `python -m spmdrl.process.launcher --nnodes ... -m spmdrl.train ...` replaces `torchrun` on every node.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_FIRST_MARKER = "spmdrl_first_error"


# ---- rank side ---------------------------------------------------------------------------------------------

def drop_cwd_from_path() -> None:
    """`python -m spmdrl.train` without -P puts the working directory first on sys.path; take it off so no
    later import (tomllib, a reward module's dependency) resolves to a file there."""
    if getattr(sys.flags, "safe_path", False):
        return
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != cwd] or sys.path


def watch_parent(grace_s: float = 20.0, poll_s: float = 0.5) -> Callable[[], None] | None:
    """Stop this rank when its launcher (parent process) dies, even by SIGKILL: SIGTERM to itself (the
    loop's handler ends the run with a named error), then os._exit after `grace_s` if the main thread is
    stuck in C code that never returns. Returns `unwatch`, which ends the watching thread (the entry point calls
    it on its way out)."""
    parent = os.getppid()
    if parent <= 1:
        return None
    closing = threading.Event()

    def watch():
        while os.getppid() == parent:
            if closing.wait(poll_s):
                return
        print(f"[spmdrl] launcher (pid {parent}) is gone; stopping rank pid {os.getpid()}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        if not closing.wait(grace_s):
            exit_now(143)

    t = threading.Thread(target=watch, daemon=True, name="spmdrl-parent-watch")
    t.start()

    def unwatch() -> None:
        closing.set()
        t.join(timeout=1.0)

    return unwatch


_OWNS_PROCESS = False  # run_as_process: an entry point's main() is this whole interpreter


def run_as_process(main: Callable[[], object]) -> None:
    """`python -m spmdrl.train` (and sft, evaluate): main() as the whole process, ended by leave(main()). A bug's
    exception goes on to the interpreter's own exit (its traceback), with the heap thawed first (settle_heap)."""
    import gc

    global _OWNS_PROCESS
    _OWNS_PROCESS = True
    try:
        code = main()
    except BaseException:
        gc.unfreeze()
        raise
    leave(code)


def settle_heap() -> None:
    """Called once start-up's imports are done (torch, transformers, vLLM's model registry: half a million
    objects that live as long as the process): gc.freeze() moves them out of the collector's sight, so its full
    collections during the run walk only what the run makes (seconds per process on 2 CPU cores otherwise; vLLM
    freezes its heap after start-up the same way). Only in a process an entry point owns (run_as_process):
    frozen objects are never collected, and leave() skips the teardown that would find them."""
    if _OWNS_PROCESS:
        import gc

        gc.freeze()


_AT_ANY_EXIT: list[Callable[[], None]] = []


def at_any_exit(fn: Callable[[], None]) -> None:
    """fn() runs however this process ends while Python still runs: at a normal exit and in leave() (atexit), and
    on the ways out that skip the atexit handlers (`exit_now`: a stopped rank, a rank blocked in C++ or whose
    launcher is gone). For quick cleanups of what outlives the process otherwise (shared-memory segments)."""
    import atexit

    _AT_ANY_EXIT.append(fn)
    atexit.register(fn)


def exit_now(code: int) -> None:
    """os._exit(code) after the at_any_exit cleanups and a flush of stdout and stderr: no atexit handlers, no
    teardown (a stopped rank has closed its metrics and printed its line; vLLM's shutdown takes seconds)."""
    for fn in list(_AT_ANY_EXIT):
        try:
            fn()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def leave(code) -> None:
    """End this process with exit status `code` (what `sys.exit(code)` takes) once its work is done, skipping
    the interpreter's teardown. With torch, transformers and vLLM imported the teardown's garbage collections
    walk over half a million objects: seconds per process (3 s on 2 CPU cores, more under load) that clean
    up nothing a next process needs. What a normal exit does first is done here too: the threading module's
    exit hooks run (concurrent.futures' tells idle pool workers to stop, such as those of the compile pool
    torch's inductor keeps for the life of the process, which would otherwise be waited for forever), the other
    non-daemon threads are joined, the atexit handlers run (logging, trackers, vLLM's shutdown), stdout and
    stderr are flushed."""
    import atexit

    for hook in reversed(getattr(threading, "_threading_atexits", [])):  # as the interpreter's exit does first
        hook()
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    status = 0 if code is None else code if isinstance(code, int) else 1
    if not isinstance(code, (int, type(None))):
        print(code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _first_to_fail() -> bool:
    """True for the first rank on this node to report an error (torchrun's error files share a directory)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return True
    marker = os.path.join(os.path.dirname(os.path.dirname(path)), _FIRST_MARKER)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


def report_error(message, rank: int, *, show: bool = True) -> None:
    """A user error: the line in torchrun's error file (every rank), and on stderr once: from the first
    failing rank (show=False: not from this rank)."""
    line = " ".join(str(message).split())
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"message": f"error (rank {rank}): {line}", "timestamp": int(time.time())}, f)
        except OSError:
            pass
    if show and _first_to_fail():
        print(f"error (rank {rank}): {line}", file=sys.stderr, flush=True)


def record_bug(e: BaseException) -> None:
    """Not a user error: torchrun's error file gets the traceback (as torch's @record would write it), and as its
    message one line of the exception's type, message and spmdrl's note of the step and stage it was raised in."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    line = " ".join(f"{type(e).__name__}: {e}".split())[:500]
    notes = [n for n in getattr(e, "__notes__", []) if isinstance(n, str) and n.startswith("spmdrl: ")]
    if notes:
        line += f" ({notes[-1][len('spmdrl: '):]})"
    data = {"message": {"message": line, "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(e)), "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        pass


# ---- launcher side ----------------------------------------------------------------------------------------

def launch_command(module: str, config: str, overrides: list[str], nproc: int) -> list[str]:
    """The command that runs `module` on `nproc` local ranks: this wrapper around torchrun when nproc > 1."""
    args = ["-m", module, "--config", config, *overrides]
    if nproc > 1:
        # --standalone: a local rendezvous on a free port, so two runs on one machine do not collide.
        return [sys.executable, "-P", "-m", "spmdrl.process.launcher", "--standalone", "--nproc-per-node", str(nproc), *args]
    return [sys.executable, "-P", *args]


def _printed(failures: dict) -> bool:
    """Whether a rank printed its error (the first-error marker beside the ranks' error files exists)."""
    for f in failures.values():
        if f.error_file and os.path.exists(os.path.join(os.path.dirname(os.path.dirname(f.error_file)),
                                                        _FIRST_MARKER)):
            return True
    return False


_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "broken pipe",
                       "timed out", "processgroup", "distnetworkerror", "distbackenderror")


def _bug(f) -> str | None:
    """The one line of a Python exception a rank recorded (record_bug), unless it is a collective failing
    because another rank died (a consequence, not a cause); else None."""
    if not isinstance(f.message, dict):
        return None
    line = str(f.message.get("message", ""))
    return None if any(m in line.lower() for m in _COLLECTIVE_MARKERS) else line


def summarise_failures(failures: dict) -> int:
    """The launcher's exit code for torchrun's failures {rank: ProcessFailure}, and a final line naming the first
    real cause when the ranks' own lines may not (see the table in docs/reliability.md). In order:

    - a rank that died without a word by SIGKILL or a crash (kill -9, the OOM killer, a segfault): one line
      here, from outside spmdrl, exit 1, whatever the survivors then reported;
    - a rank's Python exception (a bug; record_bug wrote its type, message, step and stage): one line naming
      it, exit 1; a collective that failed because a peer died is a consequence, not named;
    - a user error (SpmdrlError) a rank reported: printed once by that rank (here when no rank could), exit 2;
      a stop every reporting rank reported: 128 + the signal;
    - a rank that died by SIGTERM or SIGINT without a word is the launcher's own stop (torchrun stops the others
      when one fails) whenever another rank failed otherwise; only when none did is it named, as from outside.
    """
    ours = {r: f for r, f in failures.items() if isinstance(f.message, str) and f.message.startswith("error (rank")}
    bugs = {r: line for r, f in failures.items() if (line := _bug(f)) is not None}
    reported = set(ours) | {r for r, f in failures.items() if isinstance(f.message, dict)}
    stops = {-int(signal.SIGTERM), -int(signal.SIGINT)}
    silent = {r: f for r, f in failures.items() if r not in reported and f.exitcode < 0}
    killed = sorted((r, f) for r, f in silent.items() if f.exitcode not in stops)
    for rank, f in killed:
        print(f"error: rank {rank} (pid {f.pid}) was killed by {f.signal_name()} (from outside spmdrl: kill -9, the "
              "OOM killer, a scheduler) and the launcher stopped the other ranks; its output above may have the "
              "cause; relaunch the same command to resume from the last complete checkpoint, if one was saved",
              file=sys.stderr,
              flush=True)
    if killed:  # the root cause, even when a survivor then failed in a collective with a one-line error
        return 1
    if bugs:
        rank = min(bugs, key=lambda r: (failures[r].timestamp, r))
        print(f"error: rank {rank} (pid {failures[rank].pid}) raised {bugs[rank]}; its traceback is above",
              file=sys.stderr, flush=True)
        return 1
    if ours and not _printed(failures):  # every rank that found it was stopped before it could print
        rank, f = min(ours.items(), key=lambda item: (item[1].exitcode != 2, item[0]))
        print(f.message, file=sys.stderr, flush=True)
    if any(f.exitcode == 2 for f in ours.values()):
        return 2
    if ours:
        codes = {f.exitcode for f in ours.values()}
        return codes.pop() if len(codes) == 1 and 128 < next(iter(codes)) < 160 else 1
    if reported:  # only collective failures recorded as bugs: their tracebacks are above
        return 1
    others = {r: f for r, f in failures.items() if r not in silent}
    if others:  # a rank exited non-zero without a report; the ranks stopped by a signal were the launcher's stop
        rank, f = min(others.items())
        print(f"error: rank {rank} (pid {f.pid}) exited with code {f.exitcode}; its output above has the cause",
              file=sys.stderr, flush=True)
        return 1
    rank, f = min(silent.items())
    print(f"error: rank {rank} (pid {f.pid}) was killed by {f.signal_name()} from outside spmdrl (no rank reported an "
          "error and the launcher did not send it: a kill of that process, a scheduler); relaunch the same command to "
          "resume from the last complete checkpoint, if one was saved", file=sys.stderr, flush=True)
    return 1


def _forward_to_ranks(signum, frame) -> None:
    """SIGUSR1 (a scheduler's early warning, slurm/*.sbatch) to every rank, the agent's child processes: torchrun
    does not handle it, and its default action would end the agent alone. A rank that got it from the scheduler
    too takes the copy as the same request (spmdrl.faults)."""
    me = str(os.getpid())
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
            if parent == me:
                os.kill(int(name), signum)
        except (OSError, IndexError, ValueError):
            continue


def main(argv: list[str] | None = None) -> int:
    """torchrun (torch.distributed.run) in this process, with its failure summary reduced to an exit code:
    the ranks have printed the cause (once); a rank that died without one gets one line here."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ["PYTHONSAFEPATH"] = "1"
    # torchrun sets 1 itself when it is unset, with a banner on every launch; the same value, without the banner
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in list(logging.root.manager.loggerDict):  # each sets its own level; the ranks say what happened
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    args = parse_args(argv)
    signal.signal(signal.SIGUSR1, _forward_to_ranks)
    try:
        run(args)
    except ChildFailedError as e:
        return summarise_failures(e.failures)
    except SignalException as e:  # the agent has stopped the ranks; the first one printed where
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    leave(main())
