"""Cross-field checks, run on every rank before any process group, model or engine exists."""
from __future__ import annotations

import dataclasses
import math
import os

from spmdrl.config.derived import (builds_ref, distills, lora_sync_mode, megatron_router_refusal, micro_batch_samples,
                                    mini_batch_prompts, moe_distributed_optimizer_refusal, replays_routes)
from spmdrl.errors import ConfigError

CHOICES = {
    "data.truncation": ("error", "left", "right", "middle"),
    "model.dtype": ("auto", "float32", "bfloat16"),
    "model.attn_implementation": ("auto", "spmdrl", "sdpa", "eager"),  # spmdrl.engines.fsdp.ATTN_IMPLEMENTATIONS
    "model.logprob_head": ("auto", "fused", "model"),  # spmdrl.engines.fsdp.LOGPROB_HEADS
    "actor.lr_scheduler": ("constant", "cosine", "linear"),
    "rollout.engine": ("auto", "vllm", "hf"),
    "rollout.partial": ("off", "keep", "recompute"),
    "rollout.dtype": ("auto", "float32", "bfloat16"),
    "rollout.model_impl": ("auto", "vllm", "transformers"),
    "rollout.lora_sync": ("auto", "adapter", "merge"),
    "reward.on_error": ("raise", "zero"),
    "algorithm.kl_ctrl": ("fixed", "adaptive"),
    "trainer.device": ("auto", "cuda", "cpu"),
    "trainer.backend": ("fsdp", "megatron"),
    "model.checkpoint_policy": ("full", "selective"),
    "trainer.critic_backend": ("", "fsdp", "megatron"),
    "lora.init": ("default", "gaussian"),  # spmdrl.models.lora.INITS
    "multi_turn.http_exec_api": ("sandbox_fusion", "piston"),  # spmdrl.tools.builtin.HTTP_APIS
    "logging.verbosity": ("info", "debug"),
    "actor.router_replay": ("off", "rollout"),
}
MEMORY_KINDS = ("params", "grads", "optimizer")


def _get(cfg, key):
    sec, name = key.split(".")
    return getattr(getattr(cfg, sec), name)


SEED_MAX = 2**32 - 1  # numpy's (and so vLLM's) seed range


def check_finite(cfg) -> None:
    """Every float in the config is finite (nan/inf parse as TOML floats; grad_clip = nan once disabled
    clipping silently)."""
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        if not dataclasses.is_dataclass(section):
            continue
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, float) and not math.isfinite(x):
                    raise ConfigError(f"{sec.name}.{f.name} = {v} is not a finite number; give a finite value")


