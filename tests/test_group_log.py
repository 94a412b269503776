"""The process-group creation log and NCCL's creation rules (spmdrl/dist/group_log.py).

The checker is tested here on planted sequences, the old split placement among them; the logs of real runs
are checked where those runs already happen: tests/test_split.py (split and colocated) and
tests/test_megatron_grpo_dist.py (Megatron TP x PP)."""
import datetime

import pytest
import torch.distributed as dist

from spmdrl.dist.group_log import check_nccl_rules, read_group_logs, start_group_log, stop_group_log
from spmdrl.dist.init import binds_device

WORLD = [0, 1, 2, 3]


def world_sync(ranks, caller="spmdrl", name=None):
    return {"api": "new_group", "ranks": list(ranks), "local": False, "name": name, "caller": caller,
            "site": "spmdrl/dist/meshes.py:1"}


def member_local(ranks, name, caller="vllm"):
    return {"api": "new_group", "ranks": list(ranks), "local": True, "name": name, "caller": caller,
            "site": "vllm/distributed/parallel_state.py:1"}


def split_run() -> dict[int, list[dict]]:
    """What split placement with rollout ranks 0-1 (vLLM TP=2) makes: the role meshes and the transfer groups
    on every rank, then vLLM's groups (a device and a gloo group each) on the rollout ranks alone."""
    common = [world_sync([0, 1]), world_sync([0]), world_sync([1]), world_sync([2, 3]), world_sync([2]),
              world_sync([3]), world_sync(WORLD), world_sync(WORLD), world_sync([2, 3])]
    logs = {r: [dict(g) for g in common] for r in WORLD}
    for r in (0, 1):  # every vLLM rank calls new_group for every group; a non-member's call returns at once
        logs[r] += [member_local([0, 1], "w0"), member_local([0, 1], "w1"), member_local([0], "dp0"),
                    member_local([1], "dp1"), member_local([0, 1], "tp0"), member_local([0, 1], "tp1")]
    return logs


def test_split_run_is_fine_unbound_and_hangs_device_bound():
    logs = split_run()
    assert check_nccl_rules(logs, device_bound=False) == []
    # the old configuration: the default group bound to the device, as spmdrl did before for every run
    old = check_nccl_rules(logs, device_bound=True)
    assert any(v.startswith("group [0, 1] is created member-local (vllm at vllm/") for v in old), old
    assert any(v.startswith("ranks 0 and 2 differ at the creation 10 they both take part in: rank 0 creates [0, 1] "
                            "(member-local, vllm at vllm/") and "rank 2 makes no more" in v for v in old), old
    assert binds_device(split=True) is False and binds_device(split=False) is True


def test_colocated_run_is_fine_either_way():
    logs = {r: [world_sync(g) for g in ([0, 1], [2, 3], WORLD, [0, 2], [1, 3])] for r in WORLD}
    assert check_nccl_rules(logs, device_bound=True) == []
    assert check_nccl_rules(logs, device_bound=False) == []


def test_world_synchronised_creation_on_some_ranks_only():
    """e.g. a DeviceMesh flattened on the training ranks only: the counter that names world-synchronised groups
    moves on ranks 2-3 alone, so a later group of all ranks would get different names."""
    logs = split_run()
    for r in (2, 3):
        logs[r].insert(9, world_sync([2, 3], caller="other"))
    out = check_nccl_rules(logs, device_bound=False)
    assert len(out) == 4 and all("world-synchronised" in v for v in out), out  # pairs (0|1, 2|3)
    assert out[0].startswith("ranks 0 and 2 differ at the creation 10 they both take part in: rank 0 makes no more, "
                             "rank 2 creates [2, 3] (world-synchronised, other at ")


def test_member_local_creations_in_another_order_or_name():
    logs = split_run()
    logs[1][-1]["name"] = "other"
    out = check_nccl_rules(logs, device_bound=False)
    assert out == ["group [0, 1] has the name tp1 on rank 0 and other on rank 1: its NCCL communicator would be "
                   "looked up under different store keys"]
    # a group of ranks 0-2, created after vLLM's groups on ranks 0 and 2 but before its tp groups on rank 1
    logs = split_run()
    for r in (0, 2):
        logs[r].append(member_local([0, 1, 2], "x"))
    logs[1].insert(-2, member_local([0, 1, 2], "x"))
    out = check_nccl_rules(logs, device_bound=False)
    assert [v.split(" they")[0] for v in out] == ["ranks 0 and 1 differ at the creation 12"], out
    assert "rank 0 creates [0, 1] (member-local" in out[0] and "rank 1 creates [0, 1, 2] (member-local" in out[0]


def test_split_group_takes_part_over_its_parent():
    logs = {r: [{"api": "split_group", "ranks": [r % 2, r % 2 + 2], "parent": WORLD, "splits": [[0, 2], [1, 3]],
                 "local": False, "caller": "spmdrl", "site": "x"}] for r in WORLD}
    assert check_nccl_rules(logs, device_bound=True) == []
    logs[3] = []
    assert len(check_nccl_rules(logs, device_bound=True)) == 3


def test_recording_in_a_real_process_group(tmp_path):
    """One gloo process: new_group, world-synchronised and member-local, is recorded with its ranks, mode,
    name and caller, and torch's functions are given back after. (DeviceMesh, megatron-core and vLLM
    creations are recorded in the multi-process runs named in the module docstring.)"""
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    original = c10d._new_group_with_tag
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    logs_dir = tmp_path / "groups"
    try:
        start_group_log(0, 1, device_bound=binds_device(split=False), directory=str(logs_dir))
        g = dist.new_group([0])
        dist.new_group(use_local_synchronization=True)
        stop_group_log()
        assert c10d._new_group_with_tag is original
        dist.new_group([0])  # not recorded
    finally:
        stop_group_log()
        dist.destroy_process_group()
    logs, bound = read_group_logs(str(logs_dir))
    assert bound is True
    rows = logs[0]
    assert [(r["seq"], r["ranks"], r["local"], r["member"]) for r in rows] == [(0, [0], False, True), (1, [0], True, True)]
    assert rows[0]["name"] == g.group_name and rows[0]["caller"] == "other" and "via" not in rows[0]
    assert rows[0]["site"].startswith("test_group_log.py:") and rows[1]["name"] != rows[0]["name"]
    assert check_nccl_rules(logs, bound) == []
