"""`spmdrl plan`: role meshes, weight-sync bytes and memory per phase, from the config alone.

No GPU, no weights, no process group: parameter shapes come from the model's config.json (the model is built
on the meta device), rank sets from `dist.layout.plan_layout`, the weight-sync figures from the same
`reshard.plan.plan_sync` call that `WeightSync` makes at run time.

Roles on the Megatron backend (trainer.backend = "megatron") take their per-rank state and pipeline activations
from `spmdrl.plan.megatron` and their weight-sync sources from `dist.blocks.megatron_blocks`.

Memory is an estimate per rank (GPU) and per node (host), in GiB (2^30 bytes), for the colocated phase order
that `spmdrl.loop.memory.MemoryLifecycle` runs, plus the moments around it:

    build -> load -> (sync) -> rollout -> ref_forward -> teacher_forward -> train_critic -> train_actor -> sync
    -> rollout ...
    checkpoint_save at the end of a step; resume in a new process instead of build/load

A phase's GPU figure is what the active role needs (state onloaded, FSDP2 all-gather buffers, activations)
plus what the other roles keep resident (the kinds not listed in memory.<role>_offload) plus vLLM's share, the
CUDA context and NCCL's buffers (`spmdrl.plan.overheads`):
  build            training engines built one at a time (actor, ref, critic, teacher), each one's configured kinds moved
                   to the host right after it is built: the worst engine at its construction peak next to what
                   the earlier ones left. vLLM then starts only if gpu_memory_utilization x GPU is free
                   (vllm_start; vLLM 0.32 v1/worker/utils.py request_memory refuses to start otherwise).
  load             the residents next to vLLM's pool, before the first step
  sync             the actor's weights next to vLLM's pool: the first sync after a build or a resume runs with
                   vLLM's KV cache awake; the weight sync's buffers (`spmdrl.plan.sync_memory`)
  checkpoint_save  at the end of a step, after the sync: vLLM's weights awake (level-1 sleep after validation
                   frees them too), every role's configured kinds in host memory, then one engine at a time
                   brings back its params and optimizer state (never gradients), plus DCP staging one tensor
                   (the largest shard) to the host
  resume           a new process: the residents of a build, vLLM asleep (level 2, the sync after the load
                   refills its weights), one engine's params and optimizer state at a time, DCP staging
Assumptions (each is a named constant, in `spmdrl.plan.overheads` where it is not a model dimension): the CUDA
context costs CUDA_CONTEXT_GIB per GPU; a rank's host process (Python, torch, vLLM, tokenizer, data) costs
PROCESS_HOST_GIB; activation bytes per token per layer follow `layer_activation_bytes` (bf16 tensors saved for
backward, fp32 RMSNorm inputs). These are estimates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from spmdrl.config.derived import (FULL_OFFLOAD, builds_ref, compute_dtype_name, distills, lora_settings,
                                    lora_sync_mode, megatron_host_optimizer, micro_batch_samples, offload_kinds,
                                    rollout_dtype_name, uses_vllm)
from spmdrl.models.model import block_index, load_hf_config, model_param_shapes
from spmdrl.errors import ConfigError

from .overheads import (CUDA_CONTEXT_GIB, GIB, NCCL_COMM_BYTES, NCCL_NET_PEER_BYTES, NCCL_NVLINK_PEER_BYTES,
                        PROCESS_HOST_GIB, communicators, nccl_bytes, p2p_peers, pipeline_peers, vllm_outside_pool)
from .sync_memory import sync_peak


# ------------------------------------------------------------------------------------------------ the model

def moe_dims(c) -> tuple[int, int, int] | None:
    """(experts, experts per token, expert FFN width) of a mixture of experts' HF config, None for a dense model."""
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    top_k = getattr(c, "num_experts_per_tok", None)
    if not experts or not top_k:
        return None
    return int(experts), int(top_k), int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size)