def check_ranges(cfg) -> None:
    """Ranges the code relies on, each a one-line ConfigError naming the key."""
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ConfigError(f"{key} must be {what}, found {_get(cfg, key)!r}")

    a, c, r, alg, t = cfg.actor, cfg.critic, cfg.rollout, cfg.algorithm, cfg.trainer
    need(0 <= t.seed <= SEED_MAX, "trainer.seed", f"in [0, {SEED_MAX}] (vLLM's seed range)")
    need(len(a.betas) == 2 and all(0 <= b < 1 for b in a.betas), "actor.betas", "two AdamW betas in [0, 1)")
    need(a.eps > 0, "actor.eps", "> 0")
    need(0 <= alg.gamma <= 1, "algorithm.gamma", "in [0, 1]")
    need(0 <= alg.lam <= 1, "algorithm.lam", "in [0, 1]")
    need(alg.epsilon >= 0, "algorithm.epsilon", ">= 0")
    need(a.clip_ratio_low <= 1, "actor.clip_ratio_low", "<= 1 (the ratio is clipped at 1 - clip_ratio_low; 1: no lower clip)")
    need(t.dist_timeout_s > 0, "trainer.dist_timeout_s", "> 0")
    need(a.ppo_mini_batch_size >= 0, "actor.ppo_mini_batch_size", ">= 0 (0 means data.train_batch_size)")
    need(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", "-1 (disabled) or >= 1")
    need(0 < r.val_top_p <= 1, "rollout.val_top_p", "in (0, 1]")
    need(cfg.checkpoint.keep_last >= 0, "checkpoint.keep_last", ">= 0 (0 keeps every checkpoint)")
    need(cfg.checkpoint.save_freq >= -1, "checkpoint.save_freq", ">= -1 (-1 never saves)")
    need(cfg.checkpoint.save_every_min >= 0, "checkpoint.save_every_min", ">= 0 (0: no time-based saves)")
    need(cfg.checkpoint.grace_s >= 0, "checkpoint.grace_s", ">= 0 (0: a signal stops the run at once)")
    need(0 <= a.min_lr_ratio <= 1, "actor.min_lr_ratio", "in [0, 1]")
    need(a.weight_decay >= 0, "actor.weight_decay", ">= 0")
    need(a.moe_aux_loss_coef >= 0, "actor.moe_aux_loss_coef", ">= 0 (0: off)")
    need(a.moe_z_loss_coef >= 0, "actor.moe_z_loss_coef", ">= 0 (0: off)")
    need(c.weight_decay >= 0, "critic.weight_decay", ">= 0")
    need(c.warmup_steps >= 0, "critic.warmup_steps", ">= 0")
    need(alg.kl_target > 0, "algorithm.kl_target", "> 0")
    need(alg.kl_horizon > 0, "algorithm.kl_horizon", "> 0")
    need(cfg.reward.overlong_penalty_factor >= 0, "reward.overlong_penalty_factor", ">= 0")
    need(cfg.reward.overlong_buffer_len >= 0, "reward.overlong_buffer_len", ">= 0")
    need(r.max_num_batched_tokens > 0, "rollout.max_num_batched_tokens", "> 0")
    need(bool(cfg.data.prompt_key.strip()), "data.prompt_key", "a column name")
    need(all(s for s in r.stop), "rollout.stop", "non-empty strings (an empty stop string ends every response)")
    need(all(i >= 0 for i in r.stop_token_ids), "rollout.stop_token_ids", "token ids >= 0")
    need(bool(cfg.checkpoint.resume.strip()), "checkpoint.resume", "auto, off or a checkpoint path")
    rw = cfg.reward
    need(not (rw.custom_fn and rw.custom_fns), "reward.custom_fns", "empty when reward.custom_fn is set (put that "
         "function in the list instead)")
    need(not rw.weights or len(rw.weights) == len(rw.custom_fns), "reward.weights",
         f"one weight per reward.custom_fns entry ({len(rw.custom_fns)}), or empty for weights of 1")


def validate(cfg, world_size: int, *, trackers: bool = True):
    """Raise ConfigError on the first inconsistency; return the per-role layout on success. trackers=False skips
    the checks of wandb and MLflow (installed, an API key): for commands that start no run (plan, config show)."""
    from spmdrl.algos import ADV_ESTIMATORS, DISTILL_MODES, KL_ESTIMATORS, LOSS_AGG, POLICY_LOSSES
    from spmdrl.dist.layout import check_megatron_roles, plan_layout, role_backends

    from spmdrl.trackers import check_backends

    check_finite(cfg)
    if trackers:
        check_backends(cfg.logging)
    if "megatron" in [b for r, b in role_backends(cfg).items() if r != "critic" or cfg.critic.enable]:
        m = cfg.model
        for key, bad in (("model.compile", m.compile), ("model.checkpoint_every_n_layers", m.checkpoint_every_n_layers != 1),
                         ("model.checkpoint_offload", m.checkpoint_offload)):
            if bad:
                raise ConfigError(f"{key} = {_get(cfg, key)!r} is an fsdp backend option; the megatron backend has "
                                  f"none: reset it or use trainer.backend = 'fsdp'")

    for key, allowed in CHOICES.items():
        v = _get(cfg, key)
        if v not in allowed:
            raise ConfigError(f"{key} = {v!r} is not one of {', '.join(allowed)}")
    for key, reg in (
        ("algorithm.adv_estimator", ADV_ESTIMATORS),
        ("actor.policy_loss", POLICY_LOSSES),
        ("critic.loss_agg_mode", LOSS_AGG),
        ("actor.kl_loss_type", KL_ESTIMATORS),
        ("algorithm.kl_penalty", KL_ESTIMATORS),
        ("distill.kl_type", KL_ESTIMATORS),
        ("distill.mode", DISTILL_MODES),
    ):
        if _get(cfg, key) not in reg:
            raise ConfigError(f"{key} = {_get(cfg, key)!r} is not registered; registered: {', '.join(reg.names())}")

    positive = [
        "data.max_prompt_length", "data.max_response_length", "data.train_batch_size", "rollout.n",
        "rollout.val_n", "actor.ppo_epochs", "actor.micro_batch_size",
        "critic.micro_batch_size", "critic.ppo_epochs", "trainer.total_steps", "rollout.max_num_seqs",
        "rollout.weight_sync_bucket_mb", "actor.logprob_chunk_size", "algorithm.max_sample_rounds",
        "reward.model_micro_batch_size", "trainer.max_bad_steps", "model.checkpoint_every_n_layers",
    ]
    for key in positive:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0, found {_get(cfg, key)}")
    for key in ("actor.lr", "critic.lr", "rollout.temperature", "rollout.kv_cache_gb"):
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{key} must be > 0, found {_get(cfg, key)}")
    for key in ("actor.clip_ratio_low", "actor.clip_ratio_high", "actor.grad_clip", "critic.grad_clip",
                "actor.entropy_coeff", "actor.kl_loss_coef", "algorithm.kl_coef", "rollout.val_temperature",
                "reward.timeout_s", "data.val_batch_size", "actor.warmup_steps", "trainer.test_freq",
                "trainer.critic_warmup", "trainer.total_epochs", "logging.console_every", "reward.rule_weight", "reward.model_weight", "critic.cliprange_value", "distill.coef"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, found {_get(cfg, key)}")
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    for key in ("actor.max_tokens_per_micro_batch", "actor.forward_max_tokens_per_micro_batch",
                "critic.max_tokens_per_micro_batch", "actor.forward_micro_batch_size", "ref.micro_batch_size"):
        low = -1 if "tokens" in key else 0  # -1: the automatic token budget
        if _get(cfg, key) < low:
            raise ConfigError(f"{key} must be >= {low}{' (-1: auto)' if low else ''}, found {_get(cfg, key)}")
        if "tokens" in key and 0 < _get(cfg, key) < longest:
            raise ConfigError(
                f"{key} = {_get(cfg, key)} is below the longest sequence (data.max_prompt_length + "
                f"data.max_response_length = {longest}): raise it to at least {longest}, -1 for the automatic budget, "
                "or 0 for none"
            )
    if cfg.actor.clip_ratio_c <= 1:
        raise ConfigError(f"actor.clip_ratio_c must be > 1 (dual-clip constant), found {cfg.actor.clip_ratio_c}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], found {cfg.rollout.top_p}")
    if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization must be in (0, 1], found {cfg.rollout.gpu_memory_utilization}")
    if len(cfg.actor.betas) != 2:
        raise ConfigError(f"actor.betas must have 2 values, found {cfg.actor.betas}")
    require_model_path(cfg)
    if not cfg.data.train_files:
        raise ConfigError(f"data.train_files is empty; give {PARQUET_FILES}")
    needs = getattr(ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator), "requires", ())
    if "values" in needs and not cfg.critic.enable:
        raise ConfigError(f"algorithm.adv_estimator = '{cfg.algorithm.adv_estimator}' needs a critic; set critic.enable = true")
    if "index" in needs and cfg.rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator = '{cfg.algorithm.adv_estimator}' compares the samples of a prompt; "
            f"rollout.n = {cfg.rollout.n} gives groups of one (zero advantage); set rollout.n >= 2"
        )
    check_ranges(cfg)
    if cfg.trainer.critic_warmup and not cfg.critic.enable:
        raise ConfigError("trainer.critic_warmup > 0 needs critic.enable = true")

    validate_memory(cfg)
    validate_sequence_parallel(cfg)
    layout = plan_layout(cfg.placement, world_size, backends=role_backends(cfg))
    validate_lora(cfg, layout)
    built = ["actor"] + (["ref"] if builds_ref(cfg) else []) + (
        ["critic"] if cfg.critic.enable else []) + (["teacher"] if distills(cfg) else [])
    check_megatron_roles(layout, role_backends(cfg), built)
    if cfg.reward.model_path and layout["reward"].tp != layout["actor"].tp:
        raise ConfigError(
            f"placement.reward_tp = {layout['reward'].tp} must equal actor_tp = {layout['actor'].tp} for now: the reward "
            "model scores the samples where the actor holds them"
        )
    bs, n = cfg.data.train_batch_size, cfg.rollout.n
    rollout_dp = layout["rollout"].dp
    if bs % rollout_dp:
        raise ConfigError(
            f"data.train_batch_size = {bs} is not divisible by the rollout data-parallel size {rollout_dp} "
            f"(world {world_size} / rollout_tp {cfg.placement.rollout_tp})"
        )
    mini = mini_batch_prompts(cfg)
    if bs % mini:
        raise ConfigError(f"data.train_batch_size = {bs} is not divisible by actor.ppo_mini_batch_size = {mini}")
    for role in ("actor", "critic"):
        micro = micro_batch_samples(cfg, role)
        if role == "critic" and not cfg.critic.enable:
            continue
        dp = layout[role].dp
        samples = mini * n
        if samples % dp:
            raise ConfigError(
                f"actor.ppo_mini_batch_size * rollout.n = {mini} * {n} = {samples} samples is not divisible by the "
                f"{role} data-parallel size {dp}"
            )
        if (samples // dp) % micro:
            raise ConfigError(
                f"{role}.micro_batch_size = {micro} does not divide the {samples // dp} samples each {role} rank gets "
                f"per mini-batch (ppo_mini_batch_size * n / dp = {mini} * {n} / {dp})"
            )
    if cfg.reward.overlong_buffer_len >= cfg.data.max_response_length:
        raise ConfigError(
            f"reward.overlong_buffer_len = {cfg.reward.overlong_buffer_len} must be < data.max_response_length = "
            f"{cfg.data.max_response_length}"
        )
    validate_objective(cfg, layout)
    validate_distill(cfg)
    validate_rollout_correction(cfg)
    validate_split(cfg)
    validate_partial(cfg)
    validate_architecture(cfg)
    validate_moe_options(cfg)
    validate_rollout_length(cfg)
    validate_lora_sync(cfg)
    validate_multi_turn(cfg)
    validate_agent(cfg)
    validate_tools(cfg)
    return layout


def validate_distill(cfg) -> None:
    """The [distill] section (loop/learner.py Learner.distill); plan_layout has placed the teacher (the training
    ranks, teacher_tp x teacher_pp dividing them). The teacher's files and tokenizer family are checked on disk
    before launch (spmdrl.preflight.check_teacher)."""
    p, d = cfg.placement, cfg.distill
    if not distills(cfg):
        if p.teacher_ranks or p.teacher_tp != 1 or p.teacher_pp != 1 or cfg.memory.teacher_offload:
            raise ConfigError("placement.teacher_ranks / teacher_tp / teacher_pp and memory.teacher_offload place the "
                              "distillation teacher, but distill.teacher_path is empty; set it or leave them unset")
        return
    if d.coef <= 0:
        raise ConfigError(f"distill.coef must be > 0 with a teacher (distill.teacher_path), found {d.coef}")


def validate_sequence_parallel(cfg) -> None:
    """placement.<role>_sp > 1 is Ulysses on the FSDP2 backend, inside spmdrl's attention (model.attn_implementation =
    'auto'). On the Megatron backend it would be megatron's context parallelism, which needs TransformerEngine and
    which spmdrl does not run: refused either way, naming what to do."""
    from spmdrl.dist.layout import role_backends

    backends = role_backends(cfg)
    built = ["actor"] + (["ref"] if builds_ref(cfg) else []) + (["critic"] if cfg.critic.enable else [])
    for role in built:
        sp = getattr(cfg.placement, f"{role}_sp")
        if sp <= 1:
            continue
        key = f"placement.{role}_sp = {sp}"
        if backends[role] == "megatron":
            import importlib.util

            why = ("spmdrl does not run it yet" if importlib.util.find_spec("transformer_engine") else
                   "needs TransformerEngine (pip install transformer-engine[pytorch], CUDA only), not installed here")
            raise ConfigError(f"{key} on the megatron backend is megatron's context parallelism, which {why}; use "
                              f"{'trainer.critic_backend' if role == 'critic' else 'trainer.backend'} = 'fsdp' "
                              f"(Ulysses sequence parallelism) or {role}_sp = 1")
        if cfg.model.attn_implementation not in ("auto", "spmdrl"):
            raise ConfigError(f"{key}: sequence parallelism runs inside spmdrl's attention; set "
                              f"model.attn_implementation = 'auto' (found {cfg.model.attn_implementation!r})")
        a = cfg.actor
        if replays_routes(cfg) or a.moe_aux_loss_coef or a.moe_z_loss_coef:
            raise ConfigError(f"{key}: the MoE router options (actor.router_replay, moe_aux_loss_coef, "
                              "moe_z_loss_coef) see whole sequences and do not run with sequence parallelism yet; "
                              f"reset them or use {role}_sp = 1")
        if cfg.distill.teacher_path:
            raise ConfigError(f"{key}: on-policy distillation (distill.teacher_path) does not run with sequence "
                              f"parallelism yet; use {role}_sp = 1")


def validate_rollout_length(cfg) -> None:
    """With trainer.device = 'cpu', rollout.kv_cache_gb must hold one sequence of max_prompt_length +
    max_response_length (the model's positions are checked before launch: spmdrl.preflight.check_models)."""
    hf = hf_config_json(cfg.model.path)
    if hf is None:
        return
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if cfg.trainer.device != "cpu":
        return  # on a GPU vLLM sizes its KV cache from gpu_memory_utilization (`spmdrl plan` checks it)
    heads = hf.get("num_attention_heads")
    kv, layers = hf.get("num_key_value_heads") or heads, hf.get("num_hidden_layers")
    head_dim = hf.get("head_dim") or (hf.get("hidden_size", 0) // heads if heads else 0)
    if not all(isinstance(x, int) and x > 0 for x in (kv, layers, head_dim)):
        return
    tp = max(1, cfg.placement.rollout_tp)
    per_token = 2 * layers * -(-kv // tp) * head_dim * 4  # key and value, float32 on CPU, this rank's heads
    need = longest * per_token
    if need > cfg.rollout.kv_cache_gb * 2**30:
        raise ConfigError(
            f"rollout.kv_cache_gb = {cfg.rollout.kv_cache_gb} holds {int(cfg.rollout.kv_cache_gb * 2**30 // per_token)} "
            f"tokens of this model's KV cache per rollout rank, fewer than one sequence of data.max_prompt_length + "
            f"data.max_response_length = {longest}; raise it to at least {need / 2**30:.2f}")


def validate_multi_turn(cfg) -> None:
    """The [multi_turn] loop settings (docs/tools.md); the tool settings and the tools are validate_tools', the
    chat template is checked in preflight (spmdrl.preflight.check_multi_turn)."""
    from spmdrl.tools.parse import FORMATS

    mt = cfg.multi_turn
    if not mt.enable:
        return

    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ConfigError(f"multi_turn.{key} must be {what}, found {getattr(mt, key)!r}")

    need(bool(mt.tools) and all(isinstance(t, str) and t.strip() for t in mt.tools), "tools",
         "a non-empty list of tool names (calculator, python, http_exec) or 'module:function' with multi_turn.enable")
    need(mt.format in FORMATS, "format", f"one of {', '.join(FORMATS)}")
    need(mt.max_turns >= 1, "max_turns", ">= 1")
    need(mt.max_tool_response_tokens >= 1, "max_tool_response_tokens", ">= 1")
    if not cfg.data.apply_chat_template:
        raise ConfigError("multi_turn.enable = true needs data.apply_chat_template = true: tool results are rendered "
                          "with the chat template")


BRANCH_RULES = ("all", "last")


def validate_agent(cfg) -> None:
    """The [agent] section (docs/agents.md; spmdrl/agents/)."""
    import os

    from spmdrl.tools.parse import FORMATS

    a = cfg.agent
    if not a.enable:
        return
    if bool(a.entry) == bool(a.command):
        raise ConfigError("agent.enable = true needs exactly one of agent.entry ('file.py:run') and agent.command "
                          f"(a shell command); found entry={a.entry!r}, command={a.command!r}")
    if a.entry:
        target = a.entry.rpartition(":")[0]
        if ":" not in a.entry or not target or not a.entry.rpartition(":")[2]:
            raise ConfigError(f"agent.entry = {a.entry!r}: expected 'path/to/file.py:run' or 'module:run'")
        if (target.endswith(".py") or "/" in target) and not os.path.isfile(os.path.expanduser(target)):
            raise ConfigError(f"agent.entry = {a.entry!r}: file {target} not found")
    for key in ("sessions", "max_calls", "max_request_kb"):
        if getattr(a, key) < 1:
            raise ConfigError(f"agent.{key} must be >= 1, found {getattr(a, key)}")
    if not a.timeout_s > 0:
        raise ConfigError(f"agent.timeout_s must be > 0, found {a.timeout_s}")
    if a.tool_format not in FORMATS:
        raise ConfigError(f"agent.tool_format must be one of {', '.join(FORMATS)}, found {a.tool_format!r}")
    if not 0 <= a.port <= 65535:
        raise ConfigError(f"agent.port must be in [0, 65535], found {a.port}")
    if cfg.multi_turn.enable:
        raise ConfigError("agent.enable and multi_turn.enable are two ways to roll out: turn one off (an agent "
                          "calls its own tools; multi_turn runs spmdrl's)")
    if cfg.rollout.partial != "off":
        raise ConfigError(f"agent.enable = true with rollout.partial = {cfg.rollout.partial!r}: agent sessions are not "
                          "carried over weight updates (a session's calls would wait while the actor trains, and a "
                          "checkpoint cannot suspend a program of yours); set rollout.partial = 'off'")
    if a.train_branches not in BRANCH_RULES:
        raise ConfigError(f"agent.train_branches must be one of {', '.join(BRANCH_RULES)}, found {a.train_branches!r}")
    if a.train_branches == "all":
        for bad, what in ((cfg.placement.mode == "split", "placement.mode = 'split'"),
                          (cfg.algorithm.filter_groups, "algorithm.filter_groups = true")):
            if bad:
                raise ConfigError(f"agent.train_branches = 'all' with {what}: a step's rows per group vary with the "
                                  "sessions' branches, which this does not take yet; set agent.train_branches = 'last'")


def validate_rollout_correction(cfg) -> None:
    """The [rollout_correction] section (spmdrl/algos/rollout_correction.py)."""
    import inspect

    from spmdrl.algos import POLICY_LOSSES
    from spmdrl.algos.rollout_correction import IS_LEVELS, RS_LEVELS

    rc = cfg.rollout_correction
    for key, allowed in (("rollout_is", ("none", *IS_LEVELS)), ("rollout_rs", ("none", *RS_LEVELS))):
        if getattr(rc, key) not in allowed:
            raise ConfigError(f"rollout_correction.{key} = {getattr(rc, key)!r} is not one of {', '.join(allowed)}")
    for key in ("rollout_is_threshold", "rollout_rs_threshold"):
        if not getattr(rc, key) > 0:
            raise ConfigError(f"rollout_correction.{key} must be > 0, found {getattr(rc, key)}")
    lower = rc.rollout_rs_threshold_lower
    if lower is not None and not 0 <= lower < rc.rollout_rs_threshold:
        raise ConfigError(
            f"rollout_correction.rollout_rs_threshold_lower = {lower} must be >= 0 and below rollout_rs_threshold = "
            f"{rc.rollout_rs_threshold} (leave it unset for 1 / rollout_rs_threshold)"
        )
    if rc.rollout_rs != "none":  # the window must hold ratio 1 (the rollout and the actor agree), else it drops
        upper = rc.rollout_rs_threshold  # every on-policy token and, with no mismatch, every token of every step
        low = 1.0 / upper if lower is None else lower
        if not low <= 1.0 <= upper:
            shown = f"[1 / {upper:g}, {upper:g}] = [{low:g}, {upper:g}]" if lower is None else f"[{low:g}, {upper:g}]"
            raise ConfigError(
                f"rollout_correction: the rejection window {shown} (rollout_rs_threshold_lower, rollout_rs_threshold) "
                "does not contain ratio 1, so it rejects every token on which the rollout and the actor agree and the "
                "update trains on nothing; set rollout_rs_threshold >= 1 and rollout_rs_threshold_lower <= 1"
            )
    if not 0 <= rc.rollout_token_veto_threshold < 1:
        raise ConfigError(f"rollout_correction.rollout_token_veto_threshold must be in [0, 1) (0 disables), found "
                          f"{rc.rollout_token_veto_threshold}")
    if rc.decoupled and rc.rollout_is != "none":
        raise ConfigError(f"rollout_correction.decoupled = true weights each token's loss by pi_prox / pi_behav, and "
                          f"rollout_is = {rc.rollout_is!r} would weight it by the same ratio again: set "
                          "rollout_correction.rollout_is = 'none' (decoupled_cap caps the weights)")
    if rc.decoupled_cap != 0 and not (rc.decoupled and rc.decoupled_cap >= 1):
        raise ConfigError(f"rollout_correction.decoupled_cap = {rc.decoupled_cap}: "
                          + ("it must be >= 1 (a cap below 1 would weight every token below its ratio) or 0 (uncapped)"
                             if rc.decoupled else "it caps decoupled PPO's weights; set rollout_correction.decoupled = "
                             "true or leave it 0"))
    if (rc.rollout_is != "none" and rc.rollout_is_in_loss) or rc.decoupled:
        params = inspect.signature(POLICY_LOSSES.get(cfg.actor.policy_loss)).parameters
        if "rollout_is_weights" not in params:
            what = "decoupled = true" if rc.decoupled else f"rollout_is = {rc.rollout_is!r}"
            fix = "rollout_correction.decoupled = false" if rc.decoupled else "rollout_correction.rollout_is_in_loss = false"
            raise ConfigError(
                f"rollout_correction.{what} but actor.policy_loss = {cfg.actor.policy_loss!r} takes no "
                f"rollout_is_weights argument: add it to the loss, or set {fix}"
            )




def validate_lora_sync(cfg) -> None:
    """rollout.lora_sync, max_loras and the adapter's shape against what the rollout sync covers."""
    if cfg.rollout.max_loras < 1:
        raise ConfigError(f"rollout.max_loras = {cfg.rollout.max_loras}: must be >= 1")
    mode = lora_sync_mode(cfg)
    if mode is None:
        return
    from spmdrl.reshard.adapter import target_list
    from spmdrl.rollout.base import LoRASpec

    target_list(cfg.lora.target_modules)
    if mode == "adapter":
        if cfg.rollout.engine == "hf":
            raise ConfigError("rollout.lora_sync = 'adapter' needs the vLLM rollout engine; the transformers engine "
                              "takes merged weights: set rollout.lora_sync = 'merge' (or 'auto')")
        LoRASpec(rank=int(cfg.lora.rank)).max_lora_rank()  # raises above vLLM's largest rank
        if cfg.rollout.load_format == "dummy":
            raise ConfigError("rollout.load_format = 'dummy' with rollout.lora_sync = 'adapter': only the adapter is "
                              "synced, so vLLM must load the base from model.path; use 'auto' or 'checkpoint'")
        init = str(getattr(cfg.lora, "init", "")).lower()
        if init.startswith(("pissa", "olora", "corda", "loftq", "eva")):
            raise ConfigError(f"lora.init = {init!r} rewrites the base weights, which rollout.lora_sync = "
                              "'adapter' never sends: use rollout.lora_sync = 'merge' or a plain init")
    if cfg.rollout.lora_dir and not os.path.isdir(cfg.rollout.lora_dir):
        raise ConfigError(f"rollout.lora_dir = {cfg.rollout.lora_dir!r} is not a directory: create it or leave it empty "
                          "(/dev/shm)")





def validate_lora(cfg, layout) -> None:
    """The [lora] section (spmdrl/engines/lora.py): FSDP2 without tensor parallelism, no separate ref."""
    from spmdrl.dist.layout import role_backends

    lo = cfg.lora
    if not lo.enable:
        if lo.critic:
            raise ConfigError("lora.critic = true needs lora.enable = true (LoRA on the actor)")
        return
    if lo.rank <= 0:
        raise ConfigError(f"lora.rank must be > 0, found {lo.rank}")
    if lo.alpha <= 0:
        raise ConfigError(f"lora.alpha must be > 0, found {lo.alpha}")
    if not 0 <= lo.dropout < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), found {lo.dropout}")
    if not all(t.strip() for t in lo.target_modules):
        raise ConfigError(f"lora.target_modules = {lo.target_modules}: give module names such as q_proj (empty list: every linear layer)")
    # the decoder blocks' linear layers of the model (a meta-device build from config.json; a hub id not on disk
    # is checked when the engine wraps it)
    paths = [cfg.model.path] + ([cfg.critic.path] if cfg.critic.enable and lo.critic and cfg.critic.path else [])
    for path in paths:
        from spmdrl.models.lora import unknown_targets

        known = _decoder_linear_layers(path)
        why = unknown_targets(lo.target_modules, known, f" of {path} (a {hf_model_type(path)} model)") if known else ""
        if why:
            raise ConfigError(why)
    roles = ["actor"] + (["critic"] if cfg.critic.enable and lo.critic else [])
    backends = role_backends(cfg)
    for role in roles:
        if backends[role] != "fsdp":
            key = "trainer.critic_backend" if role == "critic" and cfg.trainer.critic_backend else "trainer.backend"
            raise ConfigError(f"lora.enable = true: {key} = {backends[role]!r} has no LoRA (megatron-core 0.16.1 has none); "
                              f"use {key} = 'fsdp'")
        if layout[role].tp > 1 and lo.dropout > 0:
            raise ConfigError(f"lora.dropout = {lo.dropout} with placement.{role}_tp = {layout[role].tp}: each tensor-parallel "
                              "rank would draw its own dropout mask on the replicated input; set lora.dropout = 0 or tp = 1")
    p = cfg.placement
    if p.ref_ranks or p.ref_tp != 1 or p.ref_pp != 1 or cfg.ref.offload or cfg.memory.ref_offload:
        raise ConfigError("lora.enable = true: the reference policy is the actor with its adapters disabled (no ref "
                          "model is built); leave placement.ref_ranks, ref_tp, ref_pp, ref.offload and memory.ref_offload unset")


def _decoder_linear_layers(path: str) -> list[str]:
    """Names of the linear layers of a model's decoder blocks, from its config.json ([] where it is not on disk)."""
    hf = hf_config_json(path)
    if not hf or not isinstance(hf.get("model_type"), str):
        return []
    from transformers import AutoConfig

    from spmdrl.models.lora import linear_targets
    from spmdrl.models.model import backbone_of, meta_model

    d = dict(hf)
    try:
        model = meta_model(AutoConfig.for_model(d.pop("model_type"), **d), value_head=False)
    except Exception:  # transformers cannot build it: validate_architecture names that
        return []
    return linear_targets(backbone_of(model))


def validate_split(cfg) -> None:
    """What split placement and trainer.max_staleness support (spmdrl/loop/split.py)."""
    from spmdrl.algos import ADV_ESTIMATORS
    from spmdrl.dist.layout import role_backends

    k = cfg.trainer.max_staleness
    if k < 0:
        raise ConfigError(f"trainer.max_staleness must be >= 0, found {k}")
    if cfg.placement.mode != "split":
        if k:
            raise ConfigError(f"trainer.max_staleness = {k} needs placement.mode = 'split' (colocated roles take turns "
                              "on the same devices, so there is nothing to overlap); set it to 0")
        return
    if cfg.algorithm.filter_groups:
        raise ConfigError("algorithm.filter_groups (dynamic sampling) needs placement.mode = 'colocate' for now: its "
                          "extra rollout rounds are decided by the training ranks")
    if "baseline_rewards" in getattr(ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator), "requires", ()):
        raise ConfigError(f"algorithm.adv_estimator = '{cfg.algorithm.adv_estimator}' scores a greedy rollout inside "
                          "the rollout stage, which split placement does not do yet; use placement.mode = 'colocate'")
    from spmdrl.reshard.sync import split_backend_refusal

    for role, backend in role_backends(cfg).items():
        key = "trainer.critic_backend" if role == "critic" and cfg.trainer.critic_backend else "trainer.backend"
        if split_backend_refusal(key, backend):
            raise ConfigError(split_backend_refusal(key, backend))


def validate_partial(cfg) -> None:
    """What partial rollouts (rollout.partial, spmdrl/loop/partial.py) support."""
    from spmdrl.algos import ADV_ESTIMATORS
    from spmdrl.config.derived import on_policy, rollout_correction_active, sampler_truncates

    r = cfg.rollout
    if r.max_version_lag < 0 or not r.oversample >= 0:
        key = "rollout.max_version_lag" if r.max_version_lag < 0 else "rollout.oversample"
        raise ConfigError(f"{key} must be >= 0, found {_get(cfg, key)}")
    if r.partial == "off":
        return
    split = cfg.placement.mode == "split"
    if split and cfg.trainer.max_staleness < 1:
        raise ConfigError(f"rollout.partial = '{r.partial}' with placement.mode = 'split' (asynchronous split) samples "
                          "with weights one update behind the actor: set trainer.max_staleness >= 1 (the most versions a "
                          "trained token may lag), or set rollout.partial = 'off'")
    why = (("algorithm.filter_groups = true", cfg.algorithm.filter_groups, "turn dynamic sampling off"),
           (f"algorithm.adv_estimator = '{cfg.algorithm.adv_estimator}' (a greedy baseline rollout)",
            "baseline_rewards" in getattr(ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator), "requires", ()),
            "choose another estimator"))
    for what, bad, fix in why:
        if bad:
            raise ConfigError(f"rollout.partial = '{r.partial}' samples each group once; {what} is not "
                              f"supported with it: {fix} or set rollout.partial = 'off'")
    if on_policy(cfg) and sampler_truncates(cfg):
        raise ConfigError(f"rollout.partial = '{r.partial}' makes each token's rollout log-prob the loss's old policy, "
                          f"which top_p = {r.top_p} / top_k = {r.top_k} truncate: sample untruncated (top_p = 1, "
                          "top_k = -1) or set rollout.partial = 'off'")
    if not on_policy(cfg) and not rollout_correction_active(cfg):
        raise ConfigError(f"rollout.partial = '{r.partial}' with an old-log-prob pass (several epochs or mini-batches, "
                          "KL in the reward or distillation) needs the behaviour log-probs in the loss: set "
                          "rollout_correction.decoupled = true (decoupled PPO) or train on-policy")
    if r.enable_sleep_mode and not split and _on_cuda(cfg):  # split: the rollout ranks' engine never sleeps
        raise ConfigError(f"rollout.partial = '{r.partial}' keeps requests in the engine across the update, and vLLM's "
                          "sleep mode drops their KV cache while training: set rollout.enable_sleep_mode = false")


