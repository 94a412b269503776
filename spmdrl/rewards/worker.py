"""A user reward function in its own process, so that reward.timeout_s can stop anything it does.

The training rank talks to one worker (`spmdrl.rewards.worker.main(SPEC)` in a new interpreter) over a pipe: each call is a
length-prefixed pickle of the keyword arguments, answered by a pickle of ("ok", value) or ("error", type name,
message). When no answer comes within reward.timeout_s the rank kills the worker (SIGKILL: a C loop or a
pathological regex included), raises RewardTimeout for that sample and starts a new worker at the next call;
a worker that dies (a segfault, os._exit in user code) is a failed sample the same way. The worker dies with
its rank (PR_SET_PDEATHSIG on Linux, and end of input otherwise), ignores Ctrl-C (the rank decides), and
writes whatever the function prints to stderr, so the protocol on its own file descriptors stays clean. It
is a subreaper (spmdrl/process/proctree.py): whatever the function starts is killed after each call, and with the
worker on a timeout. Tool workers (tools/worker.py) are started and served by the same functions.

The cost is a pickle round trip per sample (tens of microseconds) and one process per rank;
reward.in_process = true keeps the function in the rank's process instead (a SIGALRM timer, which stops
Python code between bytecodes but not a C call until it returns).
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

from spmdrl.errors import RewardError
from spmdrl.process.proctree import become_subreaper, has_children, kill_tree
from spmdrl.process.workers import LEN as _LEN, kill_worker, recv as _recv, send as _send, serve_streams, spawn_worker

START_TIMEOUT_S = 120.0  # importing the user's module (and its dependencies) is not the function's time


class RewardTimeout(Exception):
    """A reward function ran past reward.timeout_s on one sample."""


class RewardWorkerError(Exception):
    """The worker died during a call (a failed sample, like an exception of the function)."""


class RemoteError(Exception):
    """The reward function raised in the worker; subclassed per call under the original exception's name."""


def _remote(name: str, message: str) -> RemoteError:
    return type(name, (RemoteError,), {})(message)


class RewardWorker:
    """fn(**kwargs) of reward function `spec` in a worker process, at most `timeout_s` seconds per call
    (RewardTimeout after that, the worker killed and replaced). Called like the function itself."""

    def __init__(self, spec: str, timeout_s: float):
        self.spec, self.timeout_s = spec, float(timeout_s)
        self.__spmdrl_spec__ = spec
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self.proc = spawn_worker("spmdrl.rewards.worker", [self.spec])
        try:
            reply = self._wait(time.monotonic() + max(START_TIMEOUT_S, self.timeout_s), starting=True)
        except RewardWorkerError as e:
            raise RewardError(f"reward function {self.spec!r}: {e}") from None
        if reply[0] != "ready":
            self.close()
            raise RewardError(f"reward function {self.spec!r}: its worker process could not load it ({reply[1]}: "
                              f"{reply[2]})")

    def _wait(self, deadline: float, starting: bool = False):
        try:
            reply = _recv(self.proc.stdout.fileno(), deadline)
        except TimeoutError:
            self.close()
            if starting:
                raise RewardError(f"reward function {self.spec!r}: its worker process did not load it within "
                                  f"{max(START_TIMEOUT_S, self.timeout_s):g}s") from None
            raise RewardTimeout(f"took longer than reward.timeout_s={self.timeout_s:g}s (its worker process was "
                                "killed and is replaced)") from None
        if reply is None:
            code = self.proc.wait()
            self.proc = None
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise RewardWorkerError(f"its worker process died ({how}); see its output above")
        return reply

    def __call__(self, **kwargs):
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            _send(self.proc.stdin, kwargs)
        except BrokenPipeError:
            self.close()
            raise RewardWorkerError("its worker process died before the call") from None
        reply = self._wait(time.monotonic() + self.timeout_s if self.timeout_s > 0 else None)
        if reply[0] == "ok":
            return reply[1]
        raise _remote(reply[1], reply[2])

    def close(self) -> None:
        if self.proc is not None:
            kill_worker(self.proc)
            self.proc = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---- the worker process -------------------------------------------------------------------------------------

def main(spec: str) -> int:
    parent = os.getppid()
    requests, replies = serve_streams()
    if os.getppid() != parent:
        return 0
    become_subreaper()  # what the function starts stays under this process, and dies with it on a timeout
    try:
        from spmdrl.rewards.loader import load_reward_fn

        fn = load_reward_fn(spec)
    except Exception as e:
        _send(replies, ("error", type(e).__name__, " ".join(str(e).split())[:500]))
        return 1
    _send(replies, ("ready",))
    fd = requests.fileno()
    while True:
        kwargs = _recv(fd, None)
        if kwargs is None:  # the rank closed the pipe or is gone
            return 0
        try:
            data = pickle.dumps(("ok", fn(**kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # the function raised, or returned something that does not pickle
            data = pickle.dumps(("error", type(e).__name__, " ".join(str(e).split())[:500]))
        if has_children():  # nothing the function started outlives its call
            kill_tree(os.getpid(), include_root=False)
        replies.write(_LEN.pack(len(data)) + data)
        replies.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
