"""verl's config keys (ppo_trainer.yaml, the ones users set most) and their spmdrl names: the key map behind
docs/verl.md's table, the hint a verl-style key on the command line gets, and `spmdrl config from-verl`, which
converts a verl command line (Hydra overrides) or YAML into an spmdrl TOML config.
"""
from __future__ import annotations

from typing import Any

from spmdrl.errors import ConfigError

ARR = "actor_rollout_ref"
# verl key -> spmdrl key (a value converted as is), or None with the reason in NOT_CONVERTED
KEY_MAP: dict[str, str | None] = {
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "data.prompt_key": "data.prompt_key",
    "data.image_key": "data.image_key",
    "data.max_prompt_length": "data.max_prompt_length",
    "data.max_response_length": "data.max_response_length",
    "data.truncation": "data.truncation",
    "data.shuffle": "data.shuffle",
    "data.filter_overlong_prompts": "data.filter_overlong",
    "data.train_batch_size": "data.train_batch_size",
    "data.val_batch_size": "data.val_batch_size",
    "data.return_raw_chat": None,
    f"{ARR}.model.path": "model.path",
    f"{ARR}.model.trust_remote_code": "model.trust_remote_code",
    f"{ARR}.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    f"{ARR}.model.use_remove_padding": "actor.use_packing",
    f"{ARR}.model.lora_rank": "lora.rank",
    f"{ARR}.model.lora_alpha": "lora.alpha",
    f"{ARR}.model.target_modules": "lora.target_modules",
    f"{ARR}.actor.optim.lr": "actor.lr",
    f"{ARR}.actor.optim.lr_warmup_steps": "actor.warmup_steps",
    f"{ARR}.actor.optim.weight_decay": "actor.weight_decay",
    f"{ARR}.actor.optim.min_lr_ratio": "actor.min_lr_ratio",
    f"{ARR}.actor.optim.lr_scheduler_type": "actor.lr_scheduler",
    f"{ARR}.actor.grad_clip": "actor.grad_clip",
    f"{ARR}.actor.ppo_epochs": "actor.ppo_epochs",
    f"{ARR}.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    f"{ARR}.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    f"{ARR}.actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    f"{ARR}.actor.use_dynamic_bsz": None,
    f"{ARR}.actor.clip_ratio_low": "actor.clip_ratio_low",
    f"{ARR}.actor.clip_ratio_high": "actor.clip_ratio_high",
    f"{ARR}.actor.clip_ratio_c": "actor.clip_ratio_c",
    f"{ARR}.actor.loss_agg_mode": "actor.loss_agg_mode",
    f"{ARR}.actor.entropy_coeff": "actor.entropy_coeff",
    f"{ARR}.actor.policy_loss.loss_mode": "actor.policy_loss",
    f"{ARR}.actor.use_kl_loss": "actor.use_kl_loss",
    f"{ARR}.actor.kl_loss_coef": "actor.kl_loss_coef",
    f"{ARR}.actor.kl_loss_type": "actor.kl_loss_type",
    f"{ARR}.actor.fsdp_config.param_offload": "memory.actor_offload",
    f"{ARR}.actor.fsdp_config.optimizer_offload": "memory.actor_offload",
    f"{ARR}.actor.megatron.tensor_model_parallel_size": "placement.actor_tp",
    f"{ARR}.actor.megatron.pipeline_model_parallel_size": "placement.actor_pp",
    f"{ARR}.ref.fsdp_config.param_offload": "memory.ref_offload",
    f"{ARR}.ref.log_prob_micro_batch_size_per_gpu": "ref.micro_batch_size",
    f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu": "actor.forward_micro_batch_size",
    f"{ARR}.rollout.name": "rollout.engine",
    f"{ARR}.rollout.n": "rollout.n",
    f"{ARR}.rollout.temperature": "rollout.temperature",
    f"{ARR}.rollout.top_p": "rollout.top_p",
    f"{ARR}.rollout.top_k": "rollout.top_k",
    f"{ARR}.rollout.val_kwargs.temperature": "rollout.val_temperature",
    f"{ARR}.rollout.val_kwargs.top_p": "rollout.val_top_p",
    f"{ARR}.rollout.val_kwargs.n": "rollout.val_n",
    f"{ARR}.rollout.tensor_model_parallel_size": "placement.rollout_tp",
    f"{ARR}.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    f"{ARR}.rollout.enforce_eager": "rollout.enforce_eager",
    f"{ARR}.rollout.max_num_seqs": "rollout.max_num_seqs",
    f"{ARR}.rollout.max_num_batched_tokens": "rollout.max_num_batched_tokens",
    f"{ARR}.rollout.free_cache_engine": "rollout.enable_sleep_mode",
    f"{ARR}.rollout.load_format": "rollout.load_format",
    f"{ARR}.rollout.mode": None,
    f"{ARR}.rollout.multi_turn.enable": "multi_turn.enable",
    f"{ARR}.rollout.multi_turn.max_assistant_turns": "multi_turn.max_turns",
    f"{ARR}.rollout.multi_turn.format": "multi_turn.format",
    "critic.model.path": "critic.path",
    "critic.optim.lr": "critic.lr",
    "critic.optim.lr_warmup_steps": "critic.warmup_steps",
    "critic.optim.weight_decay": "critic.weight_decay",
    "critic.grad_clip": "critic.grad_clip",
    "critic.ppo_epochs": "critic.ppo_epochs",
    "critic.cliprange_value": "critic.cliprange_value",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size",
    "critic.fsdp_config.param_offload": "memory.critic_offload",
    "critic.fsdp_config.optimizer_offload": "memory.critic_offload",
    "reward_model.enable": None,
    "reward_model.model.path": "reward.model_path",
    "reward_model.micro_batch_size_per_gpu": "reward.model_micro_batch_size",
    "reward_model.reward_manager": None,
    "reward_model.overlong_buffer.len": "reward.overlong_buffer_len",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_penalty_factor",
    "custom_reward_function.path": "reward.custom_fn",
    "custom_reward_function.name": "reward.custom_fn",
    "algorithm.adv_estimator": "algorithm.adv_estimator",
    "algorithm.gamma": "algorithm.gamma",
    "algorithm.lam": "algorithm.lam",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "algorithm.use_kl_in_reward": "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty": "algorithm.kl_penalty",
    "algorithm.kl_ctrl.type": "algorithm.kl_ctrl",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_horizon",
    "algorithm.filter_groups.enable": "algorithm.filter_groups",
    "algorithm.filter_groups.metric": "algorithm.filter_metric",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.max_sample_rounds",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.total_epochs": "trainer.total_epochs",
    "trainer.critic_warmup": "trainer.critic_warmup",
    "trainer.test_freq": "trainer.test_freq",
    "trainer.val_before_train": "trainer.val_before_train",
    "trainer.val_only": None,
    "trainer.save_freq": "checkpoint.save_freq",
    "trainer.max_actor_ckpt_to_keep": "checkpoint.keep_last",
    "trainer.resume_mode": "checkpoint.resume",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.project_name": "logging.project",
    "trainer.experiment_name": "trainer.experiment_name",
    "trainer.logger": "logging.backends",
    "trainer.log_val_generations": "logging.log_generations",
    "trainer.rollout_data_dir": "logging.dump_rollouts",
    "trainer.n_gpus_per_node": None,
    "trainer.nnodes": None,
    "trainer.device": "trainer.device",
    "trainer.seed": "trainer.seed",
}
NOT_CONVERTED = {
    "data.return_raw_chat": "spmdrl keeps the raw chat of every prompt",
    f"{ARR}.actor.use_dynamic_bsz": "set actor.max_tokens_per_micro_batch (its token budget) instead",
    f"{ARR}.rollout.mode": "rollout is in-process vLLM",
    "reward_model.enable": "reward.model_path set means on",
    "reward_model.reward_manager": "overlong shaping is reward.overlong_buffer_len; no manager to pick",
    "trainer.val_only": "run `spmdrl eval --config F` instead",
    "trainer.n_gpus_per_node": "pass --nproc N to spmdrl train (torchrun --nproc-per-node)",
    "trainer.nnodes": "launch on each node (docs/cluster.md); memory.nodes for `spmdrl plan`",
}
SHOWN = {  # how docs/verl.md shows a key whose conversion is more than a rename
    f"{ARR}.model.lora_rank": "`lora.enable = true`, `lora.rank` ([lora](lora.md))",
    f"{ARR}.model.use_remove_padding": "`actor.use_packing`, `critic.use_packing` (on by default)",
    f"{ARR}.actor.ppo_max_token_len_per_gpu": "`actor.max_tokens_per_micro_batch` (default -1: with packing, "
                                              "`micro_batch_size` x the longest sequence; 0 = off)",
    f"{ARR}.actor.fsdp_config.param_offload": "`memory.actor_offload` gets `\"params\"`",
    f"{ARR}.actor.fsdp_config.optimizer_offload": "`memory.actor_offload` gets `\"optimizer\"`, `\"grads\"`",
    f"{ARR}.actor.megatron.tensor_model_parallel_size": "`placement.actor_tp` with `trainer.backend = \"megatron\"` "
                                                        "([megatron](megatron.md))",
    f"{ARR}.ref.fsdp_config.param_offload": "`memory.ref_offload = [\"params\"]` (or `ref.offload = true`)",
    f"{ARR}.actor.policy_loss.loss_mode": "`actor.policy_loss` (`vanilla` is `ppo`; [algorithms](algorithms.md))",
    f"{ARR}.rollout.name": "`rollout.engine` (vllm, or hf: transformers)",
    "critic.model.path": "`critic.path` (and `critic.enable = true`, set by the converter for `gae`)",
    "critic.fsdp_config.param_offload": "`memory.critic_offload` gets `\"params\"`",
    "critic.fsdp_config.optimizer_offload": "`memory.critic_offload` gets `\"optimizer\"`, `\"grads\"`",
    "custom_reward_function.path": "`reward.custom_fn = \"path.py:name\"` ([rewards](rewards.md); several: `reward.custom_fns`)",
    "custom_reward_function.name": "`reward.custom_fn = \"path.py:name\"` (default name `compute_score`)",
    "trainer.resume_mode": "`checkpoint.resume` (`disable` is `off`)",
    "trainer.logger": "`logging.backends` (wandb, mlflow; the console line is always there, tensorboard and jsonl by "
                      "default; [metrics](metrics.md))",
    "trainer.log_val_generations": "`logging.log_generations` (also per training step; generations.jsonl and trackers)",
    "trainer.rollout_data_dir": "`logging.dump_rollouts = true` (to `trainer.output_dir/rollouts/`)",
    "trainer.total_epochs": "`trainer.total_epochs` (total_steps = epochs x rows / train_batch_size)",
    "trainer.save_freq": "`checkpoint.save_freq` (and `checkpoint.save_every_min`, 30 by default)",
}