def _on_cuda(cfg) -> bool:
    if cfg.trainer.device != "auto":
        return cfg.trainer.device == "cuda"
    import torch

    return torch.cuda.is_available()


def validate_objective(cfg, layout) -> None:
    """Checks that keep the optimised objective independent of the parallel layout."""
    from spmdrl.algos import LOSS_AGG
    from spmdrl.algos.losses import resolve_agg_mode

    mode = cfg.actor.loss_agg_mode
    if mode != "auto" and mode not in LOSS_AGG:
        raise ConfigError(f"actor.loss_agg_mode = {mode!r} is not registered; registered: auto, {', '.join(LOSS_AGG.names())}")
    resolve_agg_mode(cfg.actor.policy_loss, mode)  # GSPO / GMPO: reject a conflicting explicit choice
    for key in ("actor.loss_agg_norm", "critic.loss_agg_norm"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0 (0 means data.max_response_length), found {_get(cfg, key)}")
    if cfg.algorithm.filter_metric not in ("rule_score", "score"):
        raise ConfigError(f"algorithm.filter_metric = {cfg.algorithm.filter_metric!r} is not one of rule_score, score")
    check_whole_groups(cfg, layout)


def check_whole_groups(cfg, layout) -> None:
    """A prompt's rollout.n samples must land on one actor data-parallel rank: group statistics (GRPO, RLOO,
    OPO, ..., and dynamic sampling's filter) are computed where the samples are, without communication.

    Samples are laid out prompt-major and cut into dp equal contiguous slices, so groups stay whole iff
    each slice holds whole prompts: data.train_batch_size % actor dp == 0.
    """
    from spmdrl.algos import ADV_ESTIMATORS

    needs = "index" in getattr(ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator), "requires", ())
    if not (needs or cfg.algorithm.filter_groups) or cfg.rollout.n < 2:
        return
    bs, n, dp = cfg.data.train_batch_size, cfg.rollout.n, layout["actor"].dp
    if bs % dp:
        raise ConfigError(
            f"data.train_batch_size = {bs} prompts x rollout.n = {n} = {bs * n} samples over {dp} actor data-parallel "
            f"ranks gives {bs * n / dp:g} samples per rank, which splits a prompt's {n} samples across ranks "
            f"(group statistics and dynamic sampling need whole groups); "
            f"make data.train_batch_size a multiple of {dp}"
        )


