"""LoRA weight sync, actor -> rollout: the adapter alone ("adapter"), or merged into the base ("merge").

adapter: after each update the actor gathers its adapter (`actor.adapter_tensors`, PEFT names, full tensors in
the rollout dtype) and every rollout rank loads the whole adapter as a new version (`rollout.load_adapter`):
vLLM's LoRA loader reads full PEFT tensors and keeps its TP slice, so a rollout rank needs every adapter byte and
none of the base. Split placement: the actor ranks gather, the first actor rank sends the whole adapter to every
rollout rank over the sync's group (a planned exchange, reshard/plan.py, from one source), bucket by bucket: a
rollout rank receives exactly the adapter's bytes in the rollout dtype, which is also the lower bound (it holds
none of it). Colocated placement: each rollout rank is an actor rank holding its FSDP2 shard of the adapter, and
the actor's gather inside adapter_tensors is what brings it the rest: the figures are that gather's as the plan
gives it (the adapter's bytes minus the rank's own shard, in the rollout dtype), not a count of the sync's own.

merge: the actor's base shards plus scale * B @ A (the slice of it each shard covers) go through the planned
full-weight resharding (reshard/sync.py WeightSync), for models or kernels vLLM's LoRA layers do not cover; the
rollout engine is built without LoRA and moves the full model's bytes per sync.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from spmdrl.dist.collectives import comm_device, reduce_max
from spmdrl.errors import ConfigError, LayoutError

from spmdrl.dist.blocks import fsdp_blocks, full_block
from .plan import plan_sync
from .transport import execute

PEFT_PREFIX = "base_model.model."
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTN + MLP


def target_list(target_modules) -> tuple[str, ...]:
    """The linear modules an adapter covers, in the model's order (lora.target_modules: empty, or "all-linear",
    means every linear layer of the decoder blocks)."""
    if target_modules in ("all-linear", ["all-linear"], [], ()):
        return ALL_LINEAR
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    bad = sorted(set(names) - set(ALL_LINEAR))
    if bad:
        raise ConfigError(f"lora.target_modules={names}: the rollout sync covers {list(ALL_LINEAR)} "
                          "(or an empty list: all of them); remove " + ", ".join(bad))
    return tuple(m for m in ALL_LINEAR if m in names)


def adapter_params(hf_config, rank: int, target_modules) -> list[tuple[str, tuple[int, ...]]]:
    """PEFT names and shapes of a LoRA adapter's tensors, in PEFT's order (layer, module, A then B):
    lora_A is (rank, in_features), lora_B is (out_features, rank). The engine's own shapes
    (models.lora.adapter_shapes over the model's parameters) under the names PEFT's files use."""
    from spmdrl.models.model import model_param_shapes
    from spmdrl.models.lora import adapter_shapes, peft_name

    shapes = adapter_shapes(model_param_shapes(hf_config), rank, list(target_list(target_modules)))
    return [(peft_name(n), s) for n, s in shapes]


def adapter_bytes(hf_config, rank: int, target_modules, elem_bytes: int) -> int:
    return sum(a * b for _, (a, b) in adapter_params(hf_config, rank, target_modules)) * elem_bytes


def base_name(peft_name: str) -> str:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> 'model.layers.0.self_attn.q_proj.weight'."""
    stem = peft_name[len(PEFT_PREFIX):] if peft_name.startswith(PEFT_PREFIX) else peft_name
    for part in (".lora_A.weight", ".lora_B.weight"):
        if stem.endswith(part):
            return stem[: -len(part)] + ".weight"
    raise ValueError(f"{peft_name} is not a LoRA A/B tensor name")


SERVED_KEYS = ("r", "lora_alpha", "use_rslora", "use_dora", "target_modules")  # what vLLM reads from the config


def peft_adapter_config(lora) -> dict:
    """adapter_config.json for the configured LoRA settings (rank, alpha, target_modules[, dropout, use_rslora]):
    what the rollout ranks of a split run hand vLLM, having no actor to ask."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora.rank), "lora_alpha": lora.alpha,
            "lora_dropout": float(getattr(lora, "dropout", 0.0)), "target_modules": list(target_list(lora.target_modules)),
            "use_rslora": bool(getattr(lora, "use_rslora", False)), "use_dora": False, "bias": "none",
            "modules_to_save": None, "fan_in_fan_out": False, "init_lora_weights": True}


def check_served_config(actor_config: dict, planned: dict) -> None:
    """The actor's adapter_config agrees with the configured one on everything vLLM reads."""
    def norm(c):
        return {k: sorted(target_list(c[k])) if k == "target_modules" else c.get(k, False) for k in SERVED_KEYS}

    a, p = norm(actor_config), norm(planned)
    if a != p:
        diff = {k: (a[k], p[k]) for k in SERVED_KEYS if a[k] != p[k]}
        raise LayoutError(f"the actor's adapter_config differs from [lora] on {diff} (actor, config)")


def lora_scale(adapter_config: dict) -> float:
    """The factor PEFT multiplies B @ A by: lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)."""
    r, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    return alpha / r ** 0.5 if adapter_config.get("use_rslora") else alpha / r


def merged_shards(shards, adapter: dict[str, torch.Tensor], scale: float):
    """Yield (name, tensor, block) like weight_shards, with scale * B @ A added to the block of each base weight
    the adapter covers (computed in fp32, cast back to the shard's dtype)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in adapter.items():
        pairs.setdefault(base_name(name), {})["A" if ".lora_A." in name else "B"] = t
    for name, t, block in shards:
        ab = pairs.get(name)
        if ab is not None:
            (r0, c0), (rows, cols) = block
            a = ab["A"].to(t.device, torch.float32)[:, c0: c0 + cols]
            b = ab["B"].to(t.device, torch.float32)[r0: r0 + rows]
            t = (t.to(torch.float32) + scale * (b @ a)).to(t.dtype)
        yield name, t, block


class MergedActor:
    """The actor engine as the full-weight sync sees it in merge mode: its base weights with the adapter merged
    in. Everything but weight_shards is the engine's own."""

    def __init__(self, actor):
        self.engine = actor

    def hf_config(self):
        return self.engine.hf_config()

    def param_shapes(self):
        return self.engine.param_shapes()

    def source_blocks(self):
        return self.engine.source_blocks()

    def weight_shards(self):
        adapter = dict(self.engine.adapter_tensors(dtype=torch.float32))  # collective over the actor mesh
        return merged_shards(self.engine.weight_shards(), adapter, lora_scale(self.engine.adapter_config()))


def adapter_plan(params, elem_bytes: int, rollout_ranks, source: int):
    """Split placement: the whole adapter from the source actor rank to every rollout rank (reshard/plan.py)."""
    if source in set(rollout_ranks):
        raise LayoutError(f"adapter sync: the source rank {source} is also a rollout rank in split placement")
    return plan_sync(params, {n: [(source, full_block(s))] for n, s in params},
                     {n: [(r, full_block(s)) for r in rollout_ranks] for n, s in params}, elem_bytes)


class AdapterSync:
    """Planned once, run after every actor update: the rollout engine serves the actor's newest adapter.

    actor: the training engine on actor ranks (None on a rollout-only rank); rollout: the rollout engine on
    rollout ranks (None elsewhere). params: the adapter's PEFT names and shapes (`adapter_params`); config: its
    adapter_config.json content. split: the rollout ranks are not actor ranks; `source` is the actor rank that
    sends, `rollout_ranks` the receivers, `group` the sync's process group.
    """

    def __init__(self, actor, rollout, *, params, config: dict, dtype: torch.dtype, bucket_mb: int, rollout_ranks,
                 split: bool = False, source: int = 0, group=None, memory=None, actor_grid=None):
        self.actor, self.rollout, self.params, self.config = actor, rollout, list(params), dict(config)
        self.dtype, self.split, self.group, self.memory = dtype, split, group, memory
        self.bucket_bytes = bucket_mb << 20
        elem = torch.empty((), dtype=dtype).element_size()
        self.adapter_bytes = sum(torch.Size(s).numel() for _, s in self.params) * elem
        if split:  # every rollout rank loads the whole adapter and holds none of it
            self.plan = adapter_plan(self.params, elem, rollout_ranks, source)
        else:  # the actor's gather: each rank has its FSDP2 shard (actor_grid [dp][pp][tp]) and needs the rest
            self.plan = plan_sync(self.params, fsdp_blocks(self.params, actor_grid),
                                  {n: [(r, full_block(s)) for r in rollout_ranks] for n, s in self.params}, elem)
        self.lower_bound = max(self.plan.lower_bound().values(), default=0)
        self.checked = False

    def _check(self, tensors: dict[str, torch.Tensor]) -> None:
        got = [(n, tuple(t.shape)) for n, t in tensors.items()]
        if sorted(got) != sorted(self.params):
            missing = sorted(set(self.params) - set(got))[:3]
            extra = sorted(set(got) - set(self.params))[:3]
            raise LayoutError(f"adapter sync: the actor's adapter differs from the planned one (missing {missing}, "
                              f"unexpected {extra}): [lora] and the actor's adapter must agree")

    def __call__(self) -> dict[str, float]:
        if self.memory is not None:
            self.memory.for_sync()
        elif self.rollout is not None:
            self.rollout.wake_up()
        tensors = dict(self.actor.adapter_tensors(dtype=self.dtype)) if self.actor is not None else {}
        if tensors and not self.checked:
            self._check(tensors)
            self.checked = True
        if not self.split:
            t0 = time.perf_counter()
            self.rollout.load_adapter([(n, tensors[n]) for n, _ in self.params], self.config)
            seconds = time.perf_counter() - t0
            planned = max(self.plan.bytes_recv().values(), default=0)  # the actor's gather, as planned
            recv_max = reduce_max(torch.tensor([float(planned)], dtype=torch.float64))[0]
            return {"weight_sync/bytes_recv_max": recv_max, "weight_sync/bytes_lower_bound": float(self.lower_bound),
                    "weight_sync/collectives": 0.0, "weight_sync/buckets": 1.0, "timing/weight_sync_load_s": seconds}
        got: list[tuple[str, torch.Tensor]] = []
        shards = {n: {full_block(tuple(t.shape)): t} for n, t in tensors.items()}
        stats = execute(self.plan, shards, dist.get_rank(), dtype=self.dtype, comm_device=comm_device(self.group),
                        bucket_bytes=self.bucket_bytes, deliver=got.extend, group=self.group)
        out = {"weight_sync/bytes_recv": float(stats.bytes_recv), "weight_sync/bytes_sent": float(stats.bytes_sent),
               "weight_sync/collectives": float(stats.collectives), "timing/weight_sync_transport_s": stats.seconds}
        if self.rollout is not None:
            t0 = time.perf_counter()
            self.rollout.load_adapter([(n, t.cpu()) for n, t in got], self.config)
            out["timing/weight_sync_load_s"] = time.perf_counter() - t0
        return out