def key_table() -> str:
    """docs/verl.md's key table: every verl key of KEY_MAP, one row each."""
    rows = ["| verl key | spmdrl |", "| --- | --- |"]
    for verl, key in KEY_MAP.items():
        shown = SHOWN.get(verl) or (f"`{key}`" if key else f"not converted: {NOT_CONVERTED[verl]}")
        rows.append(f"| `{verl}` | {shown} |")
    return "\n".join(rows)


CHOICES = {  # verl values that spmdrl spells differently
    "rollout.engine": {"sglang": None, "vllm": "vllm", "hf": "hf"},
    "checkpoint.resume": {"auto": "auto", "disable": "off", "resume_path": None},
    "actor.policy_loss": {"vanilla": "ppo"},
}


def spmdrl_key(verl_key: str) -> str | None:
    """The spmdrl key of a verl key (a leading `+` dropped), or None when verl's key is unknown here."""
    return KEY_MAP.get(verl_key.lstrip("+"))


def override_hint(key: str) -> str:
    """What to say to a verl-style `key` given as an spmdrl override."""
    verl = key.lstrip("+")
    if verl in KEY_MAP:
        name = KEY_MAP[verl]
        return (f"that is verl's key; spmdrl's is {name}" if name else f"that is verl's key; {NOT_CONVERTED[verl]}") + \
            " (docs/verl.md; `spmdrl config from-verl` converts a whole verl command line)"
    return "spmdrl keys are section.key (e.g. actor.lr=1e-6); coming from verl, see docs/verl.md or `spmdrl config from-verl`"


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _value(text: str):
    """A Hydra override's value: a number, True/False/null, a list, else the text."""
    import yaml

    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def convert(items: dict[str, Any], quiet: set[str] = frozenset()) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """verl keys -> ({section: {key: value}} for spmdrl, comment lines on what was not converted). Keys in
    `quiet` (a YAML's, most at verl's defaults) are counted, not listed, when spmdrl has no name for them."""
    out: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    reward_fn = {}

    def put(key: str, value) -> None:
        sec, name = key.split(".")
        out.setdefault(sec, {})[name] = value

    unknown_quiet = 0
    for verl, value in items.items():
        verl = verl.lstrip("+")
        if verl not in KEY_MAP:
            if verl in quiet:
                unknown_quiet += 1
            else:
                notes.append(f"not converted: {verl} = {value!r} (no spmdrl key known; docs/config.md lists them all)")
            continue
        if isinstance(value, str) and value.startswith("${"):
            notes.append(f"not converted: {verl} = {value!r}: an interpolation; set {KEY_MAP[verl]} by hand")
            continue
        key = KEY_MAP[verl]
        if key is None:
            notes.append(f"not converted: {verl} = {value!r}: {NOT_CONVERTED[verl]}")
            continue
        if value is None:
            continue
        if key in CHOICES and isinstance(value, str) and value in CHOICES[key]:
            if CHOICES[key][value] is None:
                notes.append(f"not converted: {verl} = {value!r}: spmdrl has no {key} = {value!r}")
                continue
            value = CHOICES[key][value]
        if verl.startswith("custom_reward_function."):
            reward_fn[verl.rpartition(".")[2]] = value
        elif key.startswith("memory.") and key.endswith("_offload"):
            if value is True:
                kinds = out.get("memory", {}).get(key.split(".")[1], [])
                kind = "params" if verl.endswith("param_offload") else "optimizer"
                put(key, sorted(set(kinds) | {kind} | ({"grads"} if kind == "optimizer" else set())))
        elif key == "lora.rank":
            if value:
                put("lora.enable", True)
                put(key, value)
        elif key == "logging.backends":
            backends = [b for b in (value if isinstance(value, list) else [value]) if b in ("wandb", "mlflow", "tensorboard")]
            put(key, ["tensorboard", "jsonl", *[b for b in backends if b != "tensorboard"]])
        elif key == "logging.dump_rollouts":
            put(key, bool(value))
            notes.append(f"{verl} = {value!r}: the samples go to trainer.output_dir/rollouts/")
        elif key == "trainer.total_steps" and value is None:
            continue
        else:
            put(key, value)
    if unknown_quiet:
        notes.append(f"{unknown_quiet} other keys of the YAML have no spmdrl name (most are verl defaults)")
    if reward_fn:
        put("reward.custom_fn", f"{reward_fn.get('path', '')}:{reward_fn.get('name') or 'compute_score'}")
    if out.get("algorithm", {}).get("adv_estimator") == "gae":
        put("critic.enable", True)
    return out, notes


def from_verl(args: list[str], yaml_path: str | None = None) -> tuple[dict, list[str]]:
    """Read verl's YAML (optional) and Hydra overrides `a.b.c=v` (later wins) and convert them."""
    items: dict[str, Any] = {}
    if yaml_path:
        import yaml

        try:
            with open(yaml_path, encoding="utf-8") as f:
                tree = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{yaml_path}: cannot be read as YAML ({' '.join(str(e).split())[:200]})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{yaml_path}: a verl config is a YAML mapping, found {type(tree).__name__}")
        items.update(_flatten(tree))
    quiet = set(items)
    for arg in args:
        if arg.startswith(("python", "-m", "verl.")) or "=" not in arg:
            continue  # the command itself (python3 -m verl.trainer.main_ppo)
        key, _, text = arg.partition("=")
        items[key.lstrip("+")] = _value(text)
        quiet.discard(key.lstrip("+"))
    return convert(items, quiet)
