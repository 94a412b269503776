"""Weight sync, actor -> rollout, as a planned resharding.

The plan (reshard/plan.py) is computed once from the actor engine's source blocks and the rollout layout;
each sync executes it (reshard/transport.py): every rollout rank receives exactly the bytes of its vLLM shard
it does not already hold, in the rollout dtype, one batched p2p exchange per bucket.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from spmdrl.dist.collectives import comm_device, reduce_max
from spmdrl.dist.meshes import RoleMesh
from spmdrl.errors import LayoutError

from spmdrl.dist.blocks import fsdp_blocks
from .plan import SyncPlan, plan_sync
from .transport import Shards, execute, held_shards
from .verify import verify_sync
from .vllm_reads import rollout_targets, route_summary

logger = logging.getLogger(__name__)


def log_routes(params, reads, elem_bytes: int) -> None:
    """One startup line for the sync's routes, and one per parameter family that goes whole (with why)."""
    fams = route_summary(params, reads, elem_bytes)
    whole = [f for f in fams if f["route"] == "whole"]
    logger.info("weight sync into vLLM: %d parameter families on the planned route (the blocks vLLM's loaders read "
                "at TP = %d), %d whole", len(fams) - len(whole), reads.tp, len(whole))
    for f in whole:
        logger.warning("weight sync: %s (%d tensors, %.1f MiB per rollout rank) goes whole: %s", f["family"],
                       f["tensors"], f["bytes_per_rank"] / 2**20, f["why"])


def check_shards(plan: SyncPlan, shards: Shards, rank: int) -> None:
    """What the engine's weight_shards yields on this rank is exactly what the plan's sources say it holds, block
    for block (the plan decides who sends which slice; a disagreement would send wrong bytes silently)."""
    mine = {name: {b for r, b in bs if r == rank} for name, bs in plan.sources.items()}
    for name, want in mine.items():
        got = shards.get(name, {})
        shapes = {b: tuple(t.shape) for b, t in got.items()}
        if want and (set(got) != want or any(s != b[1] for b, s in shapes.items())):
            raise RuntimeError(f"weight sync: rank {rank} holds {name} as {sorted(got) or None} (shapes "
                               f"{list(shapes.values()) or None}), the plan expects {sorted(want)}")
    extra = sorted(set(shards) - {n for n, w in mine.items() if w})
    if extra:
        raise RuntimeError(f"weight sync: rank {rank} yields {extra[:3]} that the plan does not list as its sources")


def split_backend_refusal(key: str, backend: str) -> str:
    """Why split placement cannot take a role on `backend` ("" for FSDP2): the weight transfer is planned from the
    FSDP2 layout. key: the config key that chose the backend. Config validation raises it before launch, the
    weight sync (here) when the engine's layout is not the planned one."""
    if backend == "fsdp":
        return ""
    return (f"placement.mode = 'split' plans the weight transfer from the FSDP2 layout; {key} = {backend!r} needs "
            "placement.mode = 'colocate' for now")


