"""Building a run's components from the config: training engines per role, the rollout engine, sampling specs.

Called once by the Trainer; everything here runs before the first step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spmdrl.config import Config
from spmdrl.dist.layout import role_backends
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.engines import TrainEngine, build_train_engine
from spmdrl.config.derived import (builds_ref, distills, lora_settings, lora_sync_mode, mini_batch_prompts,
                                    replays_routes, rollout_dtype_name, uses_vllm)
from spmdrl.rollout import SamplingSpec, build_engine
from spmdrl.rollout.base import LoRASpec


@dataclass
class Engines:
    actor: TrainEngine
    ref: TrainEngine | None
    critic: TrainEngine | None
    teacher: TrainEngine | None = None  # the distillation teacher (distill.teacher_path)


def build_engines(cfg: Config, meshes: RoleMeshes, device: torch.device, on_built=None) -> Engines:
    """actor, then ref, then critic, then the distillation teacher; on_built(role, engine) runs right after each (the memory lifecycle parks
    the engine's configured state before the next one is built). With lora.enable the actor (and with
    lora.critic the critic) trains adapters, and no ref is built: the reference policy is the actor with its
    adapters disabled (Learner.ref_logprobs)."""
    a, c, d = cfg.actor, cfg.critic, cfg.data
    on_built = on_built or (lambda role, engine: None)
    updates_per_step = a.ppo_epochs * (d.train_batch_size // mini_batch_prompts(cfg))
    m = cfg.model
    common = dict(dtype=m.dtype, trust_remote_code=m.trust_remote_code)
    if m.compile:
        common["compile"] = True
    recompute = dict(gradient_checkpointing=m.gradient_checkpointing)  # the trainable engines'
    if m.gradient_checkpointing and m.checkpoint_policy != "full":
        recompute["checkpoint_policy"] = m.checkpoint_policy
    if m.gradient_checkpointing and (m.checkpoint_every_n_layers != 1 or m.checkpoint_offload):  # fsdp only (validated)
        recompute.update(checkpoint_every_n_layers=m.checkpoint_every_n_layers, checkpoint_offload=m.checkpoint_offload)
    lora = {}
    if cfg.lora.enable:
        from spmdrl.models.lora import settings_from_config

        lora = dict(lora=settings_from_config(cfg))
    backend = role_backends(cfg)

    def attn(role: str) -> dict:  # the FSDP2 backend's attention; the Megatron backend has its own
        if backend[role] != "fsdp":
            return {}
        return {"attn_implementation": cfg.model.attn_implementation, "logprob_head": cfg.model.logprob_head}

    def replay(role: str) -> dict:  # routing replay and router losses (both training backends)
        out = {"router_replay": True} if replays_routes(cfg) else {}
        if role == "actor" and (a.moe_aux_loss_coef or a.moe_z_loss_coef):
            out["router_losses"] = True
        return out

    def host_optimizer(role: str) -> dict:  # Megatron only (validated); unset: the engine decides (config.derived)
        return {"host_optimizer": getattr(cfg.memory, f"{role}_host_optimizer")} if backend[role] == "megatron" else {}

    actor = build_train_engine(
        backend["actor"], cfg.model.path, meshes["actor"], device, trainable=True,
        optim=dict(lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay, warmup_steps=a.warmup_steps,
                   lr_scheduler=a.lr_scheduler, min_lr_ratio=a.min_lr_ratio, grad_clip=a.grad_clip),
        **recompute, defer_grad_sync=cfg.memory.defer_grad_sync,
        total_steps=cfg.trainer.total_steps * updates_per_step, **common, **lora, **attn("actor"), **replay("actor"),
        **host_optimizer("actor"), **({"freeze_vision_tower": True} if a.freeze_vision_tower else {}),
    )
    on_built("actor", actor)
    ref = None
    if builds_ref(cfg):
        ref = build_train_engine(backend["ref"], cfg.model.path, meshes["ref"], device, trainable=False,
                                 offload=cfg.ref.offload, **common, **attn("ref"), **replay("ref"))
        on_built("ref", ref)
    critic = None
    if c.enable:
        critic = build_train_engine(
            backend["critic"], c.path or cfg.model.path, meshes["critic"], device, trainable=True, value_head=True,
            **recompute, total_steps=cfg.trainer.total_steps * c.ppo_epochs,
            optim=dict(lr=c.lr, weight_decay=c.weight_decay, warmup_steps=c.warmup_steps, grad_clip=c.grad_clip),
            defer_grad_sync=cfg.memory.defer_grad_sync, **common, **(lora if cfg.lora.critic else {}), **attn("critic"),
            **host_optimizer("critic"),
        )
        on_built("critic", critic)
    teacher = None
    if distills(cfg):  # frozen, on its own mesh (placement.teacher_tp / teacher_pp), loaded like the ref
        teacher = build_train_engine(backend["teacher"], cfg.distill.teacher_path, meshes["teacher"], device,
                                     trainable=False, **common, **attn("teacher"))
        on_built("teacher", teacher)
    return Engines(actor, ref, critic, teacher)


def rollout_load_format(cfg: Config, device: torch.device, resuming: bool) -> str:
    """vLLM's load format: "dummy" when a weight sync precedes the first rollout (always after a resume; on
    CUDA the trainer runs one at start), so the checkpoint is read once, by the training engines."""
    f = cfg.rollout.load_format
    if lora_sync_mode(cfg, device.type == "cuda") == "adapter":  # the base never moves: vLLM reads the checkpoint
        return "auto"
    if f == "auto":
        return "dummy" if resuming or device.type == "cuda" else "auto"
    return "auto" if f == "checkpoint" else f


def build_rollout(cfg: Config, meshes: RoleMeshes, device: torch.device, tokenizer_path: str, load_format: str = "auto"):
    """The rollout engine of this rank (a rollout rank). Split placement builds vLLM on the rollout ranks only
    (a prefix of the world: `world_ranks`)."""
    r, d = cfg.rollout, cfg.data
    mesh = meshes["rollout"]
    sub_world = {"world_ranks": len(mesh.layout.ranks)} if meshes.split and uses_vllm(cfg) else {}
    if lora_sync_mode(cfg, device.type == "cuda") == "adapter":  # vLLM's LoRA layers; merge: merged weights
        sub_world["lora"] = LoRASpec(rank=int(cfg.lora.rank), max_loras=r.max_loras, adapter_dir=r.lora_dir)
    return build_engine(
        r.engine, model_path=cfg.model.path, tokenizer_path=tokenizer_path, tp_size=mesh.tp_size,
        tp_group=mesh.my_tp_group(),
        dtype=rollout_dtype_name(cfg, device.type == "cuda"),
        max_model_len=d.max_prompt_length + d.max_response_length, seed=cfg.trainer.seed,
        gpu_memory_utilization=r.gpu_memory_utilization, enable_sleep_mode=r.enable_sleep_mode and device.type == "cuda",
        enforce_eager=r.enforce_eager, model_impl=r.model_impl, max_num_seqs=r.max_num_seqs, per_request_seed=r.per_request_seed,
        max_num_batched_tokens=max(r.max_num_batched_tokens, d.max_prompt_length + d.max_response_length),
        kv_cache_gb=r.kv_cache_gb, trust_remote_code=cfg.model.trust_remote_code, load_format=load_format,
        capture_routes=replays_routes(cfg), **sub_world,
        **({"expert_parallel": True} if r.expert_parallel else {}),
    )


def build_weight_sync(cfg: Config, actor, rollout, meshes: RoleMeshes, device: torch.device, *, memory, actor_grid,
                      hf_config, split: bool):
    """The actor -> rollout weight sync: the planned full-weight resharding (reshard/sync.py), or with a LoRA actor
    the adapter alone (reshard/adapter.py AdapterSync) or the adapter merged into the base through the planned
    resharding (rollout.lora_sync = merge). hf_config: the model's (every rank; the rollout ranks of a split run
    have no actor to ask)."""
    from spmdrl.reshard.adapter import AdapterSync, MergedActor, adapter_params, check_served_config, peft_adapter_config
    from spmdrl.models.vision import in_vision_tower
    from spmdrl.reshard.sync import WeightSync

    mode, r = lora_sync_mode(cfg, device.type == "cuda"), cfg.rollout
    dtype = getattr(torch, rollout_dtype_name(cfg, device.type == "cuda"))
    if mode == "adapter":
        lora = lora_settings(cfg)
        if actor is not None:
            check_served_config(actor.adapter_config(), peft_adapter_config(lora))
        rollout_ranks = list(meshes["rollout"].layout.ranks)
        sync = AdapterSync(
            actor, rollout, params=adapter_params(hf_config, int(lora.rank), lora.target_modules),
            config=actor.adapter_config() if actor is not None else peft_adapter_config(lora), dtype=dtype,
            bucket_mb=r.weight_sync_bucket_mb, rollout_ranks=rollout_ranks, split=split,
            source=min(meshes["actor"].layout.ranks), group=meshes.weight_group, memory=memory, actor_grid=actor_grid,
        )
        sync.hf_config = hf_config
        return sync
    return WeightSync(
        MergedActor(actor) if mode == "merge" and actor is not None else actor, rollout, meshes["rollout"],
        dtype=dtype, bucket_mb=r.weight_sync_bucket_mb, memory=memory, split=split, actor_grid=actor_grid,
        hf_config=hf_config if split else None, rollout_shards=uses_vllm(cfg), group=meshes.weight_group,
        # a frozen vision tower (so also under LoRA, whose adapters are the language model's) goes at the first sync only
        verify=r.verify_sync, frozen=in_vision_tower if cfg.actor.freeze_vision_tower or cfg.lora.enable else None,
    )


@dataclass
class Specs:
    train: SamplingSpec
    val: SamplingSpec
    greedy: SamplingSpec


def sampling_specs(cfg: Config, eos_token_id: int | None) -> Specs:
    r, d = cfg.rollout, cfg.data
    stop_ids = sorted({eos_token_id, *r.stop_token_ids} - {None})
    common = dict(max_tokens=d.max_response_length, stop=list(r.stop), stop_token_ids=stop_ids)
    return Specs(
        train=SamplingSpec(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, **common),
        val=SamplingSpec(n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p,
                         top_k=-1 if r.val_temperature == 0 else r.top_k, **common),
        greedy=SamplingSpec(n=1, temperature=0.0, **common),
    )


def build_tools(cfg: Config) -> list:
    """The configured tools (multi_turn.tools; spmdrl.tools.registry), [] without multi_turn.enable. Every rank
    loads them: the prompts of every dataset are rendered with their schemas."""
    if not cfg.multi_turn.enable:
        return []
    from spmdrl.tools.registry import load_tools

    return load_tools(cfg.multi_turn.tools, cfg.multi_turn)


def tool_schemas(tools: list) -> list[dict] | None:
    return [t.schema() for t in tools] or None


def build_agent(cfg: Config, tokenizer, engine, mesh: RoleMeshes, tools: list):
    """The multi-turn agent loop on this rollout rank's engine (rollout/multi_turn.py), or with agent.enable the
    black-box agent sessions and their endpoint (agents/sessions.py); None without either. The tool runner and
    the endpoint run on the first rank of each rollout TP group only."""
    rollout = mesh["rollout"]
    tp_group = rollout.group("tp") if rollout.tp_size > 1 else None
    if cfg.agent.enable:
        from spmdrl.agents.endpoint import Limits
        from spmdrl.agents.sessions import AgentRollout, AgentSpec

        a = cfg.agent
        spec = AgentSpec("python" if a.entry else "command", a.entry or a.command, sessions=a.sessions,
                         timeout_s=a.timeout_s, fmt=a.tool_format, port=a.port,
                         limits=Limits(max_request_bytes=a.max_request_kb * 1024, max_calls=a.max_calls))
        return AgentRollout(engine, tokenizer, spec, max_prompt_tokens=cfg.data.max_prompt_length,
                            max_response_tokens=cfg.data.max_response_length, tp_group=tp_group)
    if not cfg.multi_turn.enable:
        return None
    from spmdrl.rollout.chat import ChatGlue
    from spmdrl.rollout.multi_turn import AgentLoop, TurnLimits
    from spmdrl.tools.runner import build_tool_runner

    mt = cfg.multi_turn
    limits = TurnLimits(max_turns=mt.max_turns, max_tool_response_tokens=mt.max_tool_response_tokens,
                        max_response_tokens=cfg.data.max_response_length)
    runner = build_tool_runner(mt, tools, hidden_dirs=(cfg.trainer.output_dir,))  # the sandbox cannot read it
    return AgentLoop(engine, ChatGlue(tokenizer, tool_schemas(tools)), runner, limits, fmt=mt.format,
                     tp_group=tp_group)
