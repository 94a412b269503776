"""Role meshes: one torch DeviceMesh per role, built once and passed to the components.

Nothing else in spmdrl derives ranks: components ask `RoleMeshes` for their mesh, their data-parallel
rank/size and their tensor-parallel rank/size.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from .layout import ROLES, RoleLayout

log = logging.getLogger("spmdrl")


@dataclass
class RoleMesh:
    layout: RoleLayout
    mesh: DeviceMesh  # dims ("dp", "tp")
    rank: int

    @property
    def active(self) -> bool:
        return self.rank in self.layout.ranks

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    def describe(self) -> str:
        c = self.layout.coords(self.rank)
        if c is None:
            return f"{self.layout.role}: -"
        return f"{self.layout.role}: dp {c[0]}/{self.layout.dp} tp {c[2]}/{self.layout.tp}"


class RoleMeshes:
    """DeviceMeshes of every role. Roles with the same ranks and degrees share one mesh (and its groups)."""

    def __init__(self, layouts: dict[str, RoleLayout], rank: int, device_type: str):
        self.rank = rank
        self.roles: dict[str, RoleMesh] = {}
        cache: dict[tuple, DeviceMesh] = {}
        for role in ROLES:
            lay = layouts[role]
            key = (lay.ranks, lay.dp, lay.tp)
            if key not in cache:
                ranks = torch.tensor(lay.ranks, dtype=torch.int64).view(lay.dp, lay.tp)
                cache[key] = DeviceMesh(device_type, ranks, mesh_dim_names=("dp", "tp"))
            self.roles[role] = RoleMesh(lay, cache[key], rank)

    def __getitem__(self, role: str) -> RoleMesh:
        return self.roles[role]

    def describe(self) -> str:
        return f"rank {self.rank}: " + " | ".join(self.roles[r].describe() for r in ROLES)
