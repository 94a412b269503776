"""The Megatron engine's weights in HF coordinates: loading, the weight sync's shards, export and checkpoints.

Everything goes through convert.hf_pieces: a megatron parameter's rows [a, b) are a rectangular block of one
HF parameter.

Checkpoints are in HF names and full HF shapes, whatever the layout: every HF parameter (and its AdamW
exp_avg / exp_avg_sq) is a ShardedTensor whose shards are the pieces, each a view of the megatron tensor's
rows (shaped as its HF block: an expert's piece is a [1, rows, cols] block of a fused expert tensor), so DCP writes each rank's pieces from where they live and loads them in place. A block held by several
ranks (dp replicas, tp-replicated norms) is saved by its first holder in [dp][pp][tp] order (its "owner"); after
a load the owners' values are broadcast to the replicas (over dp - an expert's over its expert-data-parallel group,
as the other ep ranks hold other experts - then over tp for the replicated parameters,
and to the last stage's copy of a tied embedding). `spmdrl export` reads such a checkpoint exactly as an FSDP2
one (same keys, same full shapes). The CPU optimizer (torch AdamW over the whole local parameters) saves its
moments the same way; the GPU's megatron distributed optimizer saves its dp shards of the fp32 master weights
("main") and of the moments as blocks of the same HF tensors (dist_optim.py).

Functions of a MegatronEngine, like dist_optim.py's: the engine's protocol methods (weight_shards,
checkpoint_state, ...) call them, and they read the engine's stage, mesh, dims and optimizer.
"""
from __future__ import annotations

import math
from contextlib import ExitStack
from typing import Iterator

import torch
import torch.distributed as dist

from spmdrl.errors import CheckpointError, ConfigError
from spmdrl.dist.blocks import Block

from .convert import Piece, hf_param_shapes, hf_pieces, merged_blocks


def load_hf(engine, model_path: str) -> dict[str, int]:
    """Fill this rank's parameters from the HF safetensors slices they hold (nothing else is read). A mixture of
    experts' fused in-memory tensors are read from the checkpoint's per-expert tensors (loading.CheckpointReader)."""
    from spmdrl.models.checkpoint import CheckpointReader, checkpoint_index

    index = checkpoint_index(model_path)
    shapes = dict(hf_param_shapes(engine.dims))
    bytes_read = 0
    with ExitStack() as stack, torch.no_grad():
        reader = CheckpointReader(index, engine.config, stack)
        for mname, p, pieces in engine._local_params():
            if not pieces and mname == "output_layer.weight":  # the last stage's copy of a tied embedding
                pieces = hf_pieces("embedding.word_embeddings.weight", engine.dims, engine.mesh.tp_size,
                                   engine.mesh.tp_rank, engine.first_layer)
            p.data.zero_()  # vocabulary padding rows stay zero
            for pc in pieces:
                view = p.data[pc.rows[0]: pc.rows[1]]
                if not reader.has(pc.hf_name):
                    if not pc.hf_name.startswith("score."):
                        raise ConfigError(f"model.path = {model_path!r}: the checkpoint has no parameter {pc.hf_name!r}")
                    # a fresh value head, like HF's _init_weights, from a generator seeded with the engine's seed:
                    # identical on every replica whatever each rank's global RNG has done
                    std = getattr(engine.config, "initializer_range", 0.02)
                    gen = torch.Generator().manual_seed(engine.seed)
                    full = torch.zeros(1) if pc.hf_name.endswith("bias") else torch.empty(1, engine.dims.hidden).normal_(0.0, std, generator=gen)
                    view.copy_(full)
                    continue
                offs, size = pc.block
                block = reader.read(pc.hf_name, shapes[pc.hf_name], offs, size) if math.prod(size) else torch.empty(size)
                bytes_read += block.numel() * block.element_size()
                view.copy_(block.reshape(view.shape).to(view.dtype))
    return {"bytes_read": bytes_read}


# ---- weights out (engines/base.py) ---------------------------------------------------------------------
def ep_ranks(engine) -> dict[int, int]:
    """Global rank -> expert-parallel rank of every rank of the mesh (RoleLayout.ep_coords)."""
    layout = engine.mesh.layout
    return {r: layout.ep_coords(r)[0] for r in layout.ranks}


