"""Ending every process a piece of user code started: its children, new-session children and double forks.

A process that calls `become_subreaper()` (Linux PR_SET_CHILD_SUBREAPER, unprivileged, any kernel since 3.4)
inherits the orphans of its descendants instead of init: a grandchild whose parent exited (a double fork, a
daemon that called setsid) is re-parented to it, so every process started under it stays in its tree of
parent links, whatever session or process group it moved to. `kill_tree` stops that tree first (SIGSTOP, so
nothing forks or exits while it is read), reads it again until no new process appears, then SIGKILLs it.

This needs no root, no namespace and no cgroup, so it works the same under Slurm, in a container and here.
What it cannot reach: a process handed to another daemon (at, systemd-run, ssh to localhost) and, if the
subreaper itself is SIGKILLed, the processes still running under it (they go to init).
"""
from __future__ import annotations

import ctypes
import os
import signal
import time

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def become_subreaper() -> bool:
    """Orphans of this process's descendants become its children (Linux); False where unsupported."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """This process gets `sig` when the thread that started it exits (Linux PR_SET_PDEATHSIG)."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def has_children() -> bool:
    """Whether this process has any child, running or exited and not yet waited for (one system call)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process now visible in /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            out[int(name)] = int(stat[stat.rindex(b")") + 2:].split(None, 2)[1])
        except (OSError, ValueError, IndexError):  # gone while read
            pass
    return out


def descendants(root: int) -> list[int]:
    """The processes under `root` by parent links (not root itself), parents before children."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "X"


def _wait_stopped(pids, timeout_s: float = 1.0) -> None:
    """Until every one of `pids` is stopped or gone: kill(SIGSTOP) returns before the process has stopped, and
    a process still running (in the middle of a fork) could start a child after the next read."""
    deadline = time.monotonic() + timeout_s
    waiting = list(pids)
    while waiting and time.monotonic() < deadline:
        waiting = [p for p in waiting if _state(p) not in ("T", "t", "Z", "X")]
        if waiting:
            time.sleep(0.001)


def kill_tree(root: int, *, include_root: bool = True, rounds: int = 50) -> int:
    """SIGKILL every process under `root` (and root itself unless include_root=False); how many were found.

    Each round stops what it finds and waits until it has stopped, so a process cannot fork a child the next
    read misses; the rounds end when a read finds nothing new (a fork bomb under RLIMIT_NPROC ends within a
    few rounds)."""
    seen: set[int] = set()
    if include_root:
        _signal(root, signal.SIGSTOP)
        _wait_stopped([root])
    for _ in range(rounds):
        new = [p for p in descendants(root) if p not in seen]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        _wait_stopped(new)
        seen.update(new)
    for pid in seen:
        _signal(pid, signal.SIGKILL)
    if include_root:
        _signal(root, signal.SIGKILL)
    if root == os.getpid() and seen:  # the subreaper reaps what it inherited
        reap_children(wait_s=2.0)
    return len(seen)


def reap_children(wait_s: float = 0.0) -> None:
    """Wait for the exited children of this process (orphans it inherited as a subreaper are its children),
    up to `wait_s` seconds for all of them to have exited."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.002)