def validate_memory(cfg) -> None:
    """The [memory] section and rollout.load_format (spmdrl/loop/memory.py, spmdrl/plan/)."""
    if cfg.rollout.load_format not in ("auto", "dummy", "checkpoint"):
        raise ConfigError(f"rollout.load_format = {cfg.rollout.load_format!r} is not one of auto, dummy, checkpoint")
    m = cfg.memory
    for role in ("actor", "critic", "ref", "teacher"):
        bad = [k for k in getattr(m, f"{role}_offload") if k not in MEMORY_KINDS]
        if bad:
            raise ConfigError(f"memory.{role}_offload has {bad}: allowed kinds are {', '.join(MEMORY_KINDS)}")
    for role in ("ref", "teacher"):  # frozen models: weights only
        absent = [k for k in getattr(m, f"{role}_offload") if k != "params"]
        if absent:
            raise ConfigError(f"memory.{role}_offload has {absent}: the {role} model has no gradients or optimizer "
                              "state, only 'params' applies; remove the others")
    from spmdrl.dist.layout import role_backends

    backends = role_backends(cfg)
    for role in ("actor", "critic"):
        if getattr(m, f"{role}_host_optimizer") and backends[role] != "megatron":
            raise ConfigError(f"memory.{role}_host_optimizer needs the Megatron backend (the {role} trains on "
                              f"{backends[role]}); for FSDP2 use memory.{role}_offload = [\"optimizer\", \"grads\"] "
                              f"or set trainer.backend = \"megatron\"")
    for key in ("gpu_memory_gb", "host_memory_gb", "gpus_per_node", "nodes"):
        if not getattr(m, key) > 0:
            raise ConfigError(f"memory.{key} must be > 0, found {getattr(m, key)}")
    if not 0 < m.margin <= 1:
        raise ConfigError(f"memory.margin must be in (0, 1], found {m.margin}")