def source_blocks(engine) -> dict[str, list[tuple[int, Block]]]:
    # the reshard planner's Megatron layout (experts by its ep argument); tests/test_reshard_megatron.py checks it
    # equals convert.source_blocks, dense and expert-parallel
    from spmdrl.dist.blocks import megatron_blocks

    return megatron_blocks(engine.param_shapes(), engine.mesh.grid(), num_layers=engine.dims.layers,
                           padded_vocab=engine.dims.vocab_padded, tied=engine.dims.tie and not engine.dims.value_head,
                           tied_copy=False, ep=engine.mesh.layout.ep)


def weight_shards(engine, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor, Block]]:
    """(HF name, tensor, block) of every HF parameter this rank's stage holds: q/k/v and gate/up un-fused
    from linear_qkv / linear_fc1 (the q rows of this rank's query groups concatenated), vocabulary padding
    trimmed; a mixture of experts' local experts merged where their blocks touch (convert.merged_blocks: several
    blocks of one name when they do not). No communication; the blocks are exactly source_blocks()[name][this
    rank]."""
    pieces = [(pc, p) for _, p, pcs in engine._local_params() for pc in pcs]
    of = {id(pc): p for pc, p in pieces}
    for name, block, pcs in merged_blocks([pc for pc, _ in pieces]):
        if len(pcs) == 1:
            t = piece_view(of[id(pcs[0])].detach(), pcs[0])
        else:
            t = torch.empty(block[1], dtype=of[id(pcs[0])].dtype, device=engine.device)
            for pc in pcs:
                t[tuple(slice(o - b, o - b + n) for o, b, n in zip(pc.block[0], block[0], pc.block[1]))] = \
                    piece_view(of[id(pc)].detach(), pc)
        yield name, (t if dtype is None else t.to(dtype)), block


def piece_view(src: torch.Tensor, pc: Piece) -> torch.Tensor:
    """Piece pc of a megatron tensor (or a tensor shaped like it) as a view with its HF block's shape."""
    return src[pc.rows[0]: pc.rows[1]].view(pc.block[1])


def export_hf(engine, out_dir: str, tokenizer=None, dtype: torch.dtype | None = None) -> None:
    """HF model directory from the mesh's first rank, streamed bucket by bucket (engines/hf_writer.py)."""
    import copy

    from spmdrl.dist.collectives import comm_device
    from spmdrl.engines.hf_writer import write_hf_weights

    writer = engine.mesh.layout.ranks[0]
    write_hf_weights(engine, out_dir, writer, engine.mesh.rank, dtype=dtype or engine.dtype, comm_device=comm_device())
    if engine.mesh.rank == writer:
        config = copy.deepcopy(engine.config)
        config.use_cache = True
        config.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)


# ---- checkpoints ----------------------------------------------------------------------------------------
def param_manifest(engine) -> list:
    dt = str(engine.dtype).removeprefix("torch.")
    return [[n, list(s), dt] for n, s in hf_param_shapes(engine.dims)]


def block_owners(engine) -> dict[tuple[str, Block], int]:
    """(HF name, piece block) -> the global rank that saves it (its first holder in grid order: an expert's block
    is held by the ep rank's expert-data-parallel replicas only, and saved by the first of them)."""
    if getattr(engine, "_owner_cache", None) is None:
        owners: dict = {}
        grid = engine.mesh.grid()
        pp, tp = len(grid[0]), len(grid[0][0])
        from .convert import stage_layers, stage_megatron_names

        e_of = ep_ranks(engine)
        for d_ranks in grid:
            for p, tp_ranks in enumerate(d_ranks):
                first = stage_layers(engine.dims.layers, pp, p).start
                for t, rank in enumerate(tp_ranks):
                    for m in stage_megatron_names(engine.dims, pp, p, te=engine.use_te, ep=engine.ep):
                        for pc in hf_pieces(m, engine.dims, tp, t, first, ep=engine.ep, ep_rank=e_of[rank]):
                            owners.setdefault((pc.hf_name, pc.block), rank)
        engine._owner_cache = owners
    return engine._owner_cache


