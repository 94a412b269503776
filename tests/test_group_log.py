"""The process-group log and NCCL's rules for creating groups and for their first use (spmdrl/dist/group_log.py).

The checkers are tested here on planted sequences, the old split placement among them, and the first-use rule
on the weight sync of every split layout of the tests and configs (the role meshes and the transport's calls,
per rank, on torch's fake process group); the logs of real runs are checked where those runs already happen:
tests/test_split.py (split and colocated) and tests/test_megatron_grpo_dist.py (Megatron TP x PP)."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from spmdrl.dist.group_log import (check_first_use, check_nccl_rules, read_group_logs, start_group_log,
                                   stop_group_log)
from spmdrl.dist.init import binds_device

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


@pytest.mark.quick
def test_split_run_is_fine_unbound_and_hangs_device_bound():
    logs = split_run()
    assert check_nccl_rules(logs, device_bound=False) == []
    # the old configuration: the default group bound to the device, as spmdrl did before for every run
    old = check_nccl_rules(logs, device_bound=True)
    assert any(v.startswith("group [0, 1] is created member-local (vllm at vllm/") for v in old), old
    assert any(v.startswith("ranks 0 and 2 differ at the creation 10 they both take part in: rank 0 creates [0, 1] "
                            "(member-local, vllm at vllm/") and "rank 2 makes no more" in v for v in old), old
    assert binds_device(split=True) is False and binds_device(split=False) is True


@pytest.mark.quick
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


@pytest.mark.quick
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


def test_gloo_groups_under_a_device_bound_default_group():
    """Device-bound, a gloo group's non-members split the world communicator with no colour and its members do
    not: a family of gloo groups that partitions the world keeps every rank's splits in step, a lone one
    does not (the next NCCL group's split then pairs with a no-colour split)."""
    def gloo(ranks):
        return dict(world_sync(ranks, caller="vllm"), backend="gloo")

    partition = {r: [world_sync(WORLD), gloo([0, 1]), gloo([2, 3]), world_sync([0, 2])] for r in WORLD}
    assert check_nccl_rules(partition, device_bound=True) == []
    lone = {r: [world_sync(WORLD), gloo([0, 1]), world_sync([0, 2])] for r in WORLD}
    out = check_nccl_rules(lone, device_bound=True)
    assert len(out) == 1 and out[0].startswith("the world communicator's split 2 does not match across ranks: rank 0 "
                                               "splits for [0, 2] (default backend, spmdrl at "), out
    assert "rank 1 splits with no colour as a non-member of [0, 2]" in out[0]
    assert "rank 2 splits with no colour as a non-member of [0, 1] (gloo backend, vllm at " in out[0]
    assert check_nccl_rules(lone, device_bound=False) == []  # unbound: gloo groups split nothing


@pytest.mark.quick
def test_split_group_takes_part_over_its_parent():
    logs = {r: [{"api": "split_group", "ranks": [r % 2, r % 2 + 2], "parent": WORLD, "splits": [[0, 2], [1, 3]],
                 "local": False, "caller": "spmdrl", "site": "x"}] for r in WORLD}
    assert check_nccl_rules(logs, device_bound=True) == []
    logs[3] = []
    assert len(check_nccl_rules(logs, device_bound=True)) == 3


@pytest.mark.quick
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


# ---- first use ------------------------------------------------------------------------------------------------
def use(name, ranks, op="batch_isend_irecv", peers=None, tags=(0,), site="spmdrl/reshard/transport.py:1"):
    row = {"use": name, "op": op, "ranks": list(ranks), "caller": "spmdrl", "site": site}
    if op == "batch_isend_irecv":
        row.update(peers=list(peers), tags=list(tags))
    return row


def test_first_use_rule_on_planted_calls():
    """A world-wide group whose first batched call skips ranks (a LoRA adapter sent by rank 2 alone; rank 3
    joining at the second bucket) breaks NCCL's first-use rule when the default group is not device-bound;
    one all-reduce of every member first makes any later subset fine."""
    first = {0: [use("w", WORLD, peers=[2])], 1: [], 2: [use("w", WORLD, peers=[0, 1])], 3: []}
    first[1] = [use("w", WORLD, peers=[2])]
    out = check_first_use(first, device_bound=False)
    assert out == ["group [0, 1, 2, 3]: ranks [3] never call a collective on it, while ranks [0, 1, 2] make their "
                   "first call on it (batch_isend_irecv with [2], spmdrl at spmdrl/reshard/transport.py:1): that call "
                   "creates the group's NCCL communicator and waits for every member"]
    assert check_first_use(first, device_bound=True) == []  # connected at creation by the world's split
    later = {0: [use("w", WORLD, peers=[2])], 1: [use("w", WORLD, peers=[3], tags=[1])],
             2: [use("w", WORLD, peers=[0])], 3: [use("w", WORLD, peers=[1], tags=[1])]}
    out = check_first_use(later, device_bound=False)
    assert len(out) == 1 and out[0].startswith("group [0, 1, 2, 3]: its members' first calls differ: ranks [0, 2] "
                                               "batch_isend_irecv with [2], spmdrl at") and "tag [1]" in out[0], out
    # untagged calls told apart by their peers alone: rank 3 joins later, with rank 1, whose first call was with 2
    untagged = {0: [use("w", WORLD, peers=[2])], 1: [use("w", WORLD, peers=[2])], 2: [use("w", WORLD, peers=[0, 1])],
                3: [use("w", WORLD, peers=[1])]}
    out = check_first_use(untagged, device_bound=False)
    assert len(out) == 1 and out[0].startswith("group [0, 1, 2, 3]: rank 3's first call (batch_isend_irecv with [1], "
                                               "spmdrl at ") and "exchanges with ranks [1]" in out[0], out
    connected = {r: [use("w", WORLD, op="all_reduce", site="spmdrl/dist/meshes.py:1")] for r in WORLD}
    assert check_first_use(connected, device_bound=False) == []
    gloo = {r: [{"api": "new_group", "ranks": WORLD, "local": False, "name": "w", "backend": "gloo"}, *first[r]]
            for r in WORLD}
    assert check_first_use(gloo, device_bound=False) == []  # gloo connects nothing lazily


def _lora(rank=32):
    from types import SimpleNamespace

    return SimpleNamespace(enable=True, rank=rank, alpha=2 * rank, target_modules=[], critic=False, dropout=0.0,
                           init="default")


# every split layout of the tests and configs: (config, overrides, world size, LoRA adapter sync)
GRPO, QUICK = "configs/grpo.toml", "configs/quickstart/grpo_split.toml"
SPLIT4 = ["placement.mode=split", "placement.rollout_ranks=[0,1,2,3]"]
LAYOUTS = {
    # configs/grpo.toml split as tests/test_plan.py, test_plan_phases.py and test_lora_sync.py plan it (Qwen2.5-7B)
    "grpo-rollout4-tp4-lora": (GRPO, SPLIT4 + ["placement.rollout_tp=4"], 8, True),
    "grpo-rollout4-tp4": (GRPO, SPLIT4 + ["placement.rollout_tp=4"], 8, False),
    # actor tp = 2: Qwen2.5-7B, rollout [0, 1] tp 2, actor [2-5] tp 2; and tests/test_dist_layout.py's 8 ranks
    "grpo-rollout2-actor-tp2": (GRPO, ["placement.mode=split", "placement.rollout_ranks=[0,1]", "placement.actor_tp=2"],
                                6, False),
    "grpo-rollout2-actor-tp2-lora": (GRPO, ["placement.mode=split", "placement.rollout_ranks=[0,1]",
                                            "placement.actor_tp=2"], 6, True),
    "grpo-rollout4-actor-tp2": (GRPO, SPLIT4 + ["placement.actor_tp=2"], 8, False),
    # the tiny model: tests/test_split.py (rollout [0, 1] tp 2 of 4), the split quickstart (with LoRA: test_lora.py)
    "tiny-rollout2-tp2": (QUICK, ["placement.rollout_ranks=[0,1]", "placement.rollout_tp=2"], 4, False),
    "tiny-quickstart": (QUICK, [], 2, False),
    "tiny-quickstart-lora": (QUICK, [], 2, True),
    "tiny-rollout1-of-4-lora": (QUICK, [], 4, True),
}


def weight_sync_first_uses(name: str, directory: str):
    """Run, for each rank of the layout in turn, what a CUDA run does to the weight group up to the end of its
    first weight sync: the role meshes (spmdrl.dist.meshes.RoleMeshes), the sync as build_weight_sync makes it
    on CUDA (bf16; LoRA: the adapter sync), and the sync's transport (reshard/transport.execute with the
    arguments WeightSync / AdapterSync pass) on the actor's shards as the plan places them, with the group log
    on. The world is torch's fake process group: one process plays each rank, every call returns at once, the
    tensors are on the meta device; what runs is spmdrl's code, in its order. Returns (logs, device_bound,
    the per-bucket calls of the sync, the world size)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from spmdrl.config import load_config
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.models.model import load_hf_config
    from spmdrl.loop.build import build_weight_sync
    from spmdrl.dist.blocks import full_block
    from spmdrl.reshard.transport import bucket_calls, execute, held_shards
    from spmdrl.tiny import build_model

    config, overrides, world, lora = LAYOUTS[name]
    cfg = load_config(os.path.join(REPO, config), overrides)
    if lora:
        cfg.lora = _lora()
    hf = build_model().config if "tiny" in name else load_hf_config(cfg.model.path)
    layouts = plan_layout(cfg.placement, world)
    bound = binds_device(split=True)
    calls = None
    for rank in range(world):
        dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            start_group_log(rank, world, device_bound=bound, directory=directory)
            meshes = RoleMeshes(layouts, rank, "cpu")
            sync = build_weight_sync(cfg, None, None, meshes, torch.device("cuda"), memory=None,
                                     actor_grid=layouts["actor"].mesh_ranks(), hf_config=hf, split=True)
            assert type(sync).__name__ == ("AdapterSync" if lora else "WeightSync")
            if lora:  # the source actor rank holds the whole adapter
                shards = {n: {full_block(s): torch.empty(s, device="meta")} for n, s in sync.params} if (
                    rank == min(layouts["actor"].ranks)) else {}
            else:
                shards = held_shards((n, torch.empty(b[1], device="meta"), b) for n, bs in sync.plan.sources.items()
                                     for r, b in bs if r == rank)
            execute(sync.plan, shards, rank, dtype=sync.dtype, comm_device=torch.device("meta"),
                    bucket_bytes=sync.bucket_bytes, deliver=lambda out: None, group=sync.group)
            calls = bucket_calls(sync.plan, sync.bucket_bytes, torch.empty((), dtype=sync.dtype).element_size())
        finally:
            stop_group_log()
            dist.destroy_process_group()
    logs, read_bound = read_group_logs(directory)
    return logs, read_bound, calls, layouts


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_weight_group_is_connected_before_its_first_bucket(name, tmp_path):
    """NCCL's first-use rule on the weight sync of every split layout: every rank of the world-wide weight group
    takes part in its first call. Split placement leaves the default group unbound, so the weight group connects
    lazily; the LoRA adapter sync sends from one actor rank, and at actor tp = 2 some replicas have nothing in
    the first (embedding) bucket, so the sync's first bucket does not involve every rank: the group must be
    connected before (dist.meshes.connected_group), or the first bucket would hang on NCCL."""
    logs, bound, calls, layouts = weight_sync_first_uses(name, str(tmp_path))
    world = len(logs)
    assert bound is False
    absent = sorted(set(range(world)) - set(calls[0]))  # the ranks with nothing to move in the first bucket
    actor = sorted(layouts["actor"].ranks)
    if LAYOUTS[name][3]:  # LoRA: the first actor rank sends the whole adapter, the other actor ranks send nothing
        assert absent == actor[1:], calls[0]
    elif name == "grpo-rollout2-actor-tp2":  # FSDP2 dp 2 x tp 2: two replicas hold nothing of the first bucket
        assert absent == [3, 4], calls[0]
    else:
        assert absent == [], calls[0]
    assert check_first_use(logs, bound) == []
    assert check_nccl_rules(logs, bound) == []
    # every rank's first call on the batch and the weight group (both world-wide) is the connection at creation
    connections = [(r, row["op"], row["site"].split(":")[0]) for r in range(world) for row in logs[r]
                   if "use" in row and row["ranks"] == list(range(world))
                   and (row["site"] or "").startswith("spmdrl/dist/meshes")]
    assert connections == [(r, "all_reduce", "spmdrl/dist/meshes.py") for r in range(world) for _ in range(2)]