class WeightSync:
    """Planned once, run after every actor update (and after a resume).

    Every rank runs the whole exchange and waits for it, bucket by bucket. Split placement (`split=True`):
    the exchange runs on the sync's own process group, the actor ranks send and the rollout ranks receive and
    load, and no world collective follows (the step's meeting point reduces the figures).
    A rank without the actor engine (a rollout rank in split placement) plans from the arithmetic:
    `fsdp_blocks` of the actor layout over the parameter shapes of `hf_config`; the actor ranks check that the
    engine holds exactly those blocks, so both sides execute the same plan.
    `verify=True` (rollout.verify_sync, debug) checks after every sync that each rollout rank's engine holds the
    actor's weights (reshard/verify.py); every rank of the sync takes part.
    `frozen(name)`: the parameters that never change (a frozen vision tower). The first sync sends them with the
    rest (the rollout engine may hold other weights: a dummy load, a resumed actor); every later sync executes the
    plan without them (`self.steady`), and its lower bound is that plan's, since the rollout already holds them.
    The rollout engine's update_weights must take a subset of the weights (the transformers engine does).
    """

    def __init__(self, actor, rollout, rollout_mesh: RoleMesh, *, dtype: torch.dtype, bucket_mb: int, memory=None,
                 split: bool = False, actor_grid=None, hf_config=None, rollout_shards: bool | None = None, group=None,
                 verify: bool = False, frozen=None):
        self.actor, self.rollout, self.dtype, self.memory, self.verify = actor, rollout, dtype, memory, verify
        self.split, self.group = split, group
        self.bucket_bytes = bucket_mb << 20
        if rollout_shards is None:
            rollout_shards = getattr(rollout, "loads_tp_shards", False)
        hf_config = self.hf_config = actor.hf_config() if actor is not None else hf_config
        if actor is not None and not split:
            params, sources = actor.param_shapes(), actor.source_blocks()
        else:
            from spmdrl.models.model import model_param_shapes

            params = model_param_shapes(hf_config)
            sources = fsdp_blocks(params, actor_grid)
            if actor is not None and (actor.param_shapes() != params or actor.source_blocks() != sources):
                raise LayoutError("the actor engine's weight layout is not the FSDP2 layout the rollout ranks plan "
                                  f"for: {split_backend_refusal('trainer.backend', type(actor).__name__)}")
        targets, reads = rollout_targets(params, rollout_mesh.tp_groups(), hf_config, rollout_shards,
                                         dtype=str(dtype).removeprefix("torch."),
                                         expert_parallel=getattr(rollout, "expert_parallel", False))
        elem = torch.empty((), dtype=dtype).element_size()
        self.plan: SyncPlan = plan_sync(params, sources, targets, elem)
        self.plan.reads = reads
        self.lower_bound = max(self.plan.lower_bound().values(), default=0)
        fixed = {n for n, _ in params if frozen is not None and frozen(n)}
        if fixed:
            moving = [(n, s) for n, s in params if n not in fixed]
            self.steady: SyncPlan = plan_sync(moving, {n: sources[n] for n, _ in moving},
                                              {n: targets[n] for n, _ in moving}, elem)
            self.steady.reads = reads
        else:
            self.steady = self.plan
        self.frozen_sent = False  # whether a sync has delivered the frozen parameters (then only self.steady runs)
        if reads is not None and dist.get_rank() == 0:
            log_routes(params, reads, elem)
        self.checked = False

    def check_engine(self, shards=None) -> None:
        """Raise SyncMismatch (naming the tensor) unless every rollout rank's engine holds exactly the actor's weights
        as its own loaders load them whole (reshard/verify.py; rollout.verify_sync runs it after every sync, the
        parity check when the rollout disagrees with the actor)."""
        if shards is None:
            shards = held_shards(self.actor.weight_shards()) if self.actor is not None else {}
        verify_sync(self.plan, shards, self.rollout, dtype=self.dtype, device=comm_device(self.group),
                    bucket_bytes=self.bucket_bytes, group=self.group, agree=not self.split)

    def __call__(self) -> dict[str, float]:
        if self.memory is not None:
            self.memory.for_sync()  # training state out, empty_cache, vLLM weights (not KV) awake: spmdrl/loop/memory.py
        elif self.rollout is not None:
            self.rollout.wake_up()
        shards = held_shards(self.actor.weight_shards()) if self.actor is not None else {}
        if not self.checked:
            check_shards(self.plan, shards, dist.get_rank())
            self.checked = True
        deliver = self.rollout.update_weights if self.rollout is not None else None
        device = comm_device(self.group)
        plan = self.steady if self.frozen_sent else self.plan
        self.lower_bound = max(plan.lower_bound().values(), default=0)
        stats = execute(
            plan, shards, dist.get_rank(), dtype=self.dtype, comm_device=device,
            bucket_bytes=self.bucket_bytes, deliver=deliver, group=self.group,
            fill=float("nan") if self.verify else None,
        )
        if self.rollout is not None:
            self.rollout.finish_weight_update()  # vLLM: finalize the layerwise reload (repack CPU weights, reset prefix cache)
        self.frozen_sent = True
        if self.verify:
            self.check_engine(shards)
        if self.split:  # no world collective here: the roles are at different points; the step reduces these
            return {"weight_sync/bytes_recv": float(stats.bytes_recv), "weight_sync/bytes_sent": float(stats.bytes_sent),
                    "weight_sync/collectives": float(stats.collectives), "weight_sync/tensors": float(len(plan.params)),
                    "timing/weight_sync_transport_s": stats.seconds}
        recv_max, collectives = reduce_max(torch.tensor([stats.bytes_recv, stats.collectives], dtype=torch.float64))
        return {
            "weight_sync/bytes_recv_max": recv_max,
            "weight_sync/bytes_lower_bound": float(self.lower_bound),
            "weight_sync/collectives": collectives,
            "weight_sync/buckets": float(stats.buckets),
            "weight_sync/tensors": float(len(plan.params)),
            "timing/weight_sync_transport_s": stats.seconds,
        }