def as_sharded(engine, tensors_of: dict[str, list[tuple[Piece, torch.Tensor]]], owners: dict | None = None) -> dict:
    """HF name -> ShardedTensor over the owners' pieces, with this rank's owned pieces as local shards.
    owners: (HF name, block) -> saving rank; default the model parameters' (block_owners)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    first = next((t for pairs in tensors_of.values() for _, t in pairs), None)
    on_host = first is None or first.device.type == "cpu"  # the model's tensors, or a host optimizer's
    dev = "cpu" if on_host else f"cuda:{torch.cuda.current_device()}"
    owners = block_owners(engine) if owners is None else owners
    by_name: dict[str, list] = {}
    for (name, block), rank in owners.items():
        by_name.setdefault(name, []).append(ShardMetadata(list(block[0]), list(block[1]), f"rank:{rank}/{dev}"))
    shapes = dict(hf_param_shapes(engine.dims))
    out = {}
    me = engine.mesh.rank
    for name, pairs in tensors_of.items():
        local = [Shard(t, ShardMetadata(list(pc.block[0]), list(pc.block[1]), f"rank:{me}/{dev}"))
                 for pc, t in pairs if owners[(pc.hf_name, pc.block)] == me and t.numel()]
        metas = [m for m in by_name[name] if math.prod(m.shard_sizes)]
        props = TensorProperties(dtype=pairs[0][1].dtype)
        md = ShardedTensorMetadata(metas, torch.Size(shapes[name]), props)
        out[name] = ShardedTensor._init_from_local_shards_and_global_metadata(local, md)
    return out


def piece_views(engine, of=lambda p: p.data) -> dict[str, list[tuple[Piece, torch.Tensor]]]:
    out: dict[str, list] = {}
    for _, p, pieces in engine._local_params():
        src = of(p)
        for pc in pieces:
            out.setdefault(pc.hf_name, []).append((pc, piece_view(src, pc)))
    return out


def checkpoint_state(engine) -> tuple[dict, dict]:
    """({"model": {HF name: ShardedTensor}, "optim": {HF name.exp_avg / .exp_avg_sq: ShardedTensor}},
    {param_groups, step, scheduler}); on GPU also "main": {HF name: float32 ShardedTensor} (master weights)."""
    tensors = {"model": as_sharded(engine, piece_views(engine))}
    if engine.optimizer is None:
        return tensors, {}
    if getattr(engine, "dist_optim", False):
        return distributed_optimizer_state(engine, tensors)
    opt, key = engine.optimizer, optimizer_key(engine)
    state = opt.state
    for p in trained(engine):
        m = key(p)
        if m not in state or not state[m]:  # AdamW's lazy init, done now so a fresh engine can load into it
            state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format)}
    optim = {}
    for kind in ("exp_avg", "exp_avg_sq"):
        views = piece_views(engine, lambda p, kind=kind: state[key(p)][kind])
        optim.update({f"{n}.{kind}": t for n, t in as_sharded(engine, views).items()})
    tensors["optim"] = optim
    if hasattr(opt, "master"):  # float32 master weights apart from the model's (host_optim.py)
        tensors["main"] = as_sharded(engine, piece_views(engine, opt.master))
    steps = {float(state[key(p)]["step"]) for p in trained(engine)}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    meta = {"param_groups": [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups],
            "step": max(steps), "scheduler": {"last_epoch": engine.scheduler.last_epoch,
                                              "_step_count": getattr(engine.scheduler, "_step_count", 0)}}
    return tensors, meta


def trained(engine) -> list[torch.nn.Parameter]:
    return [p for p in engine.stage.parameters() if p.requires_grad]


def optimizer_key(engine):
    """Model parameter -> the tensor its AdamW state is keyed by: its float32 master (host_optim.MasterAdamW)
    or the parameter itself (torch AdamW stepping the float32 model weights)."""
    return getattr(engine.optimizer, "master", lambda p: p)


def distributed_optimizer_state(engine, tensors: dict) -> tuple[dict, dict]:
    from . import dist_optim as do

    dopt = do.distributed_optimizer(engine.optimizer)
    do.init_state(dopt)
    owners = do.rect_owners(engine)
    views = do.views(engine)
    tensors["main"] = as_sharded(engine, views["main"], owners)
    tensors["optim"] = {f"{n}.{key}": t for key in ("exp_avg", "exp_avg_sq")
                        for n, t in as_sharded(engine, views[key], owners).items()}
    meta = {"optimizer": "megatron-distributed", "param_groups": do.group_meta(dopt), "step": do.step_of(dopt),
            "scheduler": {"last_epoch": engine.scheduler.last_epoch}}
    return tensors, meta


def load_checkpoint_state(engine, tensors: dict, meta: dict) -> None:
    """DCP filled the owners' pieces in place; copy them to the replicas and restore the JSON state."""
    params = [p for _, p, _ in engine._local_params()]
    if getattr(engine, "dist_optim", False) and engine.optimizer is not None and meta:
        from . import dist_optim as do

        dopt = do.distributed_optimizer(engine.optimizer)
        do.load_meta(dopt, meta)
        engine.scheduler.load_state_dict({"last_epoch": meta["scheduler"]["last_epoch"]})
        sync_replicas(engine, params, [lambda p: p.data])
        if engine.mesh.tp_size > 1:
            g = engine.mesh.group("tp")
            with torch.no_grad():
                for t in do.replicated_shards(engine):
                    dist.broadcast(t, src=dist.get_global_rank(g, 0), group=g)
        return
    kinds = [lambda p: p.data]
    if engine.optimizer is not None and meta:
        if meta.get("optimizer") == "megatron-distributed":
            raise CheckpointError("this checkpoint holds megatron's distributed optimizer state (saved on a GPU "
                                  "without memory.<role>_host_optimizer); resume it with the same setting")
        opt, key = engine.optimizer, optimizer_key(engine)
        state = opt.state
        kinds += [lambda p: state[key(p)]["exp_avg"], lambda p: state[key(p)]["exp_avg_sq"]]
        if hasattr(opt, "master"):
            kinds.append(opt.master)
        for p in trained(engine):
            state[key(p)]["step"] = torch.tensor(float(meta["step"]))
        for g, saved in zip(opt.param_groups, meta["param_groups"]):
            g.update({k: tuple(v) if isinstance(g.get(k), tuple) else v for k, v in saved.items()})
        engine.scheduler.last_epoch = meta["scheduler"]["last_epoch"]
        if hasattr(engine.scheduler, "_step_count"):
            engine.scheduler._step_count = meta["scheduler"]["_step_count"]
        if hasattr(engine.scheduler, "_last_lr"):
            engine.scheduler._last_lr = [g["lr"] for g in opt.param_groups]
    sync_replicas(engine, params, kinds)


