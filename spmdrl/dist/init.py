"""Process-group init from torchrun, srun, or nothing (a world of one)."""
from __future__ import annotations

import datetime
import logging
import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .group_log import start_group_log
from .node import device_index, launched_by, node_local_rank

log = logging.getLogger("spmdrl")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | slurm | single


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as 'gpu[01-03,07],login1' into host names."""
    hosts = []
    for m in re.finditer(r"([^,\[]+)(\[([^\]]+)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(3)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
            else:
                hosts.append(prefix + part)
    return hosts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_env(environ=None) -> DistEnv:
    """Rank/world/master from torchrun's variables, else Slurm's (srun without torchrun), else a world of one."""
    env = os.environ if environ is None else environ
    launcher, local_rank = launched_by(env), node_local_rank(env)
    if launcher == "torchrun":
        return DistEnv(
            int(env["RANK"]), int(env["WORLD_SIZE"]), local_rank,
            env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun",
        )
    if launcher == "slurm":
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        hosts = expand_nodelist(nodelist) if nodelist else ["127.0.0.1"]
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        return DistEnv(
            int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), local_rank,
            env.get("MASTER_ADDR", hosts[0]), int(env.get("MASTER_PORT", 20000 + job % 20000)), "slurm",
        )
    return DistEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", 0)) or _free_port(), "single")


def default_local_rank(rank: int) -> int:
    """LOCAL_RANK for a process group someone else initialised without exporting it: ranks fill nodes in order."""
    return rank % max(1, torch.cuda.device_count())


def resolve_device(spec: str) -> torch.device:
    if spec == "cuda" or (spec == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def binds_device(split: bool) -> bool:
    """Whether the default process group is bound to this rank's CUDA device (`init_process_group(device_id=)`).

    Bound, torch creates the world's NCCL communicator at init and every later NCCL group by `ncclCommSplit`
    of it: a collective over every rank of the world, so every rank must make the same group creations in
    the same order. Colocated placement does (every rank builds every role and vLLM). Split placement does
    not: vLLM is built on the rollout ranks only, its groups created by their members alone
    (rollout/vllm_world.py), so the default group stays unbound and each NCCL group connects its members
    (`ncclCommInitRank`) at its first collective. `spmdrl.dist.group_log` checks both rules on CPU runs."""
    return not split


def init_distributed(device_spec: str = "auto", timeout_s: float = 600.0, *,
                     split: bool = False) -> tuple[DistEnv, torch.device]:
    """Initialise the default process group (NCCL on CUDA, gloo on CPU); export the env vars vLLM reads (on
    CUDA, LOCAL_RANK is the index of this rank's GPU among the visible ones).
    split: the run uses split placement (the default group is then not bound to the device, see
    `binds_device`)."""
    env = detect_env()
    launch_env = dict(os.environ)  # as the launcher set it: the exports below make an srun task look like torchrun's
    for k, v in (
        ("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
        ("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port),
        ("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_WORLD_SIZE", env.world_size if env.launcher == "single" else "")),
    ):
        if str(v):
            os.environ[k] = str(v)
    device = resolve_device(device_spec)
    if device.type == "cuda":
        # the GPU among those this task sees (all of the node's, or only its own: spmdrl.dist.node); vLLM's
        # external_launcher drives cuda:LOCAL_RANK, so LOCAL_RANK names the same one
        index = device_index(launch_env, torch.cuda.device_count())
        os.environ["LOCAL_RANK"] = str(index)
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" and binds_device(split) else None,
        )
    start_group_log(env.rank, env.world_size, device_bound=binds_device(split))  # SPMDRL_GROUP_LOG=<dir> only
    return env, device


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
