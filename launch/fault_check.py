#!/usr/bin/env python
"""Check how a run of YOUR config behaves under faults, on your machine or cluster node (Linux):

    python launch/fault_check.py --config my.toml --nproc 8 --out /scratch/faultcheck [section.key=value ...]

Launches of `spmdrl train` into a fresh --out directory (trainer.output_dir=<out>/run,
checkpoint.resume=auto, checkpoint.save_freq=1 are appended to your overrides), each checked:

  0. a misspelt key under `python -m spmdrl.process.launcher` (what replaces torchrun): one line, exit 2.
  1. kill -9 of the launcher once the first checkpoint exists: no process of the job may be alive 30 s later.
  2. SIGTERM to the launcher while a checkpoint save is in progress (a .tmp-step_* directory exists; if no
     save is seen within --wait-save-s, after the next step): the whole job ends within 30 s, stderr has
     exactly one `error` line (the step saved, or why none was) and no traceback, and no half-written
     checkpoint is left as complete.
  3. Ctrl-C (SIGINT to the launcher) after a new step: the job ends within 30 s with exactly one `error`
     line, no traceback and no KeyboardInterrupt.
  4. kill -9 of one rank after a new step: the job ends (within --rank-kill-s), the launcher names the rank,
     exit 1 (not the user-error 2).
  4b. the same during a checkpoint save (rank-kill-save), and no torn checkpoint is complete.
  4c. kill -9 of rank 0 while the job starts (rank0-kill-start): every process gone within 20 s.
  5. a plain relaunch: it resumes from the last complete checkpoint and finishes trainer.total_steps
     (leave room for the interruptions: 6 or more); metrics.jsonl then holds every step once (last value
     per step).

--checks picks a subset (resume needs an earlier one). Prints one line per check and exits 1 if any failed. Logs of each launch are in <out>/<n>.{out,err}.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

TERM_LIMIT_S = 30.0
START_KILL_LIMIT_S = 20.0  # a rank blocked in C++ leaves 5 s after torchrun's SIGTERM (spmdrl.faults.STOP_GRACE_S)
CHECKS = ("config-typo", "launcher-kill", "launcher-term", "launcher-int", "rank-kill", "rank-kill-save",
          "rank0-kill-start", "resume")


def children_of() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(name))
    return out


def descendants(pid: int) -> set[int]:
    tree, found, todo = children_of(), set(), [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Job:
    """One `spmdrl train` launch; remembers every process of the job (they outlive a SIGKILLed launcher)."""

    def __init__(self, n: int, args, overrides: list[str], env: dict | None = None, cmd: list[str] | None = None):
        self.log = os.path.join(args.out, str(n))
        cmd = cmd or [sys.executable, "-m", "spmdrl", "train", "--nproc", str(args.nproc), "--config", args.config,
                      *overrides]
        self.out, self.err = open(self.log + ".out", "w"), open(self.log + ".err", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, env={**os.environ, **(env or {})})
        self.pids: set[int] = set()

    def snapshot(self) -> None:
        self.pids |= descendants(self.proc.pid)

    def running(self) -> bool:
        self.snapshot()
        return self.proc.poll() is None

    def remaining(self) -> list[int]:
        return sorted(p for p in self.pids | {self.proc.pid} if alive(p) and (p == self.proc.pid or "python" in cmdline(p)))

    def wait_gone(self, limit: float) -> float | None:
        """Seconds until no process of the job is alive (reaping the launcher), or None past `limit`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit:
            self.proc.poll()
            if not self.remaining():
                # the launcher may have exited after the poll above: reap it so returncode is set
                self.proc.wait(timeout=max(1.0, limit - (time.monotonic() - t0)))
                return time.monotonic() - t0
            time.sleep(0.1)
        return None

    def ranks(self) -> dict[int, int]:
        """{rank: pid} of the job's ranks (their RANK variable)."""
        out = {}
        for pid in descendants(self.proc.pid):
            if "spmdrl.train" not in cmdline(pid):
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                out[int(env.get(b"RANK", b"0"))] = pid
            except (OSError, ValueError):
                pass
        return out

    def text(self, which: str) -> str:
        with open(f"{self.log}.{which}", encoding="utf-8", errors="replace") as f:
            return f.read()

    def kill_all(self) -> None:
        for p in self.remaining():
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait()


