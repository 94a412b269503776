"""Worker processes that run user code for a rank: started, spoken to over a pipe, and killed with all they
started.

The rank starts `MODULE.main()` in a new interpreter (spawn_worker) on its own import path; the two sides exchange
length-prefixed pickles on the worker's stdin and stdout (send, recv), which the worker keeps for itself
(serve_streams), so the user code's prints go to stderr. Reward functions (rewards/worker.py) and tools
(tools/worker.py) run this way.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time

from spmdrl.proctree import die_with_parent, kill_tree

LEN = struct.Struct("<Q")


def send(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(LEN.pack(len(data)) + data)
    f.flush()


def read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from fd, or None at end of input; TimeoutError past `deadline` (time.monotonic)."""
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def recv(fd: int, deadline: float | None):
    head = read_exact(fd, LEN.size, deadline)
    if head is None:
        return None
    body = read_exact(fd, LEN.unpack(head)[0], deadline)
    return None if body is None else pickle.loads(body)


def spawn_worker(module: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
    """`module.main(*args)` in a new `python -P` with pipes on its stdin and stdout, on the rank's import path (the
    working directory only where PYTHONPATH names it) in safe-path mode."""
    cwd = os.getcwd()
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = given + [p for p in sys.path if p and os.path.abspath(p) != cwd and p not in given]
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(path), "PYTHONSAFEPATH": "1"}
    # -c, not -m: runpy would warn (twice a run) that a package's __init__ imported the module before it ran
    boot = f"import sys; from {module} import main; sys.exit(main(*sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-P", "-c", boot, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)


def kill_worker(proc: subprocess.Popen) -> None:
    """SIGKILL a worker and every process it started that is still running (spmdrl/proctree.py), then
    close its pipes."""
    if proc.poll() is None:
        kill_tree(proc.pid)
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


def serve_streams():
    """In a worker process: (requests, replies) binary streams on the original stdin and stdout, after pointing
    fd 1 and sys.stdout at stderr (user code's prints, Python and C, stay off the protocol) and fd 0 at
    /dev/null. The worker dies with its rank (PR_SET_PDEATHSIG) and ignores Ctrl-C (the rank decides)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests = os.fdopen(os.dup(0), "rb", buffering=0)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = os.fdopen(os.dup(2), "w", buffering=1)  # its own stream: closing it leaves stderr open
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    return requests, replies
