"""The smallest GPU count a config fits on (`spmdrl plan --min-gpus`): world sizes from one GPU up, and on each a
few layouts (the config's own, then larger tensor-parallel degrees, each without and with offloading the
training state to host memory between phases), every one planned in full by `build_plan`; the first that
fits wins. Larger worlds are whole nodes of memory.gpus_per_node.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterator

from spmdrl.config.derived import FULL_OFFLOAD
from spmdrl.errors import ConfigError
from spmdrl.plan.estimate import format_change


def world_sizes(gpus_per_node: int, max_gpus: int) -> list[int]:
    """1, 2, 4, ... up to a node, then whole nodes doubling: the GPU counts a cluster is rented in."""
    sizes, w = [], 1
    while w < gpus_per_node and w <= max_gpus:
        sizes.append(w)
        w *= 2
    nodes = 1
    while nodes * gpus_per_node <= max_gpus:
        sizes.append(nodes * gpus_per_node)
        nodes *= 2
    return sizes


def layouts(cfg, world: int) -> Iterator[dict]:
    """Candidate changes for `world` ranks, least change first: the config's tp and pp, then larger model-parallel
    sizes tp x pp (tp 1, 2, 4, 8 within a node for every role; pp 2, 4, 8 for the training roles when they run on
    Megatron, the only backend with pipeline stages), tp before pp at the same size; each as configured, then with
    the training state offloaded."""
    from spmdrl.dist.layout import role_backends

    p = cfg.placement
    node = min(world, cfg.memory.gpus_per_node)
    own_tp, own_pp = max(p.actor_tp, p.rollout_tp), p.actor_pp
    tps = [own_tp] + [t for t in (1, 2, 4, 8) if t > own_tp and t <= node]
    megatron = "megatron" in role_backends(cfg).values()
    pps = [own_pp] + ([q for q in (2, 4, 8) if q > own_pp] if megatron else [])
    shapes = sorted(((t, q) for t in tps for q in pps if t * q <= world or (t, q) == (own_tp, own_pp)),
                    key=lambda tq: ((tq != (own_tp, own_pp)), tq[0] * tq[1], tq[1]))
    offloads = [{}]
    if any(set(getattr(cfg.memory, k.split(".")[1])) != set(v) for k, v in FULL_OFFLOAD.items()):
        offloads.append(FULL_OFFLOAD)
    for offload in offloads:
        for tp, pp in shapes:
            change = {} if tp == own_tp else {f"placement.{r}_tp": tp for r in ("actor", "ref", "critic", "rollout")}
            if pp != own_pp:
                change.update({f"placement.{r}_pp": pp for r in ("actor", "ref", "critic")})
            yield {**change, **offload}


def apply(cfg, world: int, change: dict):
    """A copy of cfg with `change` ({"section.key": value}) and the hardware of `world` GPUs."""
    c = copy.deepcopy(cfg)
    for key, value in change.items():
        sec, name = key.split(".")
        setattr(getattr(c, sec), name, value)
    g = c.memory.gpus_per_node
    c.memory.gpus_per_node, c.memory.nodes = min(g, world), -(-world // g)
    return c


def min_gpus(cfg, max_gpus: int = 1024, note: Callable[[str], None] = lambda s: None):
    """(world, change, plan) of the first candidate that fits, or None. note() hears each candidate: planned
    ("... : fits" / ": no") or skipped, with the reason the config check gave (a layout that does not divide the
    batch, the heads or the world)."""
    from spmdrl.config import validate
    from spmdrl.plan.estimate import build_plan

    for world in world_sizes(cfg.memory.gpus_per_node, max_gpus):
        for change in layouts(cfg, world):
            c = apply(cfg, world, change)
            what = f"{world} GPU(s) {format_change(change) or '(as configured)'}"
            try:
                validate(c, world, trackers=False)
            except ConfigError as e:
                note(f"{what}: skipped, {' '.join(str(e).split())}")
                continue
            plan = build_plan(c, world)
            note(f"{what}: {'fits' if plan['fits'] else 'no'}")
            if plan["fits"]:
                return world, change, plan
    return None
