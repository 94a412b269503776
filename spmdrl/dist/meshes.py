"""Role meshes: one (dp, pp, sp, tp) torch DeviceMesh per role, built once and passed to the components.

This is the one place that turns ranks into coordinates, groups, offsets and shares. Components ask their
`RoleMesh` (`mesh.group("tp")`, `mesh.dp_rank`, `mesh.dp_share(n)`, `mesh.tp_groups()`, ...) and never
compute ranks themselves (tests/test_repo.py greps for it).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from spmdrl.errors import LayoutError

import torch.distributed as dist

from .layout import ROLES, RoleLayout, is_split

log = logging.getLogger("spmdrl")

DIMS = ("dp", "pp", "sp", "tp")


@dataclass
class RoleMesh:
    layout: RoleLayout
    mesh: DeviceMesh  # dims ("dp", "pp", "sp", "tp")
    rank: int

    # ---- where this rank is ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether this rank holds the role."""
        return self.rank in self.layout.ranks

    def coords(self) -> tuple[int, int, int]:
        c = self.layout.coords(self.rank)
        if c is None:
            raise LayoutError(f"rank {self.rank} is not in the {self.layout.role} role (ranks {list(self.layout.ranks)})")
        return c

    @property
    def dp_rank(self) -> int:
        return self.coords()[0]

    @property
    def pp_rank(self) -> int:
        return self.coords()[1]

    @property
    def tp_rank(self) -> int:
        return self.coords()[2]

    @property
    def sp_rank(self) -> int:
        c = self.layout.coords4(self.rank)
        if c is None:
            raise LayoutError(f"rank {self.rank} is not in the {self.layout.role} role (ranks {list(self.layout.ranks)})")
        return c[2]

    @property
    def sp_size(self) -> int:
        return self.layout.sp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def is_tp_leader(self) -> bool:
        """Rank 0 of its tp group and of its sp group: the one that counts a sample the tp and sp ranks of a
        replica hold in copies."""
        return self.tp_rank == 0 and self.sp_rank == 0

    def leader_weight(self) -> float:
        """1.0 on tp (and sp) leaders, else 0.0: weights a mean over ranks so tp and sp copies count once."""
        return 1.0 if self.is_tp_leader else 0.0

    # ---- groups -----------------------------------------------------------------------------------------
    def group(self, dim: str):
        """The process group of this rank along one mesh dimension ("dp", "pp", "sp" or "tp")."""
        return self.mesh.get_group(dim)

    def submesh(self, dim: str) -> DeviceMesh:
        return self.mesh[dim]

    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh FSDP2 shards over: "dp", or with sequence parallelism "dp" and "sp" flattened (dp-major),
        so the sp ranks of a replica hold different shards (the rows of layout.mesh_ranks())."""
        if self.sp_size == 1:
            return self.mesh["dp"]
        return self.mesh["dp", "sp"]._flatten("dp_sp")

    def sp_range(self, n: int) -> range:
        """This sp rank's contiguous part of n token positions (n a multiple of sp: see sp_padded)."""
        per = n // self.sp_size
        return range(self.sp_rank * per, (self.sp_rank + 1) * per)

    def sp_padded(self, n: int) -> int:
        """n token positions rounded up to a multiple of sp (each sp rank then holds the same count)."""
        return -(-n // self.sp_size) * self.sp_size

    def tp_groups(self) -> list[list[int]]:
        """Every tp group of the role as global ranks in tp order, dp-major then pp."""
        return [tp for pp in self.layout.mesh_ranks() for tp in pp]

    def my_tp_group(self) -> list[int]:
        d, p, s, _ = self.layout.coords4(self.rank)
        return self.layout.grid4()[d][p][s]

    def grid(self) -> list[list[list[int]]]:
        """Ranks as [dp * sp][pp][tp] (layout.mesh_ranks: one row per FSDP2 shard index)."""
        return self.layout.mesh_ranks()

    # ---- sharing work --------------------------------------------------------------------------------------
    def dp_share(self, n: int, what: str = "items") -> int:
        """n / dp, the part of n this dp rank handles; n must divide evenly."""
        if n % self.dp_size:
            raise LayoutError(f"{n} {what} cannot be split evenly over the {self.dp_size} {self.layout.role} dp ranks")
        return n // self.dp_size

    def dp_offset(self, per_rank: int) -> int:
        """Global position of this dp rank's first item when every dp rank holds per_rank items."""
        return self.dp_rank * per_rank

    def dp_range(self, n: int) -> range:
        """This dp rank's contiguous part of n items split like torch.chunk (the last parts shorter)."""
        per = -(-n // self.dp_size)
        return range(min(n, self.dp_rank * per), min(n, (self.dp_rank + 1) * per))

    def dp_ceil(self, n: int) -> int:
        """ceil(n / dp): the largest dp rank's part of n items split like torch.chunk."""
        return -(-n // self.dp_size)

    def tp_range(self, n: int) -> range:
        """This tp rank's contiguous part of n items a tp group holds in copies (to do work once per group)."""
        per = -(-n // self.tp_size)
        return range(min(n, self.tp_rank * per), min(n, (self.tp_rank + 1) * per))

    def tp_ranges(self, n: int) -> list[range]:
        """Every tp rank's tp_range(n), in tp order."""
        per = -(-n // self.tp_size)
        return [range(min(n, t * per), min(n, (t + 1) * per)) for t in range(self.tp_size)]

    def describe(self) -> str:
        c = self.layout.coords(self.rank)
        if c is None:
            return f"{self.layout.role}: -"
        pp = f" pp {c[1]}/{self.layout.pp}" if self.layout.pp > 1 else ""
        sp = f" sp {self.sp_rank}/{self.layout.sp}" if self.layout.sp > 1 else ""
        return f"{self.layout.role}: dp {c[0]}/{self.layout.dp}{pp}{sp} tp {c[2]}/{self.layout.tp}"


def connected_group(ranks: list[int] | None = None):
    """`dist.new_group(ranks)` (a creation every rank makes), connected by all its members before anyone uses it:
    one all-reduce of one element over the group, on its members, right after the creation.

    Split placement leaves the default group unbound to a device (`dist.init.binds_device`), so an NCCL group
    has no communicator until its first collective or batched point-to-point call, which creates it over the
    group's members and must be made by all of them (`batch_isend_irecv`'s docstring, torch 2.13). The weight
    sync's first bucket does not involve every rank of its world-wide group (a LoRA adapter has one sending
    actor rank; at actor tp >= 2 some replicas send nothing in the first bucket), so the group is connected
    here, where every rank is anyway. Connecting eagerly through `new_group(device_id=...)` would do the same
    on NCCL only; the all-reduce runs the same way on gloo, so CPU runs make it too and the group log
    (`dist.group_log.check_first_use`) sees it as every member's first call."""
    group = dist.new_group(ranks)
    if group is not dist.GroupMember.NON_GROUP_MEMBER:
        nccl = dist.get_backend(group) == "nccl"
        dist.all_reduce(torch.zeros(1, device=torch.cuda.current_device() if nccl else "cpu"), group=group)
    return group


class RoleMeshes:
    """DeviceMeshes of every role. Roles with the same ranks and degrees share one mesh (and its groups)."""

    def __init__(self, layouts: dict[str, RoleLayout], rank: int, device_type: str):
        self.rank = rank
        self.roles: dict[str, RoleMesh] = {}
        cache: dict[tuple, DeviceMesh] = {}
        for role in ROLES:
            lay = layouts[role]
            key = (lay.ranks, lay.dp, lay.pp, lay.sp, lay.tp, lay.pp_outer)
            if key not in cache:
                ranks = torch.tensor(lay.grid4(), dtype=torch.int64)  # [dp][pp][sp][tp]
                cache[key] = DeviceMesh(device_type, ranks, mesh_dim_names=DIMS)
            self.roles[role] = RoleMesh(lay, cache[key], rank)
        # split placement: batches (rollout -> training) and weights (training -> rollout) move point to point on
        # groups of their own, so neither waits behind the other or behind a collective of one role
        self.split = is_split(layouts)
        self.batch_group = connected_group() if self.split else None
        self.weight_group = connected_group() if self.split else None
        # what the training ranks agree on among themselves (the world when colocated)
        self.train_group = connected_group(list(layouts["actor"].ranks)) if self.split else None

    def __getitem__(self, role: str) -> RoleMesh:
        return self.roles[role]

    def describe(self) -> str:
        return f"rank {self.rank}: " + " | ".join(self.roles[r].describe() for r in ROLES)