def hf_config_json(path: str) -> dict | None:
    """A model's config.json as a dict, read without loading anything: from a local model directory, a bundled
    copy of a published config (spmdrl/model_configs), or the HF cache. None when none of them has it (a path
    that does not exist, which preflight names; a hub id not downloaded yet)."""
    import json
    import os

    full = os.path.expanduser(path)
    if os.path.isdir(full):
        found = os.path.join(full, "config.json")
    elif full.startswith(("/", ".", "~")) or os.path.exists(full):
        return None
    else:  # a hub id
        from spmdrl.models.model import BUNDLED

        found = os.path.join(BUNDLED, path.replace("/", "--") + ".json")
        if not os.path.isfile(found):
            from huggingface_hub import try_to_load_from_cache

            try:
                cached = try_to_load_from_cache(path, "config.json")
            except ValueError:  # not a valid hub id either: preflight names it
                return None
            found = cached if isinstance(cached, str) else ""
    try:
        with open(found, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # missing or unreadable: preflight names it
    return data if isinstance(data, dict) else None


def hf_model_type(path: str) -> str | None:
    """The model_type in a model's config.json (hf_config_json), None where it is not readable."""
    model_type = (hf_config_json(path) or {}).get("model_type")
    return model_type if isinstance(model_type, str) else None


def validate_architecture(cfg) -> None:
    """The weight path's architecture guards, from the models' config.json (when it is on disk):
    * transformers must know the architecture (the training engines build AutoModelForCausalLM), and so must vLLM
      when it is the rollout engine (any architecture both load syncs: the blocks each vLLM rank needs are learnt
      from vLLM's own loaders, reshard/vllm_reads.py, and a parameter they cannot tell goes whole);
    * the Megatron backend converts MEGATRON_MODEL_TYPES only (its engine refuses others at build, minutes later).
    A hub id whose config is not on disk yet is checked when the engines load it."""
    from spmdrl.dist.layout import role_backends
    from spmdrl.dist.blocks import MEGATRON_MODEL_TYPES
    from spmdrl.rollout import vllm_available

    backends = role_backends(cfg)
    vllm = cfg.rollout.engine == "vllm" or (cfg.rollout.engine == "auto" and vllm_available())
    # (key, path, vLLM loads it, built by the Megatron backend, the roles built from it)
    checks = [("model.path", cfg.model.path, vllm, backends["actor"] == "megatron",
               ("actor", "ref") if builds_ref(cfg) else ("actor",))]  # and the rollout
    if cfg.critic.enable and backends["critic"] == "megatron":
        checks.append(("critic.path" if cfg.critic.path else "model.path", cfg.critic.path or cfg.model.path, False, True,
                       ("critic",)))
    if distills(cfg):  # the teacher: a training backend builds it, vLLM never loads it
        checks.append(("distill.teacher_path", cfg.distill.teacher_path, False, backends["teacher"] == "megatron",
                       ("teacher",)))
    for key, path, vllm_loads, megatron, roles in checks:
        hf = hf_config_json(path)
        if hf is None:
            continue
        source = f"{key} = {path!r}"
        _check_vision_language(cfg, source, hf.get("model_type"), megatron, vllm_loads)
        check_architecture_known(hf, source, vllm=vllm_loads)
        model_type = hf["model_type"]
        if megatron:
            _check_megatron_experts(cfg, source, hf, roles)
        if key == "model.path":
            _check_moe_layout(cfg, source, hf, fsdp=not megatron)
        if not megatron and key == "model.path":
            _check_fsdp_tp_heads(cfg, source, hf)
            _check_fsdp_tp_modules(cfg, source, path)
        if not megatron and key == "distill.teacher_path":
            _check_fsdp_tp_heads(cfg, source, hf, roles=("teacher",))
        if megatron and model_type not in MEGATRON_MODEL_TYPES:
            raise ConfigError(
                f"{source} is a {model_type!r} model (config.json model_type), but the Megatron backend converts "
                f"{', '.join(MEGATRON_MODEL_TYPES)} only; use trainer.backend = 'fsdp' (trainer.critic_backend for the "
                "critic) or a model of one of those architectures"
            )


def no_vision_tower(key: str, source: str, model_type: str) -> str:
    """The refusal of `key` (a switch about the vision tower) on a text model; RL validation and `spmdrl sft` raise
    it."""
    return f"{key} = true: {source} is a {model_type!r} text model without a vision tower; set it to false"


def _check_vision_language(cfg, source: str, model_type: str, megatron: bool, vllm: bool) -> None:
    """A vision-language model (engines/loading.py VISION_LANGUAGE) trains on the FSDP2 backend with the transformers
    rollout engine (vLLM 0.32 builds one only with torchvision installed: its Qwen-VL modules import transformers'
    torchvision image processors); actor.freeze_vision_tower needs one."""
    import importlib.util

    from spmdrl.models.vision import VISION_LANGUAGE

    if model_type not in VISION_LANGUAGE:
        if cfg.actor.freeze_vision_tower and source.startswith("model.path"):
            raise ConfigError(no_vision_tower("actor.freeze_vision_tower", source, model_type))
        return
    if megatron:
        raise ConfigError(f"{source} is a vision-language model ({model_type}); the Megatron backend trains text models "
                          "only: set trainer.backend = 'fsdp'")
    # the images travel with the batch on the rank that sampled it (Batch.meta), through one generate call
    for key, on in (("placement.mode = 'split'", cfg.placement.mode == "split"),
                    ("multi_turn.enable = true", cfg.multi_turn.enable),
                    (f"rollout.partial = {cfg.rollout.partial!r}", cfg.rollout.partial != "off")):
        if on and source.startswith("model.path"):
            raise ConfigError(f"{key}: {source} is a vision-language model ({model_type}), whose images go through "
                              "colocated single-turn rollouts only for now; unset it")
    if vllm:
        why = ("vLLM 0.32 builds it only with torchvision installed, which the CPU install removes, and "
               if importlib.util.find_spec("torchvision") is None else "")
        raise ConfigError(f"{source} is a vision-language model ({model_type}): {why}spmdrl hands images to the "
                          "transformers rollout engine only; set rollout.engine = 'hf'")


PARQUET_FILES = "one or more parquet files in verl's schema"


def require_model_path(cfg) -> None:
    """model.path set (RL training, evaluation and SFT alike)."""
    if not cfg.model.path:
        raise ConfigError("model.path is empty; set it to an HF model directory or hub id")


def validate_moe_options(cfg) -> None:
    """actor.router_replay = "rollout" and the router loss coefficients (actor.moe_aux_loss_coef, moe_z_loss_coef)
    need a mixture-of-experts model (from its config.json when it is on disk); both training backends run them.
    Replay also needs a rollout engine that returns routes (vLLM; the transformers engine returns none); single-
    and multi-turn rollouts both carry them."""
    from spmdrl.rollout import vllm_available

    a = cfg.actor
    asked = [k for k, on in (("router_replay", replays_routes(cfg)), ("moe_aux_loss_coef", a.moe_aux_loss_coef),
                             ("moe_z_loss_coef", a.moe_z_loss_coef)) if on]
    if not asked:
        return
    key = f"actor.{asked[0]} = {getattr(a, asked[0])!r}"
    hf = hf_config_json(cfg.model.path)
    if hf is not None and not (hf.get("num_experts") or hf.get("num_local_experts")):
        raise ConfigError(f"{key}: model.path = {cfg.model.path!r} is a dense {hf.get('model_type')!r} model (no "
                          f"num_experts in config.json), which has no router; reset actor.{asked[0]}")
    _check_megatron_router_pipeline(cfg, asked)
    if not replays_routes(cfg):
        return
    key = f"actor.router_replay = {a.router_replay!r}"
    engine = cfg.rollout.engine if cfg.rollout.engine != "auto" else ("vllm" if vllm_available() else "hf")
    if engine != "vllm":
        raise ConfigError(f"{key}: rollout.engine = {cfg.rollout.engine!r} resolves to the transformers engine, which "
                          "cannot return the experts it routed each token to; use rollout.engine = 'vllm'")


def _check_megatron_router_pipeline(cfg, asked: list[str]) -> None:
    """The Megatron engine's refusals of the router options in its layout (config/derived.py), before launch."""
    from spmdrl.dist.layout import role_backends

    if role_backends(cfg)["actor"] != "megatron":
        return
    m, losses = cfg.model, [k for k in asked if k != "router_replay"]
    full = m.gradient_checkpointing and m.checkpoint_policy == "full"
    why = megatron_router_refusal("actor", cfg.placement.actor_pp, replay="router_replay" in asked,
                                  losses=bool(losses), full_recompute=full,
                                  losses_key=f"actor.{losses[0]} = {getattr(cfg.actor, losses[0])!r}" if losses else "")
    if why:
        raise ConfigError(why)


def check_architecture_known(hf: dict, source: str, *, vllm: bool) -> None:
    """ConfigError unless transformers knows config.json's model_type (and vLLM one of its architectures, when it
    is the rollout engine)."""
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{source}: config.json has no model_type, so neither transformers nor vLLM can tell which "
                          "architecture to build; add the model_type its family uses (e.g. \"qwen3\")")
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{source} is a {model_type!r} model (config.json model_type), which this transformers "
                          f"does not know; upgrade transformers or use a model of an architecture it supports")
    if vllm:
        from vllm.model_executor.models import ModelRegistry

        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        # a config.json without architectures (saved from a bare config): the causal LM class of its model_type
        archs = hf.get("architectures") or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")]
        if not any(a in ModelRegistry.get_supported_archs() for a in archs):
            raise ConfigError(
                f"{source}: vLLM does not support its architectures {archs} (config.json); use rollout.engine = 'hf' "
                "(the transformers engine, whole tensors, slow) or a model vLLM can load")


