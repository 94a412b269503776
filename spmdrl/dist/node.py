"""Where a rank sits on its node: the GPU it drives, the ranks it shares the node with, and work done once per
node (a model download) while the node's other ranks wait.

The GPU. A rank drives one GPU: its node-local rank modulo the number of GPUs the process sees
(`device_index`). A task that sees every GPU of its node (torchrun, srun with --gpus-per-node) drives GPU
<local rank>; a task bound to its own GPU (srun --gpus-per-task=1, --gpu-bind=single:1, a CUDA_VISIBLE_DEVICES
per task) sees one GPU and drives it, index 0; tasks bound to blocks of k GPUs in task order (--gpu-bind=closest
with block distribution) drive <local rank> mod k. `spmdrl.dist.init` exports the index as LOCAL_RANK, the
variable vLLM's external_launcher turns into its device (cuda:LOCAL_RANK, asserted below the visible device
count) and torch's DeviceMesh falls back to, so spmdrl and vLLM drive the same GPU.

The node. Ranks share a node when they agree on the host name, SLURM_NODEID (set by srun per node) and
GROUP_RANK (torchrun's node rank) (`node_key`); on a real cluster the host name alone decides, and the two
variables let one machine stand in for several nodes. `once_per_node` runs a function on the first rank of
every node while the node's other ranks wait on a gloo group with a long timeout (a download can outlast the
collective timeout), and gives every rank its node's result.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, TypeVar

import torch.distributed as dist

from spmdrl.errors import LayoutError

T = TypeVar("T")

NODE_WORK_TIMEOUT_S = 24 * 3600.0  # how long a node's other ranks wait for its first rank's work (a download)


def launched_by(environ: Mapping[str, str]) -> str:
    """torchrun | slurm | single: torchrun's variables win (torchrun started under srun sets both)."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return "torchrun"
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return "slurm"
    return "single"


def node_local_rank(environ: Mapping[str, str]) -> int:
    """The rank's position on its node as its launcher numbers it: LOCAL_RANK (torchrun), SLURM_LOCALID (srun),
    else 0."""
    launcher = launched_by(environ)
    if launcher == "torchrun":
        return int(environ.get("LOCAL_RANK", 0))
    if launcher == "slurm":
        return int(environ.get("SLURM_LOCALID", 0))
    return 0


def nodes_in_job(environ: Mapping[str, str]) -> int:
    """How many nodes the job's ranks span, from the launcher's variables (before any process group):
    GROUP_WORLD_SIZE (torchrun), SLURM_STEP_NUM_NODES / SLURM_NNODES (srun), else 1."""
    launcher = launched_by(environ)
    if launcher == "torchrun":
        return int(environ.get("GROUP_WORLD_SIZE") or 1)
    if launcher == "slurm":
        return int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    return 1


def device_index(environ: Mapping[str, str], visible: int) -> int:
    """The index, among the `visible` GPUs this process sees, of the GPU this rank drives (module docstring).
    Under torchrun every rank of a node sees the same GPUs, so a local rank past them is one rank too many."""
    local = node_local_rank(environ)
    seen = environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={seen})" if seen is not None else ""
    if visible < 1:
        raise LayoutError(f"trainer.device asks for a GPU but this process sees none{shown}; check the job's GPU "
                          "request (--gpus-per-node / --gpus-per-task) or set trainer.device=cpu")
    if launched_by(environ) == "torchrun" and local >= visible:
        raise LayoutError(f"LOCAL_RANK={local} but this process sees {visible} GPU(s){shown}; start at most "
                          f"{visible} ranks per node (torchrun --nproc-per-node)")
    return local % visible


def node_key(environ: Mapping[str, str], hostname: str) -> str:
    """What ranks on one node share: host name, SLURM_NODEID and torchrun's GROUP_RANK."""
    return "/".join((hostname, environ.get("SLURM_NODEID", ""), environ.get("GROUP_RANK", "")))


@dataclass(frozen=True)
class NodeMap:
    """The ranks of each node (nodes in the order of their first rank, ranks ascending), from every rank's
    node_key."""

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_keys(cls, keys: Sequence[str]) -> NodeMap:
        by_key: dict[str, list[int]] = {}
        for rank, key in enumerate(keys):
            by_key.setdefault(key, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in by_key.values()))

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        """The rank's position among its node's ranks."""
        return self.nodes[self.node_of(rank)].index(rank)

    def leader(self, rank: int) -> int:
        """The first rank of `rank`'s node."""
        return self.nodes[self.node_of(rank)][0]


def gather_node_map(group=None) -> NodeMap:
    """Every rank's node, from one all-gather of node keys over `group` (default: the world). Collective."""
    keys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, node_key(os.environ, socket.gethostname()), group=group)
    return NodeMap.from_keys(keys)


def _picklable(e: BaseException) -> bool:
    try:
        pickle.dumps(e)
        return True
    except Exception:
        return False


def once_per_node(fn: Callable[[], T], *, timeout_s: float = NODE_WORK_TIMEOUT_S) -> T:
    """fn() on the first rank of every node while the node's other ranks wait; every rank returns its node's
    result. An exception raised by fn on any node is raised on every rank (the first node's, by rank).
    Collective over the world: every rank calls it at the same point. A world of one calls fn."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    world, rank = dist.get_world_size(), dist.get_rank()
    # gloo with its own timeout: the waiting ranks sit in this collective for as long as the download takes
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        nodes = gather_node_map(group)
        mine: tuple = (None, None)
        if nodes.leader(rank) == rank:
            try:
                mine = (fn(), None)
            except Exception as e:  # every rank raises it, so none is left waiting in the next collective
                mine = (None, e)
        sent = mine
        if mine[1] is not None and not _picklable(mine[1]):
            sent = (None, RuntimeError(f"{type(mine[1]).__name__}: {mine[1]}"))
        outs: list = [None] * world
        dist.all_gather_object(outs, sent, group=group)
    finally:
        dist.destroy_process_group(group)
    failed = next((r for r, (_, e) in enumerate(outs) if e is not None), None)
    if failed is not None:
        raise mine[1] if failed == rank else outs[failed][1]
    return outs[nodes.leader(rank)][0]
