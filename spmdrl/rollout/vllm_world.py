"""vLLM on a subset of the world (split placement): what its group creation sees while the engine is built.

Routes considered (vLLM 0.32, external_launcher):
  1. the other ranks take part in vLLM's group creation: they would have to repeat, call for call, every
     `new_group` (world, tp, dcp, pcp, pp, dp, ep, ... each for the device and a gloo group) and every
     collective vLLM runs on its world group while building (node count, memory all-reduce, message-queue
     set-up) without running vLLM. That sequence is vLLM's internals and changes between versions (0.32
     added dcp/pcp/etc groups); a mismatch hangs or silently pairs the wrong calls.
  2. (chosen) give vLLM a sub-world: the rollout ranks are the first R ranks of the world, and while the
     engine is built `torch.distributed.get_world_size()` answers R and `new_group` synchronises only the
     members of each group. It relies on two public torch behaviours (the world size query and
     `new_group(use_local_synchronization=True)`, in torch since 2.1) and on vLLM reading its world from
     torch.distributed, which external_launcher has done since it exists; no vLLM code is replaced for it (the
     engine wrapper, rollout/vllm_engine.py, replaces vLLM's engine-core finalizer and distributed teardown and
     names its CPU shared memory, for other reasons).
     On NCCL it needs the default group unbound (`spmdrl.dist.init.binds_device` is False for split
     placement): bound, torch would create each NCCL group by splitting the world communicator, which the
     other ranks never join. `spmdrl.dist.group_log` records every creation and checks this on CPU runs.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def vllm_sub_world(size: int | None) -> Iterator[None]:
    """Make vLLM's group creation see the world as its first `size` ranks (split placement), None: unchanged.

    Under external_launcher vLLM reads the world from torch.distributed (`get_world_size()`, `get_rank()`),
    lays it out ExternalDP x DP x PP x TP and creates every group with `torch.distributed.new_group(ranks)`,
    which by default is a collective over the whole default group: ranks that never build vLLM would have to
    make the same calls in the same order. While the engine is built, this process sees
      * `get_world_size()` (default group) = size, so vLLM's world and its groups span ranks 0..size-1 only;
        global rank numbers are unchanged (the rollout ranks are a prefix of the world), so the ranks vLLM
        stores in its groups and passes to torch collectives are the real ones;
      * `new_group(...)` with `use_local_synchronization=True`: only the members of a group take part in its
        creation (torch names such groups by a hash of their ranks, identical on every member).
    Nothing else of torch.distributed changes, and both are restored on exit. vLLM's optional split_group
    path (VLLM_DISTRIBUTED_USE_SPLIT_GROUP=1) is a collective over the default group: it is switched off here.
    """
    if size is None:
        yield
        return
    real_size, real_new_group = dist.get_world_size, dist.new_group

    def get_world_size(group=None):
        return size if group is None or group is dist.group.WORLD else real_size(group)

    def new_group(ranks=None, *args, **kwargs):
        if ranks is None:
            ranks = list(range(size))
        kwargs["use_local_synchronization"] = True
        return real_new_group(ranks, *args, **kwargs)

    split_env = os.environ.get("VLLM_DISTRIBUTED_USE_SPLIT_GROUP")
    os.environ["VLLM_DISTRIBUTED_USE_SPLIT_GROUP"] = "0"
    dist.get_world_size, dist.new_group = get_world_size, new_group
    try:
        yield
    finally:
        dist.get_world_size, dist.new_group = real_size, real_new_group
        if split_env is None:
            os.environ.pop("VLLM_DISTRIBUTED_USE_SPLIT_GROUP", None)
        else:
            os.environ["VLLM_DISTRIBUTED_USE_SPLIT_GROUP"] = split_env
