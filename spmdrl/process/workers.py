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

from spmdrl.process.proctree import die_with_parent, kill_tree

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


# What torchrun and torch.distributed give a rank: its place in the job, the rendezvous address, the elastic
# agent's settings and the file a rank's error goes to. A worker is no rank: code in it that reads them would
# take itself for one (torch.distributed's env:// init, a library that writes the rank's error file).
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                  "NCCL_ASYNC_ERROR_HANDLING")
RANK_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")


def worker_environment(environ) -> dict:
    """`environ` without the rank's torch.distributed and torchrun variables (RANK_VARIABLES, TORCHELASTIC_*)."""
    return {k: v for k, v in environ.items() if k not in RANK_VARIABLES and not k.startswith(RANK_PREFIXES)}


def spawn_worker(module: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
    """`module.main(*args)` in a new `python -P` with pipes on its stdin and stdout, on the rank's import path (the
    working directory only where PYTHONPATH names it) in safe-path mode, with the rank's environment less its
    torch.distributed and torchrun variables (worker_environment), plus `env`."""
    cwd = os.getcwd()
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = given + [p for p in sys.path if p and os.path.abspath(p) != cwd and p not in given]
    env = {**worker_environment(os.environ), **(env or {}), "PYTHONPATH": os.pathsep.join(path),
           "PYTHONSAFEPATH": "1"}
    # -c, not -m: runpy would warn (twice a run) that a package's __init__ imported the module before it ran
    boot = f"import sys; from {module} import main; sys.exit(main(*sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-P", "-c", boot, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)


def kill_worker(proc: subprocess.Popen) -> None:
    """SIGKILL a worker and every process it started that is still running (spmdrl/process/proctree.py), then
    close its pipes."""
    if proc.poll() is None:
        kill_tree(proc.pid)
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


def _ignore(signum, frame) -> None:
    pass


def serve_streams(ignore_sigterm: bool = True):
    """In a worker process: (requests, replies) binary streams on the original stdin and stdout, after pointing
    fd 1 and sys.stdout at stderr (user code's prints, Python and C, stay off the protocol) and fd 0 at
    /dev/null. The worker dies with its rank (PR_SET_PDEATHSIG) and ignores Ctrl-C and SIGUSR1, and with
    ignore_sigterm SIGTERM too: the rank decides (torchrun's SIGTERM reaches the rank's whole process group, a
    scheduler's every process of the job, and the rank finishes its step on the first one). A reward worker ignores
    it (the step being finished needs its rewards); a tool worker does not (a tool that signals itself fails that
    call, and a scheduler's SIGTERM costs a counted call failure, not the step). The ignored signals get a handler
    that does nothing rather than SIG_IGN, so the programs user code starts get the default action back."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for s in (signal.SIGTERM, signal.SIGUSR1) if ignore_sigterm else (signal.SIGUSR1,):
        signal.signal(s, _ignore)
    requests = os.fdopen(os.dup(0), "rb", buffering=0)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = os.fdopen(os.dup(2), "w", buffering=1)  # its own stream: closing it leaves stderr open
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    return requests, replies