def _check_fsdp_tp_modules(cfg, source: str, path: str) -> None:
    """FSDP2 + DTensor TP shards the decoder's q/k/v/o and gate/up/down projections by name
    (engines/fsdp.py tp_plan): a model without them (fused q/k/v as in Phi-3 or Falcon) trains at actor_tp = 1."""
    if cfg.placement.actor_tp <= 1:
        return
    from spmdrl.dist.blocks import TP_MODULES

    have = _decoder_linear_layers(path)
    missing = [m for m in TP_MODULES if have and m not in have]
    if missing:
        raise ConfigError(f"placement.actor_tp = {cfg.placement.actor_tp}: {source} has no {', '.join(missing)} "
                          f"layers (its decoder's linear layers are {', '.join(have)}), which the DTensor TP plan "
                          "shards by name; set placement.actor_tp = 1 (FSDP2 alone) for this model")


def hf_experts(hf: dict) -> tuple[int, int]:
    """(experts, expert FFN width) of a config.json: num_experts (Qwen-MoE) or num_local_experts (Mixtral), and
    moe_intermediate_size where the experts have their own width (else intermediate_size); (0, 0) when dense."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    return (experts, hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 0) if experts else (0, 0)


def megatron_moe_problem(hf: dict) -> str | None:
    """Why the Megatron backend cannot build a mixture of experts of this config.json (None when it can): dense MLP
    layers among the MoE layers of a Qwen-MoE (transformers builds layer i dense when it is in mlp_only_layers or
    when i + 1 is not a multiple of decoder_sparse_step; the backend builds every layer as a MoE layer), or a
    Qwen2-MoE without a shared expert (shared_expert_intermediate_size 0)."""
    if hf.get("model_type") not in ("qwen2_moe", "qwen3_moe"):
        return None
    if not hf_experts(hf)[0]:
        return (f"this {hf['model_type']} model has num_experts = {hf.get('num_experts')} (every layer a dense MLP), "
                "which the Megatron backend does not convert; use trainer.backend = 'fsdp' for this model")
    step, only = hf.get("decoder_sparse_step", 1) or 1, list(hf.get("mlp_only_layers") or [])
    dense = sorted(set(only) | {i for i in range(hf.get("num_hidden_layers", 0)) if (i + 1) % step})
    if dense:
        return (f"layers {dense} of this {hf['model_type']} model are dense MLP layers (decoder_sparse_step = {step}, "
                f"mlp_only_layers = {only}), and the Megatron backend builds every layer as a MoE layer; use "
                "trainer.backend = 'fsdp' for this model")
    if hf["model_type"] == "qwen2_moe" and not hf.get("shared_expert_intermediate_size", 1):
        return ("this qwen2_moe model has no shared expert (shared_expert_intermediate_size = 0), which the Megatron "
                "backend does not build; use trainer.backend = 'fsdp' for this model")
    return None


def _check_megatron_experts(cfg, source: str, hf: dict, roles: tuple[str, ...]) -> None:
    """A Megatron role's expert layout against its model (dist.layout.plan_layout has checked ep against dp and
    pp): a mixture of experts the backend builds (megatron_moe_problem); expert parallelism needs experts, and an
    expert count it divides; megatron's expert tensor parallelism (= tp) splits each expert's FFN width, and tensor
    parallelism a shared expert's width (Qwen2-MoE), which tp must divide. A mixture of experts on a GPU trains
    with the host optimizer: memory.<role>_host_optimizer = false is refused
    (config.derived.megatron_host_optimizer)."""
    experts, ffn = hf_experts(hf)
    for role in roles:
        setting = getattr(cfg.memory, f"{role}_host_optimizer", None)
        if experts and setting is False and cfg.trainer.device != "cpu":  # the engine refuses it at build, too
            raise ConfigError(f"{source}: {moe_distributed_optimizer_refusal(role, experts)}")
    problem = megatron_moe_problem(hf)
    if problem:
        raise ConfigError(f"trainer.backend = 'megatron': {source}: {problem}")
    shared = (hf.get("shared_expert_intermediate_size") or 0) if experts else 0
    p = cfg.placement
    for role in roles:
        ep, tp = getattr(p, f"{role}_ep"), getattr(p, f"{role}_tp")
        if ep > 1 and not experts:
            raise ConfigError(f"placement.{role}_ep = {ep}: {source} is a dense {hf.get('model_type')!r} model (no "
                              f"num_experts in config.json), which has no experts to split; set {role}_ep = 1")
        if experts and experts % ep:
            raise ConfigError(f"placement.{role}_ep = {ep}: {source} has {experts} experts, which {ep} expert-parallel "
                              f"ranks cannot split evenly; choose a {role}_ep that divides {experts}")
        if experts and ffn % tp:
            raise ConfigError(f"placement.{role}_tp = {tp}: {source}'s experts have an FFN width of {ffn}, which the "
                              f"Megatron backend's expert tensor parallelism cannot split over {tp} ranks; choose a "
                              f"{role}_tp that divides {ffn}")
        if shared % tp:
            raise ConfigError(f"placement.{role}_tp = {tp}: {source}'s shared expert has an FFN width of {shared} "
                              f"(shared_expert_intermediate_size), which the Megatron backend's tensor parallelism "
                              f"cannot split over {tp} ranks; choose a {role}_tp that divides {shared}")


def _check_moe_layout(cfg, source: str, hf: dict, fsdp: bool) -> None:
    """On the FSDP2 backend a mixture of experts trains with its experts whole on each shard (DTensor TP does not
    shard its fused expert tensors); on either backend vLLM's TP must leave every rank an expert."""
    experts, _ = hf_experts(hf)
    if cfg.rollout.expert_parallel:
        _check_rollout_expert_parallel(cfg, source, hf, experts)
    if not experts:
        return
    if fsdp and cfg.placement.actor_tp > 1:
        raise ConfigError(f"placement.actor_tp = {cfg.placement.actor_tp}: {source} is a mixture of experts "
                          f"({experts} experts), whose fused expert tensors FSDP2 + DTensor TP does not shard; "
                          "set placement.actor_tp = 1 (experts train whole on each FSDP2 shard) or trainer.backend = "
                          "'megatron' (expert and tensor parallelism)")
    rollout_tp = cfg.placement.rollout_tp
    if rollout_tp > experts:
        raise ConfigError(f"placement.rollout_tp = {rollout_tp}: {source} has {experts} experts, fewer than the "
                          "rollout tensor-parallel degree; choose a rollout_tp of at most the expert count")