def sync_replicas(engine, params, kinds) -> None:
    """Copy the owners' values to the replicas: a dense parameter's over dp, an expert's (megatron's allreduce =
    False) over its expert-data-parallel group (the dp ranks of its ep rank), then tp-replicated ones over tp."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for p in params:
            expert = not getattr(p, "allreduce", True)
            g = ps.get_expert_data_parallel_group() if expert else engine.mesh.group("dp")
            for of in kinds:
                t = of(p)
                if dist.get_world_size(g) > 1:
                    broadcast_via(t, engine.device, src=dist.get_global_rank(g, 0), group=g)
                if engine.mesh.tp_size > 1 and not getattr(p, "tensor_model_parallel", False):
                    tp = engine.mesh.group("tp")
                    broadcast_via(t, engine.device, src=dist.get_global_rank(tp, 0), group=tp)
        gpt = engine.stage.gpt
        if engine.mesh.pp_size > 1 and gpt.share_embeddings_and_output_weights and (gpt.pre_process or gpt.post_process):
            w = gpt.shared_embedding_or_output_weight()
            g = ps.get_embedding_group()
            for of in kinds:
                broadcast_via(of(w), engine.device, src=dist.get_process_group_ranks(g)[0], group=g)


def broadcast_via(t: torch.Tensor, device: torch.device, *, src: int, group) -> None:
    """dist.broadcast of t in place, through a copy on the engine's device when t lives elsewhere (a host
    optimizer's masters and moments: NCCL moves device tensors only)."""
    if t.device.type == device.type:
        dist.broadcast(t, src=src, group=group)
        return
    on = t.to(device)
    dist.broadcast(on, src=src, group=group)
    t.copy_(on)
