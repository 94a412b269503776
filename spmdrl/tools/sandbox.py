"""Run a Python program outside the trainer process, under resource limits (docs/tools.md, "The Python sandbox").

Each run is a fresh interpreter (`python -I`, isolated mode) in a new temporary directory (removed afterwards)
holding only the program, with an empty environment, stdin from /dev/null, and limits set by a small bootstrap
before it execs the program: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE),
processes (RLIMIT_NPROC), open files (RLIMIT_NOFILE), no core files. When the trainer runs as root the program
runs as the user `nobody` (root ignores RLIMIT_NPROC, and nobody cannot signal or ptrace the trainer, nor read
root's private files), in its own network namespace (no network at all: not the job's TCPStore, not the
internet) and mount namespace, where the run's directories (`hidden`) are covered by an empty read-only
directory. As another user it gets its own network namespace where the kernel lets unprivileged users
create one (a user namespace).

The bootstrap forks the program and stays as its parent and subreaper (spmdrl/process/proctree.py): when the program
exits, every process it started (children, new sessions, double forks) is killed, then the bootstrap exits
as the program did. At the wall-clock limit the trainer kills the bootstrap and everything under it. stdout
and stderr are read concurrently and cut to a size.

No subprocess of the trainer is started with a preexec_fn (unsafe in a threaded process): the bootstrap sets
all this up itself, before the user's code exists.
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

from spmdrl.process.proctree import kill_tree

NOBODY = "nobody"
_GRACE_S = 0.2
"""How long output is still read after the program's main process exits (its children may hold the pipes)."""

HIDE_ENV = "SPMDRL_SANDBOX_HIDE"
"""Directories (os.pathsep-separated) the program must not read, when run_python is not given them: a tool
worker gets the run's output_dir this way (tools/runner.py)."""

_BOOTSTRAP = r"""
import ctypes, os, resource, signal, sys, time
cpu_s, memory, fsize, nproc, nofile, uid, gid = (int(a) for a in sys.argv[1:8])
hidden = [p for p in sys.argv[8].split(os.pathsep) if p]
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the program's orphans stay under this process
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
NEWNET, NEWNS, NEWUSER = 0x40000000, 0x00020000, 0x10000000

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

if os.geteuid() == 0:
    libc.unshare(NEWNET)
    if hidden and libc.unshare(NEWNS) == 0:
        libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None)  # MS_REC | MS_PRIVATE: nothing leaks back
        for path in hidden:  # an empty read-only directory over each
            libc.mount(b"tmpfs", path.encode(), b"tmpfs", 1 | 2 | 4 | 8, b"size=4k,mode=0555")
    counted = None
else:  # where unprivileged user namespaces are allowed; this user keeps its own ids inside
    real_uid, real_gid = os.getuid(), os.getgid()
    counted = tasks_of(real_uid)  # inside, other users' processes may show as this one (the overflow uid)
    if libc.unshare(NEWUSER | NEWNET) == 0:
        for name, text in (('setgroups', 'deny'), ('uid_map', '%d %d 1' % (real_uid, real_uid)),
                           ('gid_map', '%d %d 1' % (real_gid, real_gid))):
            try:
                with open('/proc/self/' + name, 'w') as f:
                    f.write(text)
            except OSError:
                pass

def under(root):
    children = {}
    for name in os.listdir('/proc'):
        try:
            with open('/proc/' + name + '/stat', 'rb') as f:
                stat = f.read()
            children.setdefault(int(stat[stat.rindex(b')') + 2:].split()[1]), []).append(int(name))
        except (OSError, ValueError, IndexError):
            pass
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out

def state(pid):
    try:
        with open('/proc/%d/stat' % pid, 'rb') as f:
            return f.read().rsplit(b')', 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return 'X'

pid = os.fork()
if pid == 0:
    if uid >= 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    mine = tasks_of(os.getuid()) if counted is None else counted
    for r, soft in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, nofile),
                    (resource.RLIMIT_NPROC, mine + nproc), (resource.RLIMIT_AS, memory)):
        hard = soft + 1 if r == resource.RLIMIT_CPU else soft  # SIGXCPU at the soft CPU limit, SIGKILL a second later
        old_hard = resource.getrlimit(r)[1]
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(r, (soft, hard))
    os.execve(sys.executable, [sys.executable, '-I', 'main.py'], {})
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
while True:
    try:
        status = os.waitpid(pid, 0)[1]
        break
    except InterruptedError:
        pass
seen = set()
for _ in range(50):  # stop what is left (so nothing forks meanwhile), read again until nothing is new, kill
    new = [p for p in under(os.getpid()) if p not in seen]
    if not new:
        break
    for p in new:
        try:
            os.kill(p, signal.SIGSTOP)
        except OSError:
            pass
    for _ in range(1000):  # until they have stopped: one in the middle of a fork would start a child unseen
        if all(state(p) in 'TtZX' for p in new):
            break
        time.sleep(0.001)
    seen.update(new)
for p in seen:
    try:
        os.kill(p, signal.SIGKILL)
    except OSError:
        pass
if os.WIFSIGNALED(status):  # end as the program ended
    sig = os.WTERMSIG(status)
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
os._exit(os.WEXITSTATUS(status))
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


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), python: str = "",
               hidden: list[str] | None = None) -> SandboxResult:
    """Run `code` as a program in a fresh sandboxed interpreter (`python`, default this one); never raises
    for what the program does. hidden: directories it must not read (default: $SPMDRL_SANDBOX_HIDE)."""
    python = python or sys.executable
    workdir = tempfile.mkdtemp(prefix="spmdrl-sandbox-")
    try:
        main = os.path.join(workdir, "main.py")
        with open(main, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        user = _sandbox_user()
        if user is not None:
            os.chown(workdir, *user)
            os.chown(main, *user)
        if hidden is None:
            hidden = [d for d in os.environ.get(HIDE_ENV, "").split(os.pathsep) if d]
        hide = _hideable(hidden, python, workdir) if user is not None else []
        mib = 1 << 20
        argv = [python, "-I", "-c", _BOOTSTRAP, str(int(limits.cpu_s)), str(int(limits.memory_mb) * mib),
                str(int(limits.file_mb) * mib), str(int(limits.processes)), str(int(limits.open_files)),
                str(user[0] if user else -1), str(user[1] if user else -1), os.pathsep.join(hide)]
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True, umask=0o077)
        try:
            out, err, cut, timed_out = _collect(proc, start + limits.wall_s, limits.output_chars)
        finally:
            _kill_all(proc)
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


def _hideable(dirs: list[str], python: str, workdir: str) -> list[str]:
    """The existing directories of `dirs` that can be covered: not one holding the interpreter (a virtual
    environment inside the run's directory) or the program's own directory."""
    keep = [os.path.realpath(p) for p in (python, sys.executable, workdir)] + [os.path.abspath(python)]
    out = []
    for d in dirs:
        d = os.path.realpath(d)
        if os.path.isdir(d) and d != "/" and not any(k == d or k.startswith(d + os.sep) for k in keep):
            out.append(d)
    return out


def _kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the bootstrap and everything under it (the program, and what the program started), then reap."""
    if proc.poll() is None:
        kill_tree(proc.pid)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # unkillable (uninterruptible sleep); left to the kernel
        pass