def _check_rollout_expert_parallel(cfg, source: str, hf: dict, experts: int) -> None:
    """rollout.expert_parallel: vLLM's expert parallelism, for a mixture of experts on vLLM on a GPU (`spmdrl plan`
    plans it from any machine)."""
    from spmdrl.config.derived import uses_vllm
    from spmdrl.rollout.vllm_engine import CPU_EXPERT_PARALLEL

    key = "rollout.expert_parallel = true"
    if not experts:
        raise ConfigError(f"{key}: {source} is a dense {hf.get('model_type')!r} model with no experts to split; "
                          "leave it false")
    if not uses_vllm(cfg):
        raise ConfigError(f"{key} is vLLM's expert parallelism; set rollout.engine = 'vllm' or leave it false")
    if cfg.trainer.device == "cpu":  # with "auto" the engine refuses it at build on a machine without a GPU
        raise ConfigError(f"{key}: {CPU_EXPERT_PARALLEL}")


def _check_fsdp_tp_heads(cfg, source: str, hf: dict, roles=("actor", "ref", "critic")) -> None:
    """FSDP2 + DTensor TP shards q/k/v by heads: every TP rank must hold whole heads of each (HF's attention
    reshapes a shard into [-1, head_dim] and would fail at the first forward, after vLLM is built)."""
    from spmdrl.dist.layout import role_backends

    backends = role_backends(cfg)
    heads, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads", hf.get("num_attention_heads"))
    if not isinstance(heads, int) or not isinstance(kv, int):
        return
    p = cfg.placement
    from spmdrl.dist.layout import sp_head_problem

    for role in ("actor", "ref", "critic"):
        sp = getattr(p, f"{role}_sp")
        why = sp_head_problem(heads, kv, sp) if backends.get(role) == "fsdp" else None
        if why:
            raise ConfigError(f"placement.{role}_sp = {sp}: {source} has {why}; choose an sp that divides "
                              f"{heads} (and a multiple or divisor of {kv})")
    for role in roles:
        tp = getattr(p, f"{role}_tp")
        if backends.get(role) == "fsdp" and tp > 1 and (heads % tp or kv % tp):
            raise ConfigError(
                f"placement.{role}_tp = {tp}: {source} has {heads} attention heads and {kv} key/value heads, and the "
                f"FSDP2 backend's tensor parallelism needs both divisible by the tp size; use a tp that divides {kv} "
                "(more data parallelism instead)"
            )


