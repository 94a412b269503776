"""Start real multi-process runs from tests: torchrun on loopback, or a plain single process."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], nproc: int | None, timeout: int = 600, module: bool = False, check: bool = True,
        port: int | None = None):
    """Run `args` (a script path, or a module with module=True) under torchrun with nproc ranks (on `port`, default
    a free one), or as one plain process (no torchrun variables) when nproc is None. Returns the CompletedProcess."""
    target = ["-m", *args] if module else args
    if nproc is None:
        cmd = [sys.executable, *target]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port or free_port()), *target]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


@contextlib.contextmanager
def world_of_one(device: str = "cpu"):
    """A world of one process (this one) for in-process engine tests: gloo for device "cpu", NCCL bound to GPU 0
    for "cuda"; left as found on exit."""
    import torch
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        kw = {}
        if device == "cuda":
            torch.cuda.set_device(0)
            kw["device_id"] = torch.device("cuda", 0)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1, **kw)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
