"""Run a Python program outside the trainer process, under resource limits (docs/tools.md, "The Python sandbox").

Each run is a fresh interpreter (`python -I`, isolated mode) started in its own session and process group, in a
new temporary directory (removed afterwards) holding only the program, with an empty environment, stdin from
/dev/null, and limits set by a small bootstrap before it execs the program: CPU seconds (RLIMIT_CPU), address
space (RLIMIT_AS), file size (RLIMIT_FSIZE), processes (RLIMIT_NPROC), open files (RLIMIT_NOFILE), no core
files. When the trainer runs as root the sandbox runs as the user `nobody` (root ignores RLIMIT_NPROC, and
nobody cannot signal or ptrace the trainer, nor read root's private files). At the wall-clock limit, and after
every run, the whole process group gets SIGKILL. stdout and stderr are read concurrently and cut to a size.

No subprocess of the trainer is started with a preexec_fn (unsafe in a threaded process): the limits are set
by the child on itself, before the user's code exists.
"""
from __future__ import annotations

import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = "nobody"
_GRACE_S = 0.2
"""How long output is still read after the program's main process exits (its children may hold the pipes)."""

_BOOTSTRAP = r"""
import os, resource, sys
cpu_s, memory, fsize, nproc, nofile = (int(a) for a in sys.argv[1:6])

def tasks_of(uid):
    # RLIMIT_NPROC compares against every task (process or thread) of the real uid: count them
    n = 0
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            with open('/proc/' + pid + '/status') as f:
                status = dict(line.split(':', 1) for line in f.read().splitlines() if ':' in line)
            if int(status['Uid'].split()[0]) == uid:
                n += int(status['Threads'])
        except (OSError, KeyError, ValueError):
            pass
    return n

mine = tasks_of(os.getuid())
for r, soft in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_FSIZE, fsize),
                (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, mine + nproc), (resource.RLIMIT_AS, memory)):
    hard = soft + 1 if r == resource.RLIMIT_CPU else soft  # SIGXCPU at the soft CPU limit, SIGKILL a second later
    old_hard = resource.getrlimit(r)[1]
    if old_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, old_hard), min(hard, old_hard)
    resource.setrlimit(r, (soft, hard))
os.execve(sys.executable, [sys.executable, '-I', 'main.py'], {})
"""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; see the [multi_turn] sandbox_* keys."""

    wall_s: float = 8.0
    cpu_s: int = 5
    memory_mb: int = 1024
    file_mb: int = 16
    processes: int = 16
    open_files: int = 64
    output_chars: int = 4096

    @classmethod
    def from_config(cls, mt) -> "SandboxLimits":
        return cls(wall_s=mt.sandbox_timeout_s, cpu_s=mt.sandbox_cpu_s, memory_mb=mt.sandbox_memory_mb,
                   file_mb=mt.sandbox_file_mb, processes=mt.sandbox_processes, output_chars=mt.sandbox_output_chars)


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int
    """The program's exit status; -N when signal N ended it (SIGKILL at the wall-clock limit)."""
    timed_out: bool
    """Killed at the wall-clock limit."""
    seconds: float
    truncated: bool
    """stdout or stderr was cut to output_chars."""

    def describe(self, limits: SandboxLimits) -> str:
        """How the run ended, one bracketed line ('' for exit status 0)."""
        if self.timed_out:
            return f"[killed: ran longer than the {limits.wall_s:g}s time limit]"
        if self.returncode < 0:
            sig = -self.returncode
            if sig in (signal.SIGXCPU, signal.SIGKILL):
                return f"[killed: used up the {limits.cpu_s}s CPU-time limit]"
            return f"[killed by signal {signal.Signals(sig).name}]"
        return f"[exit status {self.returncode}]" if self.returncode else ""


def _sandbox_user() -> tuple[int, int] | None:
    """(uid, gid) to run as: nobody's when this process is root, else None (run as this user)."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(NOBODY)
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        return 65534, 65534


_checked: dict[str, str] = {}


def interpreter_problem(python: str) -> str:
    """'' when the sandbox can start `python` (as nobody when this process is root), else why not."""
    if python in _checked:
        return _checked[python]
    user = _sandbox_user()
    drop = {"user": user[0], "group": user[1], "extra_groups": []} if user else {}
    who = f"the user {NOBODY!r}" if user else "this user"
    try:
        done = subprocess.run([python, "-I", "-c", "import encodings, json"], env={}, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60, **drop)
        problem = "" if done.returncode == 0 else \
            f"{who} cannot run {python}: {' '.join(done.stderr.decode(errors='replace').split())[-200:]}"
    except (OSError, subprocess.SubprocessError) as e:
        problem = f"{who} cannot run {python}: {type(e).__name__}: {e}"
    _checked[python] = problem
    return problem


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), python: str = "") -> SandboxResult:
    """Run `code` as a program in a fresh sandboxed interpreter (`python`, default this one); never raises
    for what the program does."""
    python = python or sys.executable
    workdir = tempfile.mkdtemp(prefix="spmdrl-sandbox-")
    try:
        main = os.path.join(workdir, "main.py")
        with open(main, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        user = _sandbox_user()
        drop = {}
        if user is not None:
            os.chown(workdir, *user)
            os.chown(main, *user)
            drop = {"user": user[0], "group": user[1], "extra_groups": []}
        mib = 1 << 20
        argv = [python, "-I", "-c", _BOOTSTRAP, str(int(limits.cpu_s)), str(int(limits.memory_mb) * mib),
                str(int(limits.file_mb) * mib), str(int(limits.processes)), str(int(limits.open_files))]
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True, umask=0o077, **drop)
        try:
            out, err, cut, timed_out = _collect(proc, start + limits.wall_s, limits.output_chars)
        finally:
            _kill_group(proc)
            for stream in (proc.stdout, proc.stderr):
                stream.close()
        seconds = time.monotonic() - start
        return SandboxResult(out, err, proc.returncode if not timed_out else -signal.SIGKILL, timed_out, seconds, cut)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc: subprocess.Popen, deadline: float, chars: int) -> tuple[str, str, bool, bool]:
    """Read both pipes until they close, the deadline passes, or a grace period after the main process exits."""
    cap = 4 * chars + 4  # bytes enough for `chars` UTF-8 characters
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    total = dict.fromkeys(bufs, 0)
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    exited_at = None
    timed_out = False
    try:
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _GRACE_S:
                break
            if now >= deadline:
                timed_out = proc.poll() is None
                break
            wait = min(deadline - now, 0.05 if exited_at is not None else 0.5)
            for key, _ in sel.select(wait):
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(key.fd)
                    continue
                total[key.fd] += len(data)
                room = cap - len(bufs[key.fd])
                if room > 0:
                    bufs[key.fd] += data[:room]
    finally:
        sel.close()
    texts = []
    cut = False
    for fd, buf in bufs.items():
        text = buf.decode("utf-8", errors="replace")
        if len(text) > chars or total[fd] > cap:
            text = text[:chars] + f"\n[... output cut at {chars} characters]"
            cut = True
        texts.append(text)
    return texts[0], texts[1], cut, timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (the program and every child still in it), then reap the program."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # unkillable (uninterruptible sleep); left to the kernel
        pass