def validate_tools(cfg) -> None:
    """The [multi_turn] tool settings, and the tools themselves: with multi_turn.enable every spec in
    multi_turn.tools is loaded here (user code imported, schemas derived, the sandbox's interpreter tried), so a
    bad spec fails before any process group or engine exists."""
    mt = cfg.multi_turn
    for key in ("tool_timeout_s", "max_parallel_calls", "max_calls_per_turn", "sandbox_timeout_s", "sandbox_cpu_s",
                "sandbox_file_mb", "sandbox_processes", "sandbox_output_chars", "http_exec_timeout_s"):
        if not getattr(mt, key) > 0:
            raise ConfigError(f"multi_turn.{key} must be > 0, found {getattr(mt, key)}")
    if mt.sandbox_memory_mb < 64:
        raise ConfigError(f"multi_turn.sandbox_memory_mb must be >= 64 (a Python interpreter needs that much address "
                          f"space to start), found {mt.sandbox_memory_mb}")
    for tool, key in (("python", "sandbox_timeout_s"), ("http_exec", "http_exec_timeout_s")):
        if tool in mt.tools and getattr(mt, key) >= mt.tool_timeout_s:
            raise ConfigError(
                f"multi_turn.{key} = {getattr(mt, key)} must be below multi_turn.tool_timeout_s = {mt.tool_timeout_s} "
                f"(the {tool} tool's own limit should end a run, so its message reaches the model); lower it or raise "
                "tool_timeout_s"
            )
    if mt.enable:
        from spmdrl.tools.registry import KEY, load_tools
        from spmdrl.usercheck import check_loadable

        # first in a throwaway process: a file that ends its process at import (os._exit) would end this one silently
        check_loadable([(KEY, spec) for spec in mt.tools if isinstance(spec, str) and ":" in spec], mt)
        load_tools(mt.tools, mt)