def layer_activation_bytes(c, tp: int) -> int:
    """Bytes saved for backward per token in one decoder layer (bf16, RMSNorm inputs kept in fp32):
    two norms (fp32 input + bf16 output: 6h each), attention input and q/k/v/output (2 bytes each, TP-local),
    MLP gate/up/act/product (4 x I / tp, 2 bytes each). A mixture of experts (every layer sparse) instead: its
    router's logits (E, fp32), the token's hidden state dispatched to each of its top_k experts and their outputs
    combined back (2 x top_k x h, bf16; after megatron's all-gather over its expert-TP group, not divided by tp),
    and each of those experts' gate/up/act/product (4 x F / tp, bf16), with routing assumed balanced; a shared
    expert (Qwen2-MoE, width S) adds a dense MLP's 4 x S / tp and its gate's output."""
    h, heads = c.hidden_size, c.num_attention_heads
    d = getattr(c, "head_dim", None) or h // heads
    kv = (getattr(c, "num_key_value_heads", None) or heads) * d
    q = heads * d
    moe = moe_dims(c)
    if moe is None:
        mlp = 2 * 4 * c.intermediate_size // tp
    else:
        experts, top_k, ffn = moe
        shared = getattr(c, "shared_expert_intermediate_size", 0) or 0
        mlp = 4 * experts + top_k * (2 * 2 * h + 2 * 4 * ffn // tp) + (2 * 4 * shared // tp + 2 if shared else 0)
    return 12 * h + 2 * h + 2 * (2 * q + 2 * kv) // tp + mlp


def sp_exchange_bytes(c, sp: int, eb: int) -> int:
    """Bytes per local token of one layer's Ulysses all-to-alls (engines/sequence_parallel.py), in flight at once:
    q, k, v (key/value heads repeated up to sp) and the attention output, each as the contiguous input and the
    received copy."""
    heads = c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv = max(getattr(c, "num_key_value_heads", None) or heads, sp)
    return 2 * (2 * heads + 2 * kv) * d * eb


# ------------------------------------------------------------------------------------------------ roles


def role_table(layout: dict) -> dict:
    """Which global ranks form which dp/pp/tp groups, per role."""
    out = {}
    for role, lay in layout.items():
        out[role] = {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp, "sp": lay.sp, "ep": lay.ep, "ranks": list(lay.ranks),
                     **lay.groups()}
    return out


def shard_stats(params, lay) -> dict:
    """Per-rank element counts of an FSDP2 (x DTensor tp) role: the largest shard, the TP-local size of the
    whole model, the root's (non-layer) parameters and the largest TP-local decoder layer."""
    from spmdrl.dist.blocks import fsdp_block, fsdp_tp_style, numel

    shards = lay.dp * lay.sp  # FSDP2 shards over dp x sp (RoleMesh.shard_mesh)
    per_rank: dict[tuple[int, int], int] = {}  # by (shard row, tp) coordinate
    for name, shape in params:
        style = fsdp_tp_style(name)
        for d in range(shards):
            for t in range(lay.tp):
                per_rank[d, t] = per_rank.get((d, t), 0) + numel(fsdp_block(shape, style, shards, lay.tp, d, t))
    tp_local = sum(numel(fsdp_block(s, fsdp_tp_style(n), 1, lay.tp, 0, 0)) for n, s in params)
    root = sum(math.prod(s) for n, s in params if block_index(n) is None)
    layers: dict[int, int] = {}
    for n, s in params:
        if (key := block_index(n)) is not None:
            layers[key] = layers.get(key, 0) + numel(fsdp_block(s, fsdp_tp_style(n), 1, lay.tp, 0, 0))
    largest = max(numel(fsdp_block(s, fsdp_tp_style(n), shards, lay.tp, 0, 0)) for n, s in params)
    return {"shard": max(per_rank.values()), "tp_local": tp_local, "root": root, "largest": largest,
            "layer": max(layers.values(), default=0), "total": sum(math.prod(s) for _, s in params)}


def load_bytes_per_rank(params, lay, store_eb: int, ckpt_eb: int) -> int:
    """Memory a rank's sharded load adds (spmdrl/engines/loading.py): its shard in the storage dtype, plus one
    block in flight (read in the checkpoint dtype, then cast)."""
    from spmdrl.dist.blocks import fsdp_block, fsdp_tp_style, numel

    largest = max(numel(fsdp_block(s, fsdp_tp_style(n), lay.dp * lay.sp, lay.tp, 0, 0)) for n, s in params)
    return shard_stats(params, lay)["shard"] * store_eb + largest * (ckpt_eb + store_eb)


# ------------------------------------------------------------------------------------------------ weight sync


def weight_sync_plan(params, hf_config, layout: dict, cfg, elem_bytes: int, backend: str = "fsdp"):
    """The SyncPlan WeightSync builds at run time: the actor's source blocks (FSDP2 x DTensor tp, or Megatron
    tp x pp x dp), vLLM TP targets."""
    from spmdrl.dist.blocks import ModelDims, fsdp_blocks, megatron_blocks
    from spmdrl.reshard.plan import plan_sync
    from spmdrl.reshard.vllm_reads import rollout_targets

    dims = ModelDims.from_hf_config(hf_config)
    groups = role_table(layout)["rollout"]["tp_groups"]
    targets, reads = rollout_targets(params, groups, hf_config, loads_tp_shards=uses_vllm(cfg),
                                     expert_parallel=cfg.rollout.expert_parallel)
    grid = layout["actor"].mesh_ranks()
    if backend == "megatron":
        sources = megatron_blocks(params, grid, num_layers=hf_config.num_hidden_layers, dims=dims,
                                  ep=layout["actor"].ep)
    else:
        sources = fsdp_blocks(params, grid)
    plan = plan_sync(params, sources, targets, elem_bytes)
    plan.reads = reads
    return plan


def _size(n: float) -> str:
    for unit, k in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def sync_routes(plan) -> list[dict]:
    """Per parameter family, the route its tensors take into vLLM (reshard/vllm_reads.py) and its bytes per
    rollout rank; [] for engines that take whole tensors."""
    from spmdrl.reshard.vllm_reads import route_summary

    reads = getattr(plan, "reads", None)
    return route_summary(plan.params, reads, plan.elem_bytes) if reads is not None else []


# ------------------------------------------------------------------------------------------------ memory


def _gib(x: float) -> float:
    return round(x / GIB, 3)


def _fsdp_memory(cfg, r: dict, st: dict, c, lay, seq: int, compute_eb: int, master_eb: int, adapters: dict | None = None):
    """(kinds, train, forward, host_always) in bytes per rank for an FSDP2 (x DTensor tp) role. adapters: the
    shard_stats of its LoRA adapters (the base is then frozen in the compute dtype; only the adapters have float32
    masters, gradients and AdamW state)."""
    m, role_ref = cfg.memory, r["role"] == "ref"
    eb = master_eb if r["trainable"] else compute_eb
    trained = st if adapters is None else adapters
    kinds = {"params": st["shard"] * eb}
    if adapters is not None:
        kinds["params"] = st["shard"] * compute_eb + adapters["shard"] * master_eb
    if r["trainable"]:
        kinds["optimizer"] = trained["shard"] * 8  # AdamW exp_avg + exp_avg_sq, float32
    host_always = role_ref and cfg.ref.offload  # FSDP2 CPUOffloadPolicy: weights live on the host
    tokens = -(-r["micro"] * seq // lay.sp)  # sequence parallelism: each sp rank holds 1/sp of the tokens
    tp = lay.tp
    act_layer = tokens * layer_activation_bytes(c, tp)
    exchange = {"sp_all_to_all": tokens * sp_exchange_bytes(c, lay.sp, compute_eb)} if lay.sp > 1 else {}
    # FSDP2 all-gather buffers in the compute dtype: the root (embeddings, final norm, head: not TP-sharded)
    # stays gathered through a forward, decoder layers one at a time plus one prefetched
    gathered = (st["root"] + 2 * st["layer"]) * compute_eb
    head = (cfg.actor.logprob_chunk_size * c.vocab_size * 4 * 3) if r["lm_head"] else 0  # fp32 logits chunk
    ckpt = cfg.model.gradient_checkpointing
    saved = c.num_hidden_layers * tokens * (2 * c.hidden_size if ckpt else layer_activation_bytes(c, tp))
    if adapters is not None and not ckpt:
        saved += c.num_hidden_layers * tokens * adapters["rank"] * adapters["targets"] * compute_eb
    train = {}
    if r["trainable"]:
        # backward: the gathered layer's and the root's unsharded gradients (compute dtype + fp32 reduce copy)
        unsharded_grads = (trained["root"] + trained["layer"]) * (compute_eb + 4)
        if m.defer_grad_sync:
            unsharded_grads = trained["tp_local"] * 4 + trained["root"] * compute_eb
        if adapters is not None:  # x @ A per adapted linear is saved too (the base's inputs carry the backward)
            act_layer += tokens * adapters["rank"] * adapters["targets"] * compute_eb
        train = {
            "params": kinds["params"], "grads": trained["shard"] * master_eb, "optimizer": kinds["optimizer"],
            "gathered_params": gathered, "unsharded_grads": unsharded_grads,
            "activations": saved + (act_layer if ckpt else 0) + head + tokens * c.hidden_size * 4, **exchange,
        }
    forward = {"params": 0 if host_always else kinds["params"], "gathered_params": gathered,
               "activations": act_layer + head + tokens * c.hidden_size * 4, **exchange}
    return kinds, train, forward, host_always


ELEM_BYTES = {"bfloat16": 2, "float32": 4}


@dataclass
class SyncFigures:
    """The weight sync as the run plans it: the full-weight plan, or with rollout.lora_sync = adapter the
    adapter's; `full_plan` is what vLLM holds either way."""
    plan: object  # reshard.plan.SyncPlan (or the adapter's figures)
    summary: dict
    full_plan: object
    bucket: int
    lora: object  # the [lora] section when LoRA is on, else None
    lora_mode: str | None
    adapter: list | None  # the adapter's (name, shape) list with LoRA
    adapter_peers: dict


def _sync_figures(cfg, hf, actor_params, layout: dict, backends: dict, rollout_eb: int) -> SyncFigures:
    from spmdrl.dist.layout import is_split

    plan = weight_sync_plan(actor_params, hf, layout, cfg, rollout_eb, backend=backends["actor"])
    bucket = cfg.rollout.weight_sync_bucket_mb << 20
    figures = SyncFigures(plan, plan.summary(bucket), plan, bucket, lora_settings(cfg), lora_sync_mode(cfg), None, {})
    if figures.lora is not None:
        from spmdrl.reshard.adapter import adapter_params

        if backends["actor"] != "fsdp":
            raise ConfigError("lora needs trainer.backend = 'fsdp' (the LoRA actor is PEFT on FSDP2)")
        figures.adapter = adapter_params(hf, int(figures.lora.rank), figures.lora.target_modules)
        if figures.lora_mode == "adapter":
            split = is_split(layout)
            figures.plan, figures.summary = adapter_sync_figures(figures.adapter, layout, rollout_eb, bucket, split)
            figures.adapter_peers = p2p_peers(figures.plan, cfg.memory.gpus_per_node) if split else {}
    return figures


def _roles(cfg, hf, actor_params) -> dict:
    """The models the run builds, each with its parameters and micro-batch: actor, ref (only when built),
    critic, distillation teacher, reward model."""
    roles = {"actor": dict(params=actor_params, trainable=True, micro=micro_batch_samples(cfg, "actor"), lm_head=True)}
    if builds_ref(cfg):  # with LoRA the reference policy is the actor with its adapters disabled
        roles["ref"] = dict(params=actor_params, trainable=False, micro=micro_batch_samples(cfg, "ref"), lm_head=True)
    if cfg.critic.enable:
        chf = load_hf_config(cfg.critic.path, cfg.model.trust_remote_code) if cfg.critic.path else hf
        roles["critic"] = dict(params=model_param_shapes(chf, value_head=True), trainable=True,
                               micro=micro_batch_samples(cfg, "critic"), lm_head=False, hf=chf)
    if distills(cfg):  # forward-only passes, with the ref's micro-batches
        thf = load_hf_config(cfg.distill.teacher_path, cfg.model.trust_remote_code)
        roles["teacher"] = dict(params=model_param_shapes(thf), trainable=False, lm_head=True, hf=thf,
                                micro=micro_batch_samples(cfg, "teacher"))
    if cfg.reward.model_path:
        rhf = load_hf_config(cfg.reward.model_path, cfg.model.trust_remote_code)
        roles["reward"] = dict(params=model_param_shapes(rhf, value_head=True), trainable=False,
                               micro=cfg.reward.model_micro_batch_size, lm_head=False, hf=rhf)
    for role, r in roles.items():
        r["role"] = role
    return roles


def _role_state(cfg, r: dict, hf, layout: dict, backends: dict, offload: list, seq: int, compute_eb: int,
                on_gpu: bool) -> dict:
    """One role's memory: its kinds of state, what a training and a forward stage add, what stays resident and
    what goes to the host between its stages, its construction peak and its checkpoint staging."""
    role = r["role"]
    master_eb = 4  # FSDPEngine keeps float32 master shards for a trainable role whatever model.dtype (engines/fsdp.py)
    c = r.get("hf", hf)
    optimizer = None
    if backends.get(role) == "megatron":
        from spmdrl.plan.megatron import megatron_memory, megatron_stats, micro_batches_in_flight

        st = megatron_stats(r["params"], layout[role], c)
        if r["trainable"]:  # the engine's own choice (engines/megatron/engine.py)
            host_opt, why = megatron_host_optimizer(getattr(cfg.memory, f"{role}_host_optimizer", None), role,
                                                    on_gpu=on_gpu, experts=(moe_dims(c) or (0,))[0])
            optimizer = {"optimizer": "host" if host_opt else "distributed" if on_gpu else "torch AdamW",
                         "optimizer_why": why}
        mem = megatron_memory(
            st, c=c, lay=layout[role], trainable=r["trainable"], micro=r["micro"], seq=seq, lm_head=r["lm_head"],
            compute_eb=compute_eb, ckpt=cfg.model.gradient_checkpointing, on_gpu=on_gpu,
            in_flight=micro_batches_in_flight(cfg, role, layout[role]), layer_bytes=layer_activation_bytes,
            chunk=cfg.actor.logprob_chunk_size, host_optimizer=bool(optimizer and optimizer["optimizer"] == "host"))
        kinds, train, forward, host_kinds = mem["kinds"], mem["train"], mem["forward"], set(mem["host_kinds"])
        build, build_kinds = mem["build"], mem["build_kinds"]
        st["worst_stage"] = mem["worst_stage"]
    else:
        st = shard_stats(r["params"], layout[role])
        adapters = None
        if cfg.lora.enable and (role == "actor" or (role == "critic" and cfg.lora.critic)):
            from spmdrl.models.lora import adapter_shapes

            shapes = adapter_shapes(r["params"], cfg.lora.rank, cfg.lora.target_modules)
            adapters = {**shard_stats(shapes, layout[role]), "rank": cfg.lora.rank,
                        "targets": len({n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n, _ in shapes})}
            st["adapters"] = adapters["total"]
        kinds, train, forward, host_always = _fsdp_memory(cfg, r, st, c, layout[role], seq, compute_eb, master_eb,
                                                          adapters)
        host_kinds = set(kinds) if host_always else set()
        # FSDP2 at construction: the sharded weights only (gradients are None, AdamW's state is created at
        # the first step); under CPUOffloadPolicy (ref.offload) not even those
        build_kinds = {} if host_always else {"params": kinds["params"]}
        build = dict(build_kinds)
    # host_kinds: kinds that live in host memory all along (FSDP2's CPUOffloadPolicy ref; a Megatron host optimizer)
    resident = {k: v for k, v in kinds.items() if k not in offload and k not in host_kinds}
    # the Megatron engine frees its grad buffers on offload (regrown as zeros), so they take no host memory
    freed = ("grads",) if backends.get(role) == "megatron" else ()
    host = {k: v for k, v in kinds.items() if (k in offload and k not in freed) or k in host_kinds}
    # DCP stages one tensor at a time to the host: the largest shard, float32 for a trained role's master
    # weights and Adam moments
    staging = st["largest"] * (4 if r["trainable"] else compute_eb)
    return dict(kinds=kinds, train=train, forward=forward, resident=resident, host_when_idle=host,
                host_always={k: kinds[k] for k in host_kinds}, stats=st,
                build=build, build_kinds=build_kinds, staging=staging, optimizer=optimizer)


@dataclass
class VllmFigures:
    on: bool  # the rollout engine is vLLM (else the transformers fallback: no pool, nothing asleep)
    weights: int  # what one rollout rank's vLLM holds of the model (and its LoRA slots), bytes
    pool: float  # its memory budget, gpu_memory_utilization x GPU
    asleep: dict  # what it keeps outside the pool while it sleeps
    awake: dict  # what it keeps outside its budget when awake
    kv_cache: float  # what its budget leaves for the KV cache


def _vllm_figures(cfg, hf, layout: dict, sync: SyncFigures, rollout_eb: int) -> VllmFigures:
    from spmdrl.dist.blocks import numel

    held: dict[int, int] = {}
    for ts in sync.full_plan.targets.values():
        for rank, b in ts:
            held[rank] = held.get(rank, 0) + numel(b)
    weights = max(held.values()) * rollout_eb
    if sync.lora_mode == "adapter":  # vLLM's LoRA slots: max_loras adapters at vLLM's rank, A and B of every adapted linear
        from spmdrl.rollout.base import LoRASpec

        rank = int(sync.lora.rank)
        slot_rank = LoRASpec(rank=rank).max_lora_rank()
        weights += cfg.rollout.max_loras * sum(math.prod(sh) for _, sh in sync.adapter) // rank * slot_rank * rollout_eb
    pool = cfg.rollout.gpu_memory_utilization * cfg.memory.gpu_memory_gb * GIB
    rt = layout["rollout"].tp
    act = (cfg.rollout.max_num_batched_tokens * (4 * hf.hidden_size + 2 * hf.intermediate_size // rt) * rollout_eb
           + cfg.rollout.max_num_seqs * hf.vocab_size * 4)
    on = uses_vllm(cfg)
    asleep = vllm_outside_pool(cfg, hf, rt, rollout_eb) if on else {}  # what vLLM keeps while it sleeps
    awake = {k: v for k, v in asleep.items() if k == "vllm_allreduce_buffers"}  # outside its budget when awake
    # vLLM sizes its KV cache to what its budget leaves after weights, activations, graphs and runner buffers
    kv_cache = pool - weights - act - asleep.get("vllm_cudagraph_pool", 0) - asleep.get("vllm_runner_buffers", 0)
    return VllmFigures(on, weights, pool, asleep, awake, kv_cache)


def _memory_table(phases: dict, m, gpus_node: int) -> tuple[dict, bool]:
    """Per phase: GPU total per rank, host total per node, and whether both fit under memory.margin."""
    memory, fits = {}, True
    for name, (gpu, host) in phases.items():
        gpu = {**gpu, "cuda_context": CUDA_CONTEXT_GIB * GIB}
        gpu_total = sum(gpu.values())
        host_node = gpus_node * (sum(host.values()) + PROCESS_HOST_GIB * GIB)
        ok = gpu_total <= m.margin * m.gpu_memory_gb * GIB and host_node <= m.margin * m.host_memory_gb * GIB
        fits &= ok
        memory[name] = {"gpu_gb": _gib(gpu_total), "host_gb": _gib(host_node), "fits": ok,
                        "gpu": {k: _gib(v) for k, v in gpu.items() if v},
                        "gpu_bytes": {k: int(v) for k, v in gpu.items() if v},
                        "host_per_rank": {**{k: _gib(v) for k, v in host.items() if v}, "process": PROCESS_HOST_GIB}}
    return memory, fits


def build_plan(cfg, world_size: int | None = None) -> dict:
    """Everything `spmdrl plan` prints, as one JSON-able dict: the weight sync, each role's state, vLLM's share,
    NCCL, and the memory of every phase. What the config means (rollout dtype, vLLM or not, offload kinds, LoRA
    sync mode, the ref model) comes from spmdrl.config.derived, as at run time."""
    from spmdrl.dist.layout import is_split, plan_layout, role_backends

    m = cfg.memory
    on_gpu = cfg.trainer.device != "cpu"
    world = world_size or m.nodes * m.gpus_per_node
    backends = role_backends(cfg)
    layout = plan_layout(cfg.placement, world, backends=backends)
    split = is_split(layout)  # rollout ranks hold vLLM only, training ranks never hold it
    hf = load_hf_config(cfg.model.path, cfg.model.trust_remote_code)
    actor_params = model_param_shapes(hf)
    rollout_eb = ELEM_BYTES[rollout_dtype_name(cfg, on_gpu)]
    compute_eb = ELEM_BYTES[compute_dtype_name(cfg, on_gpu)]
    sync_figures = _sync_figures(cfg, hf, actor_params, layout, backends, rollout_eb)
    plan, sync, bucket = sync_figures.plan, sync_figures.summary, sync_figures.bucket
    lora, lora_mode, adapter = sync_figures.lora, sync_figures.lora_mode, sync_figures.adapter
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    roles = _roles(cfg, hf, actor_params)
    offload = {**offload_kinds(cfg, split), "reward": []}
    state = {role: _role_state(cfg, r, hf, layout, backends, offload[role], seq, compute_eb, on_gpu)
             for role, r in roles.items()}
    vllm = _vllm_figures(cfg, hf, layout, sync_figures, rollout_eb)
    vllm_w, vllm_pool, asleep, awake = vllm.weights, vllm.pool, vllm.asleep, vllm.awake
    kv_cache, vllm_on = vllm.kv_cache, vllm.on
    rt = layout["rollout"].tp

    # NCCL per rank: communicators and point-to-point peers; the worst rank of a set
    gpus_node = min(m.gpus_per_node, world)
    comms = communicators(layout, backends, world, split, vllm_on)
    peers = sync_figures.adapter_peers if lora_mode == "adapter" else p2p_peers(plan, m.gpus_per_node)
    mega = next((layout[r] for r in ("actor", "ref", "critic", "teacher") if r in roles and backends.get(r) == "megatron"), None)

    def nccl(ranks, vllm: bool = True, p2p: bool = True) -> dict[str, int]:
        worst: dict[str, int] = {}
        for rank in ranks:
            c = {**comms[rank], **({} if vllm else {"vllm": 0})}
            pipe = pipeline_peers(mega, rank, m.gpus_per_node) if mega is not None and p2p else (0, 0)
            f = nccl_bytes(c, peers.get(rank, (0, 0)) if p2p else (0, 0), pipe)
            if sum(f.values()) > sum(worst.values()):
                worst = f
        return worst

    train_ranks, rollout_ranks = layout["actor"].ranks, layout["rollout"].ranks
    nccl_train, nccl_rollout = nccl(train_ranks), nccl(rollout_ranks)
    nccl_start = nccl(train_ranks if not split else rollout_ranks, p2p=False)  # before any point-to-point

    def idle(active: set[str]) -> tuple[dict, dict]:
        gpu, host = {}, {}
        for role, s in state.items():
            if role in active:  # its GPU figures come from the phase; what lives on the host stays there
                host.update({f"{role}_{k}": v for k, v in s["host_always"].items()})
                continue
            for k, v in s["resident"].items():
                gpu[f"{role}_{k}"] = v
            for k, v in {**s["host_when_idle"], **s["host_always"]}.items():
                host[f"{role}_{k}"] = v
        return gpu, host

    def prefixed(role: str, kinds: dict) -> dict:
        return {f"{role}_{k}": v for k, v in kinds.items()}

    def transport(ranks) -> dict:
        if lora_mode == "adapter":  # the gathered adapter (fp32) and its copy in the rollout dtype
            return {"sync_adapter": sync["adapter_bytes"] // rollout_eb * (4 + rollout_eb)}
        return {f"sync_{k}": v for k, v in sync_peak(plan, bucket, ranks).items()}

    vllm_idle = {} if split else asleep  # on a training rank
    phases: dict[str, tuple[dict, dict]] = {}
    g0, h0 = idle(set())
    # build: each engine constructed next to what the ones before it left on the GPU, then vLLM's start-up
    build_gpu, before_vllm = _build_phase(state, offload)
    phases["build"] = ({**build_gpu, **nccl(train_ranks, vllm=False, p2p=False)}, h0)
    start_used = sum(({} if split else before_vllm).values()) + sum(nccl_start.values()) + sum(awake.values())
    vllm_start = {"gpu_used_gb": _gib(start_used + CUDA_CONTEXT_GIB * GIB),
                  "gpu_free_needed_gb": _gib(cfg.rollout.gpu_memory_utilization * m.gpu_memory_gb * GIB)}
    vllm_start["ok"] = bool(not vllm_on or not on_gpu
                            or start_used + CUDA_CONTEXT_GIB * GIB <= (1 - cfg.rollout.gpu_memory_utilization) * m.gpu_memory_gb * GIB)
    phases["load"] = ({**({} if split else g0), "vllm_pool": vllm_pool, **awake, **nccl_start},
                      {**h0, "load_largest_slice": max(math.prod(s) for _, s in actor_params) * 4 // max(1, layout["actor"].dp)})
    phases["rollout"] = ({**({} if split else g0), "vllm_weights": vllm_w, "vllm_kv_cache_and_activations": vllm_pool - vllm_w,
                          **awake, **nccl_rollout}, {} if split else h0)
    for role in ("ref", "teacher", "reward"):
        if role in state:
            g, h = idle({role})
            phases[f"{role}_forward"] = ({**g, **prefixed(role, state[role]["forward"]), **vllm_idle, **nccl_train}, h)
    for role in ("critic", "actor"):
        if role in state:
            g, h = idle({role})
            phases[f"train_{role}"] = ({**g, **prefixed(role, state[role]["train"]), **vllm_idle, **nccl_train}, h)
    # sync: the actor's params (and its kinds not offloaded) next to the other roles' residents; the first sync
    # after a build or a resume runs with vLLM's whole pool awake (nothing has put it to sleep yet), later ones
    # with its weights only: the phase shows the first
    g, h = idle({"actor"})
    actor = {**prefixed("actor", state["actor"]["resident"]), "actor_params": state["actor"]["kinds"]["params"]}
    actor_host = {f"actor_{k}": v for k, v in state["actor"]["host_when_idle"].items() if k != "params"}
    phases["sync"] = ({**g, **actor, **({} if split else {"vllm_pool": vllm_pool, **awake}), **transport(train_ranks),
                       **nccl_train}, {**h, **actor_host})
    if split:  # the receiving side of the sync: vLLM keeps its KV cache (nothing else shares the device)
        phases["sync_rollout_ranks"] = ({"vllm_pool": vllm_pool, **awake, **transport(rollout_ranks), **nccl_rollout}, {})
    # checkpoint save / resume (MemoryLifecycle.for_checkpoint, then one engine at a time inside its
    # checkpoint_access): vLLM asleep (level 1 after validation; after a sync only its weights are awake and stay),
    # every role's configured kinds in host memory, then each saved engine in turn brings back its params and
    # optimizer state (never its gradients): the worst engine's, next to the others' residents
    saved = [r for r in ("actor", "critic") if r in state]
    staging = {"dcp_staging": max(state[r]["staging"] for r in saved)}

    def one_engine_back(base: dict) -> dict:
        worst: dict = {}
        for role in saved:
            s = state[role]
            back = {f"{role}_{k}": v for k, v in s["kinds"].items()
                    if (k in ("params", "optimizer") or k in s["resident"]) and k not in s["host_always"]}
            if sum(back.values()) > sum(worst.values()):
                worst = back
        return {**{k: v for k, v in base.items() if not any(k.startswith(f"{r}_") for r in saved)},
                **{k: v for k, v in base.items() if k in worst}, **worst}

    if split:  # training ranks: nothing offloaded, no vLLM
        every = {f"{role}_{k}": v for role in state for k, v in state[role]["kinds"].items()
                 if k not in state[role]["host_always"]}
        phases["checkpoint_save"] = ({**every, **staging, **nccl_train}, h0)
        phases["resume"] = ({**every, **staging, **nccl_start}, h0)
    else:
        phases["checkpoint_save"] = ({**one_engine_back(g0), "vllm_weights": vllm_w, **asleep, **staging,
                                      **nccl_train}, h0)
        phases["resume"] = ({**one_engine_back(g0), **asleep, **staging, **nccl_start}, h0)

    if lora_mode == "adapter" and not split and on_gpu and cfg.rollout.enable_sleep_mode:
        # vLLM serving LoRA sleeps at level 1 (its base is never re-sent): its weights wait in pinned host memory
        for name, (gpu, host) in phases.items():
            if name.startswith("train_") or name.endswith("_forward"):
                phases[name] = (gpu, {**host, "vllm_weights_pinned": vllm_w})
    longest = longest_sequences(cfg, hf, roles, layout, backends, offload, state, phases, compute_eb, on_gpu, world)
    memory, fits = _memory_table(phases, m, gpus_node)
    memory["build"]["vllm_start"] = vllm_start
    fits &= vllm_start["ok"]
    kv_ok = kv_cache >= 2 * hf.num_hidden_layers * _kv_per_token(hf, rt) * seq  # at least one full sequence
    fits &= kv_ok
    worst_comms = max(comms.values(), key=lambda c: sum(c.values()))
    return {
        "world_size": world,
        "hardware": {"gpu_memory_gb": m.gpu_memory_gb, "gpus_per_node": m.gpus_per_node,
                     "host_memory_gb": m.host_memory_gb, "margin": m.margin, "nodes": -(-world // m.gpus_per_node),
                     "units": "GiB (2^30 bytes)"},
        "model": {"path": cfg.model.path, "params": state["actor"]["stats"]["total"], **moe_params(hf, actor_params),
                  **({"lora_rank": int(lora.rank), "adapter_params": state["actor"]["stats"]["adapters"]} if lora else {}),
                  **({"critic_params": state["critic"]["stats"]["total"]} if "critic" in state else {})},
        "roles": {k: {**v, "backend": backends.get(k, "vllm" if k == "rollout" else "fsdp"),
                      **({"worst_stage": state[k]["stats"]["worst_stage"]} if "worst_stage" in state.get(k, {}).get("stats", {}) else {}),
                      **(state.get(k, {}).get("optimizer") or {})}
                  for k, v in role_table(layout).items() if k in state or k == "rollout"},
        "placement": {"mode": "split" if split else "colocate", **(split_figures(cfg, layout) if split else {})},
        "weight_sync": {k: sync[k] for k in ("bytes_recv_max", "bytes_lower_bound", "collectives", "buckets",
                                             "bytes_recv_total", "bytes_sent_max")}
                       | {"routes": sync_routes(sync_figures.full_plan)}
                       | ({"lora_sync": lora_mode, "adapter_bytes": sum(math.prod(sh) for _, sh in adapter) * rollout_eb}
                          if lora_mode else {})
                       | {"elem_bytes": rollout_eb, "full_gather_bytes_per_rank": state["actor"]["stats"]["total"] * 4,
                          "p2p_peers_max": list(max(peers.values(), key=sum, default=(0, 0)))},
        "rollout": {"vllm_weights_gb": _gib(vllm_w), "kv_cache_gb": _gib(kv_cache), "kv_cache_fits_one_sequence": kv_ok,
                    **partial_figures(cfg, layout, hf, kv_cache)},
        "nccl": {"communicators": worst_comms, "comm_gb": _gib(NCCL_COMM_BYTES),
                 "p2p_peer_gb": {"nvlink": _gib(NCCL_NVLINK_PEER_BYTES), "network": _gib(NCCL_NET_PEER_BYTES)}},
        "memory": memory,
        "longest_sequence": longest,
        "fits": bool(fits),
    }


def longest_sequences(cfg, hf, roles: dict, layout: dict, backends: dict, offload: dict, state: dict, phases: dict,
                      compute_eb: int, on_gpu: bool, world: int) -> dict:
    """The longest sequence (prompt + response tokens) each trained FSDP2 role can train with one sequence per
    micro-batch, per sequence-parallel degree sp its ranks allow (a divisor of the role's ranks that splits the
    heads; tp = 1): its training phase holds what the plan's phase holds beside the role (the other roles'
    residents, vLLM asleep, NCCL), the role's state, and activations that grow linearly with the tokens per sp
    rank; the sequence is the largest that keeps the phase within memory.margin of the GPU. An estimate from
    the same model as the phases."""
    import dataclasses

    from spmdrl.dist.layout import plan_layout, sp_head_problem

    m = cfg.memory
    budget = m.margin * m.gpu_memory_gb * GIB - CUDA_CONTEXT_GIB * GIB
    out = {}
    for role in ("actor", "critic"):
        if role not in roles or backends.get(role) != "fsdp" or f"train_{role}" not in phases:
            continue
        c = roles[role].get("hf", hf)
        lay = layout[role]
        beside = sum(phases[f"train_{role}"][0].values()) - sum(state[role]["train"].values())
        kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        rows = {}
        for sp in range(1, len(lay.ranks) + 1):
            if len(lay.ranks) % (sp * lay.tp) or (sp > 1 and (lay.tp > 1 or sp_head_problem(c.num_attention_heads, kv, sp))):
                continue
            variant = plan_layout(dataclasses.replace(cfg.placement, **{f"{role}_sp": sp}), world, backends=backends)
            one = dict(roles[role], micro=1)
            a, b = (sum(_role_state(cfg, one, hf, variant, backends, offload[role], n, compute_eb, on_gpu)["train"].values())
                    for n in (sp * 1024, sp * 2048))
            per_token = (b - a) / (sp * 1024)
            fixed = a - per_token * sp * 1024
            rows[sp] = max(0, int((budget - beside - fixed) // per_token)) if per_token > 0 else 0
        out[role] = {"tokens_by_sp": rows, "max_position_embeddings": getattr(c, "max_position_embeddings", None)}
    return out


def adapter_sync_figures(adapter, layout: dict, elem_bytes: int, bucket: int, split: bool):
    """rollout.lora_sync = adapter: the plan AdapterSync makes (reshard/adapter.py) and its figures. Split: the
    first actor rank sends the whole adapter (rollout dtype) to every rollout rank, bucket by bucket. Colocated:
    the actor's gather brings each rank the adapter less its own FSDP2 shard (no exchange of the sync's own, so
    no collectives or NCCL peers are counted here)."""
    from spmdrl.reshard.adapter import adapter_plan
    from spmdrl.dist.blocks import fsdp_blocks, full_block
    from spmdrl.reshard.plan import plan_sync

    rollout_ranks, source = list(layout["rollout"].ranks), min(layout["actor"].ranks)
    if split:
        plan = adapter_plan(adapter, elem_bytes, rollout_ranks, source)
    else:
        plan = plan_sync(adapter, fsdp_blocks(adapter, layout["actor"].mesh_ranks()),
                         {n: [(r, full_block(s)) for r in rollout_ranks] for n, s in adapter}, elem_bytes)
    summary = plan.summary(bucket)
    if not split:
        summary.update(collectives=0, buckets=1)
    summary["adapter_bytes"] = sum(math.prod(s) for _, s in adapter) * elem_bytes
    return plan, summary


def _build_phase(state: dict, offload: dict) -> tuple[dict, dict]:
    """Training engines built one at a time (actor, ref, critic; loop/build.py), each one's configured kinds
    moved to the host right after it is built: the worst moment (one engine at its construction peak next to
    what the earlier ones left on the GPU) and what is on the GPU when vLLM starts (the reward model, built
    after them, stays)."""
    before: dict[str, int] = {}
    worst: dict[str, int] = {}
    for role in ("actor", "ref", "critic", "teacher", "reward"):
        if role not in state:
            continue
        s = state[role]
        now = {**before, **{f"{role}_{k}": v for k, v in s["build"].items()}}
        if sum(now.values()) > sum(worst.values()):
            worst = now
        before.update({f"{role}_{k}": v for k, v in s["build_kinds"].items() if k not in offload[role]})
    return worst, before


def split_figures(cfg, layout: dict) -> dict:
    """Split placement: who does what, and the batch bytes a training rank receives per step (an upper bound:
    rows padded to the longest prompt and response; every tensor travels as float64 columns)."""
    from spmdrl.loop.split import ROLLOUT_KEYS

    d = cfg.data
    width = {"prompts": d.max_prompt_length, "responses": d.max_response_length,
             "response_mask": d.max_response_length, "rollout_log_probs": d.max_response_length}
    asynchronous = cfg.rollout.partial != "off"  # each token's version travels too (loop/split.py VERSION_KEYS)
    row = 8 * (sum(width.get(k, 1) if two_d else 1 for k, (_, two_d) in ROLLOUT_KEYS.items())
               + (d.max_response_length if asynchronous else 0))
    samples = d.train_batch_size * cfg.rollout.n // layout["actor"].dp
    ahead = 1 if asynchronous else cfg.trainer.max_staleness  # batches posted ahead of training (BatchStream.ahead)
    return {"rollout_ranks": list(layout["rollout"].ranks), "training_ranks": list(layout["actor"].ranks),
            "max_staleness": cfg.trainer.max_staleness, "samples_per_training_rank": samples, "batch_row_bytes": row,
            "batch_bytes_per_training_rank": samples * row, "batches_held_ahead": ahead,
            "stream_buffer_bytes_per_training_rank": ahead * samples * row}


def partial_figures(cfg, layout: dict, hf, kv_cache: float) -> dict:
    """Partial rollouts (rollout.partial): the requests each rollout engine holds in flight (this rank's share of
    data.train_batch_size plus rollout.oversample, rollout.n requests a group; loop/partial.py) and the KV cache
    they take at full length. Short of it, vLLM preempts requests and prefills them again (slower, not an error)."""
    if cfg.rollout.partial == "off":
        return {}
    need = -(-cfg.data.train_batch_size // layout["rollout"].dp)
    requests = (need + math.ceil(need * cfg.rollout.oversample)) * cfg.rollout.n
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    kv = requests * seq * 2 * hf.num_hidden_layers * _kv_per_token(hf, layout["rollout"].tp)
    return {"in_flight_requests": requests, "kv_in_flight_gb": _gib(kv), "kv_cache_holds_in_flight": kv_cache >= kv}


def _kv_per_token(c, tp: int) -> int:
    """Bytes of K or V per token per layer on one vLLM rank (bf16; kv heads split over tp, at least one)."""
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return max(1, heads // tp) * d * 2


# ------------------------------------------------------------------------------------------------ printing


def moe_params(hf, shapes: list[tuple[str, tuple[int, ...]]]) -> dict:
    """A mixture of experts' expert count, experts per token and parameters active per token (every parameter
    outside the experts plus top_k / E of the experts'); {} for a dense model."""
    moe = moe_dims(hf)
    if moe is None:
        return {}
    experts, top_k, _ = moe
    total = sum(math.prod(sh) for _, sh in shapes)
    expert = sum(math.prod(sh) for name, sh in shapes if ".experts." in name)
    return {"experts": int(experts), "experts_per_token": int(top_k),
            "active_params": total - expert + expert * int(top_k) // int(experts)}


def render(p: dict) -> str:
    """The plan as a readable table."""
    hw = p["hardware"]
    mp = p["model"]
    active = (f" ({mp['active_params'] / 1e9:.2f}B active per token: {mp['experts_per_token']} of {mp['experts']} "
              "experts)") if "active_params" in mp else ""
    lines = [f"model {mp['path']}: {mp['params'] / 1e9:.2f}B parameters{active}; world {p['world_size']} ranks "
             f"({hw['nodes']} node(s) x {hw['gpus_per_node']} GPUs of {hw['gpu_memory_gb']} GiB, "
             f"{hw['host_memory_gb']} GiB host per node; fits means <= {hw['margin']:g} x each)", "", "roles:"]
    for role, r in p["roles"].items():
        pp = f"  pp groups {_short(r['pp_groups'])}" if r["pp"] > 1 else ""
        sp = f" sp={r['sp']}" if r.get("sp", 1) > 1 else ""
        sp_groups = f"  sp groups {_short(r['sp_groups'])}" if sp else ""
        ep = f" ep={r['ep']}" if r.get("ep", 1) > 1 else ""
        ep_groups = f"  ep groups {_short(r['ep_groups'])}" if ep else ""
        lines.append(f"  {role:8s} {r['backend']:8s} dp={r['dp']} pp={r['pp']} tp={r['tp']}{sp}{ep}  tp groups {_short(r['tp_groups'])}  "
                     f"dp groups {_short(r['dp_groups'])}{pp}{sp_groups}{ep_groups}")
        if "optimizer" in r:
            lines.append(f"  {'':8s} {r['optimizer']} optimizer: {r['optimizer_why']}")
    w, pl = p["weight_sync"], p["placement"]
    if pl["mode"] == "split":
        lines += ["", f"split placement: rollout ranks {_short([pl['rollout_ranks']])}, training ranks "
                      f"{_short([pl['training_ranks']])}, trainer.max_staleness {pl['max_staleness']}; per step each training "
                      f"rank receives at most {pl['batch_bytes_per_training_rank'] / 2**20:.3f} MiB of batch "
                      f"({pl['samples_per_training_rank']} samples x {pl['batch_row_bytes']} B rows), point to point; "
                      f"it holds {pl['batches_held_ahead']} posted batch(es) ahead, "
                      f"({pl['stream_buffer_bytes_per_training_rank'] / 2**20:.3f} MiB)"]
    if "in_flight_requests" in p["rollout"]:
        r = p["rollout"]
        lines += ["", f"partial rollouts: {r['in_flight_requests']} requests in flight per rollout engine, "
                      f"{r['kv_in_flight_gb']} GiB of KV cache at full length against {r['kv_cache_gb']} GiB"
                      + ("" if r["kv_cache_holds_in_flight"] else
                         " (short of it: vLLM preempts requests and prefills them again; lower rollout.oversample "
                         "or raise rollout.gpu_memory_utilization)")]
    if "lora_sync" in w:
        lines += ["", f"LoRA rank {p['model']['lora_rank']}: {p['model']['adapter_params'] / 1e6:.1f}M adapter parameters "
                      f"({w['adapter_bytes'] / 2**20:.1f} MiB in the rollout dtype); base frozen in the compute dtype, "
                      f"optimizer state for the adapter only, no ref copy (ref = adapters disabled); rollout.lora_sync = "
                      f"{w['lora_sync']}" + (": only the adapter moves" if w["lora_sync"] == "adapter" else
                                             ": the merged full weights move")]
    lines += ["", "weight sync routes into vLLM (per parameter family; bytes one rollout rank receives per sync):"]
    lines += [f"  {r['route']:7s} {r['family']:52s} x{r['tensors']:<4d} {_size(r['bytes_per_rank']):>10s}"
              + (f"  (whole tensors: {r['why']})" if r["route"] == "whole" else "") for r in w["routes"]]
    lines += ["", "weight sync per step (rollout dtype, bytes per rank):",
              f"  received max {w['bytes_recv_max'] / GIB:.3f} GiB  lower bound {w['bytes_lower_bound'] / GIB:.3f} GiB  "
              f"sent max {w['bytes_sent_max'] / GIB:.3f} GiB  collectives {w['collectives']}  (every rank gathering every parameter in fp32: "
              f"{w['full_gather_bytes_per_rank'] / GIB:.1f} GiB)",
              f"  vLLM weights {p['rollout']['vllm_weights_gb']} GiB, KV cache {p['rollout']['kv_cache_gb']} GiB per GPU",
              ""]
    for role, row in p.get("longest_sequence", {}).items():
        seqs = ", ".join(f"sp={sp}: {n:,}" for sp, n in row["tokens_by_sp"].items())
        lines.append(f"longest {role} sequence it can train (tokens, one sequence per micro-batch, estimate): {seqs}"
                     f"  (the model has {row['max_position_embeddings']} positions)")
    lines += ["", f"memory per phase (GiB): {'phase':14s} {'GPU/rank':>9s} {'host/node':>10s}  fits  breakdown (GPU)"]
    for name, ph in p["memory"].items():
        parts = ", ".join(f"{k} {v:g}" for k, v in ph["gpu"].items())
        after = f" ({ph['after']})" if "after" in ph else ""
        lines.append(f"  {name + after:36s} {ph['gpu_gb']:9.2f} {ph['host_gb']:10.1f}  {'yes' if ph['fits'] else 'NO ':4s}  {parts}")
    vs, n = p["memory"]["build"]["vllm_start"], p["nccl"]
    lines += [f"  vLLM start: {vs['gpu_used_gb']:.2f} GiB in use, needs {vs['gpu_free_needed_gb']:.2f} GiB free "
              f"(gpu_memory_utilization x GPU): {'yes' if vs['ok'] else 'NO'}",
              f"  NCCL per rank: communicators {n['communicators']} x {n['comm_gb']} GiB; weight-sync peers "
              f"{p['weight_sync']['p2p_peers_max']} (in node, other nodes) x {n['p2p_peer_gb']} GiB",
              "", f"fits: {str(p['fits']).lower()}"]
    if not p["fits"]:
        lines += ["  " + x for x in advice(p)]
    return "\n".join(lines)


def _hint(part: str, phase: str) -> str:
    """The first settings to change for one memory part (a breakdown key such as actor_optimizer) in `phase`."""
    role, _, kind = part.partition("_")
    if role in ("actor", "critic", "ref", "teacher"):
        if kind in ("optimizer", "grads", "params"):
            # offloaded state comes back to the GPU for its own update and forward passes
            busy = phase == f"train_{role}" or phase == f"{role}_forward"
            off = "" if busy else f"memory.{role}_offload += [\"{kind}\"] (to host memory), "
            return (f"{part}: {off}placement.{role}_tp / {role}_pp (shard it), more GPUs (data-parallel sharding)"
                    + (", lora.enable = true" if role == "actor" and kind != "params" else "")
                    + (f", memory.{role}_host_optimizer = true (Megatron: the optimizer step in host memory)"
                       if role in ("actor", "critic") and kind == "optimizer" else ""))
        if kind == "activations":
            return f"{part}: a smaller {role}.micro_batch_size, model.gradient_checkpointing = true"
    if part.startswith("vllm"):
        return f"{part}: a lower rollout.gpu_memory_utilization, a larger placement.rollout_tp"
    if part.startswith("nccl"):
        return f"{part}: fewer communicators (fewer distinct role layouts), fewer nodes per weight-sync peer group"
    if part.startswith(("sync", "dcp")):
        return f"{part}: a smaller rollout.weight_sync_bucket_mb"
    return f"{part}: see docs/config.md [memory] and [placement]"


def advice(p: dict) -> list[str]:
    """Why a plan does not fit, in a few lines: the phase furthest over, its largest parts, what to change."""
    hw = p["hardware"]
    gpu_cap, host_cap = hw["margin"] * hw["gpu_memory_gb"], hw["margin"] * hw["host_memory_gb"]
    out = []
    phases = {n: ph for n, ph in p["memory"].items() if not ph["fits"]}
    if phases:
        name, ph = max(phases.items(), key=lambda kv: max(kv[1]["gpu_gb"] / gpu_cap, kv[1]["host_gb"] / host_cap))
        if ph["gpu_gb"] > gpu_cap:
            parts = sorted(ph["gpu"].items(), key=lambda kv: -kv[1])[:2]
            out.append(f"does not fit: phase {name} needs {ph['gpu_gb']:.2f} GiB per GPU, {gpu_cap:.2f} GiB allowed "
                       f"(memory.margin x memory.gpu_memory_gb); largest: "
                       + ", ".join(f"{k} {v:g} GiB" for k, v in parts))
            out += [f"  change {_hint(k, name)}" for k, _ in parts]
            out.append(f"  or offload what is idle in this phase to host memory: {format_change(FULL_OFFLOAD)} (or "
                       "ref.offload = true); `spmdrl plan --min-gpus` tries offload and TP on 1, 2, 4, ... GPUs")
        else:
            out.append(f"does not fit: phase {name} needs {ph['host_gb']:.1f} GiB of host memory per node, "
                       f"{host_cap:.1f} GiB allowed (memory.margin x memory.host_memory_gb): offload fewer kinds "
                       "(memory.*_offload) or spread the run over more nodes")
    if not p["memory"]["build"]["vllm_start"]["ok"]:
        out.append("does not fit: vLLM starts with less free GPU memory than rollout.gpu_memory_utilization asks "
                   "for; lower it, or offload the training state at build (memory.*_offload)")
    if not p["rollout"]["kv_cache_fits_one_sequence"]:
        out.append("does not fit: the KV cache cannot hold one full sequence; raise rollout.gpu_memory_utilization "
                   "or shorten data.max_prompt_length + data.max_response_length")
    return out


def format_change(change: dict) -> str:
    """Config changes {"section.key": value} as command-line overrides."""
    import json

    return " ".join(f"{k}={json.dumps(v, separators=(',', ':')) if isinstance(v, list) else v}" for k, v in change.items())


def _short(groups: list[list[int]], n: int = 4) -> str:
    s = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:n])
    return s + (f" ... ({len(groups)} groups)" if len(groups) > n else "")