def checkpoints(run: str) -> list[str]:
    root = os.path.join(run, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if n.startswith("step_") and os.path.isfile(os.path.join(root, n, "COMPLETE")))


def saving(run: str) -> bool:
    root = os.path.join(run, "checkpoints")
    return os.path.isdir(root) and any(n.startswith(".tmp-step_") for n in os.listdir(root))


def metric_rows(run: str) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for(cond, job: Job, limit: float, poll: float = 0.05) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if not job.running():
            return False
        if cond():
            return True
        time.sleep(poll)
    return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--config", "-c", required=True, help="your TOML config")
    p.add_argument("--nproc", "-n", type=int, default=2, help="ranks on this machine")
    p.add_argument("--out", "-o", required=True, help="a new directory for the check's run and logs")
    p.add_argument("--start-s", type=float, default=1800, help="longest wait for a launch to reach a checkpoint/step")
    p.add_argument("--wait-save-s", type=float, default=600, help="longest wait for a save to be in progress")
    p.add_argument("--rank-kill-s", type=float, default=120, help="longest the job may take to end after a rank dies")
    p.add_argument("--checks", default=",".join(CHECKS),
                   help=f"comma-separated subset of {','.join(CHECKS)} (the order is fixed)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = p.parse_args(argv)
    todo = set(args.checks.split(","))
    if not todo <= set(CHECKS) or "resume" in todo and len(todo) == 1:
        print(f"error: --checks {args.checks!r}: choose from {','.join(CHECKS)} (resume needs an earlier check)", file=sys.stderr)
        return 2
    if os.path.exists(args.out) and os.listdir(args.out):
        print(f"error: --out {args.out} is not empty; give a new directory", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    run = os.path.join(args.out, "run")
    ov = [*args.overrides, f"trainer.output_dir={run}", "checkpoint.resume=auto", "checkpoint.save_freq=1"]
    results: list[tuple[str, bool, str]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    if "config-typo" in todo:
        config_typo(args, run, ov, check)
    if "launcher-kill" in todo:
        launcher_kill(args, run, ov, check)
    if "launcher-term" in todo:
        launcher_term(args, run, ov, check)
    if "launcher-int" in todo:
        launcher_int(args, run, ov, check)
    if "rank-kill" in todo:
        rank_kill(args, run, ov, check)
    if "rank-kill-save" in todo:
        rank_kill_save(args, run, ov, check)
    if "rank0-kill-start" in todo:
        rank0_kill_start(args, run, ov, check)
    if "resume" in todo:
        resume(args, run, ov, check)
    return 0 if results and all(ok for _, ok, _ in results) else 1


def launcher_kill(args, run, ov, check) -> None:
    job = Job(1, args, ov)
    if not wait_for(lambda: checkpoints(run), job, args.start_s, poll=0.5):
        check("kill -9 launcher", False, f"no checkpoint within {args.start_s:g}s (see {job.log}.err)")
        job.kill_all()
        return
    job.snapshot()
    os.kill(job.proc.pid, signal.SIGKILL)
    took = job.wait_gone(TERM_LIMIT_S)
    left = job.remaining()
    check("kill -9 launcher", took is not None,
          f"all {len(job.pids) + 1} processes gone after {took:.1f}s" if took is not None else f"still alive after {TERM_LIMIT_S:g}s: {left}")
    job.kill_all()


def launcher_term(args, run, ov, check) -> None:
    """SIGTERM to the launcher during a save."""
    before = checkpoints(run)
    rows = len(metric_rows(run))
    job = Job(2, args, ov)
    in_save = wait_for(lambda: saving(run), job, args.wait_save_s, poll=0.02)
    if not in_save and job.running():
        wait_for(lambda: len(metric_rows(run)) > rows, job, args.start_s, poll=0.2)
    job.snapshot()
    os.kill(job.proc.pid, signal.SIGTERM)
    took = job.wait_gone(TERM_LIMIT_S)
    err = job.text("err")
    errors = [ln for ln in err.splitlines() if ln.startswith("error")]
    when = "during a save" if in_save else "after a step (no save seen)"
    check("SIGTERM launcher " + when, took is not None and job.proc.returncode not in (0, None),
          f"all processes gone after {took:.1f}s, exit {job.proc.returncode}" if took is not None
          else f"still alive after {TERM_LIMIT_S:g}s: {job.remaining()}")
    check("SIGTERM: one line", len(errors) == 1 and "Traceback" not in err,
          errors[0][:400] if len(errors) == 1 else f"{len(errors)} error lines, traceback: {'Traceback' in err}")
    torn = [c for c in checkpoints(run) if c not in before and not os.path.isfile(os.path.join(run, "checkpoints", c, "manifest.json"))]
    check("SIGTERM: no torn checkpoint", not torn, f"complete checkpoints {checkpoints(run)}")
    job.kill_all()


def launcher_int(args, run, ov, check) -> None:
    """Ctrl-C: SIGINT to the launcher (what a terminal sends its foreground process group) after a new step."""
    rows = len(metric_rows(run))
    job = Job(3, args, ov)
    if not wait_for(lambda: len(metric_rows(run)) > rows, job, args.start_s, poll=0.2):
        check("Ctrl-C", False, f"no new step within {args.start_s:g}s (see {job.log}.err)")
        job.kill_all()
        return
    job.snapshot()
    os.kill(job.proc.pid, signal.SIGINT)
    took = job.wait_gone(TERM_LIMIT_S)
    err = job.text("err")
    errors = [ln for ln in err.splitlines() if ln.startswith("error")]
    ok = took is not None and len(errors) == 1 and "Traceback" not in err and "KeyboardInterrupt" not in err
    check("Ctrl-C", ok, f"gone after {took:.1f}s, exit {job.proc.returncode}: {errors[0][:120] if errors else ''}"
          if took is not None else f"still alive after {TERM_LIMIT_S:g}s: {job.remaining()}")
    job.kill_all()


def rank_kill(args, run, ov, check) -> None:
    rows = len(metric_rows(run))
    job = Job(4, args, ov)
    if wait_for(lambda: len(metric_rows(run)) > rows, job, args.start_s, poll=0.2):
        ranks = job.ranks()
        rank = max(ranks) if ranks else -1
        if ranks:
            os.kill(ranks[rank], signal.SIGKILL)
        took = job.wait_gone(args.rank_kill_s)
        named = bool(ranks) and killed_rank_named(job, rank, ranks[rank])
        check("kill -9 rank", bool(ranks) and took is not None and job.proc.returncode == 1 and named,
              f"job ended {took:.1f}s after killing rank {rank}, exit {job.proc.returncode}, named: {named}"
              if ranks and took is not None else f"no rank found or still alive after {args.rank_kill_s:g}s")
    else:
        check("kill -9 rank", False, f"no new step within {args.start_s:g}s (see {job.log}.err)")
    job.kill_all()


def killed_rank_named(job: Job, rank: int, pid: int) -> bool:
    """The launcher's one line for a rank that died without a word."""
    return f"error: rank {rank} (pid {pid}) was killed by SIGKILL" in job.text("err")


def config_typo(args, run, ov, check) -> None:
    """A misspelt key under the launcher that replaces torchrun (python -m spmdrl.process.launcher, torchrun's
    arguments): exactly one line, exit 2, no torchrun summary or traceback."""
    cmd = [sys.executable, "-m", "spmdrl.process.launcher", "--standalone", "--nproc-per-node", str(args.nproc), "-m",
           "spmdrl.train", "--config", args.config, *ov, "trainer.totl_steps=3"]
    job = Job(0, args, ov, cmd=cmd)
    job.proc.wait(timeout=args.start_s)
    err = [ln for ln in job.text("err").splitlines() if ln.strip() and "Warning" not in ln]
    ok = job.proc.returncode == 2 and len(err) == 1 and err[0].startswith("error") and "totl_steps" in err[0]
    check("config typo under the launcher", ok, f"exit {job.proc.returncode}, {len(err)} line(s): {err[0][:120] if err else ''}")
    job.kill_all()


def rank_kill_save(args, run, ov, check) -> None:
    """kill -9 of the last rank while a checkpoint is being written: the job ends, the launcher names the rank,
    exit 1 (not a user error), and no torn checkpoint is complete."""
    before = checkpoints(run)
    job = Job(6, args, ov)
    if not wait_for(lambda: saving(run), job, args.wait_save_s, poll=0.02):
        check("kill -9 rank during a save", False, f"no save seen within {args.wait_save_s:g}s (see {job.log}.err)")
        job.kill_all()
        return
    ranks = job.ranks()
    rank = max(ranks) if ranks else -1
    if ranks:
        os.kill(ranks[rank], signal.SIGKILL)
    took = job.wait_gone(args.rank_kill_s)
    torn = [c for c in checkpoints(run) if c not in before and not os.path.isfile(os.path.join(run, "checkpoints", c, "manifest.json"))]
    ok = bool(ranks) and took is not None and job.proc.returncode == 1 and killed_rank_named(job, rank, ranks[rank]) and not torn
    check("kill -9 rank during a save", ok, f"job ended {took:.1f}s after killing rank {rank}, exit {job.proc.returncode}"
          f", named: {killed_rank_named(job, rank, ranks[rank])}, torn: {torn}" if ranks and took is not None
          else f"no rank found or still alive after {args.rank_kill_s:g}s: {job.remaining()}")
    job.kill_all()


def rank0_kill_start(args, run, ov, check) -> None:
    """kill -9 of rank 0 while the job starts (2 s after the ranks print their place in the meshes: models
    loading, engines and vLLM building): the other ranks leave within START_KILL_LIMIT_S, the launcher names
    rank 0, exit 1."""
    job = Job(7, args, ov)
    if not wait_for(lambda: "[rank0]" in job.text("out"), job, args.start_s, poll=0.1):
        check("kill -9 rank 0 at start-up", False, f"ranks did not start (see {job.log}.err)")
        job.kill_all()
        return
    time.sleep(2.0)
    job.snapshot()
    pid = job.ranks().get(0)
    if pid:
        os.kill(pid, signal.SIGKILL)
    took = job.wait_gone(START_KILL_LIMIT_S)
    ok = bool(pid) and took is not None and job.proc.returncode == 1 and killed_rank_named(job, 0, pid)
    check("kill -9 rank 0 at start-up", ok, f"all gone {took:.1f}s after the kill, exit {job.proc.returncode}, "
          f"named: {killed_rank_named(job, 0, pid)}" if pid and took is not None
          else f"still alive after {START_KILL_LIMIT_S:g}s: {job.remaining()}")
    job.kill_all()


def resume(args, run, ov, check) -> None:
    had = checkpoints(run)  # none: the relaunch starts over (the same run, before its first checkpoint)
    job = Job(5, args, ov)
    job.proc.wait()
    out = job.text("out")
    steps = sorted({r["step"] for r in metric_rows(run)})
    last = steps[-1] if steps else -1
    resumed = "resumed from" in out
    check("resume", job.proc.returncode == 0 and resumed == bool(had) and steps == list(range(steps[0], last + 1)),
          f"exit {job.proc.returncode}, {'resumed from ' + had[-1] if resumed else 'started over (no checkpoint)'}, "
          f"steps {steps[:1]}..{last}")


if __name__ == "__main__":
    sys.exit(main())
