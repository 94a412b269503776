"""What a config means: the facts the loop, the engines and `spmdrl plan` derive from it, each derived here once.

Pure functions of the config (and, where it matters, of whether the run is on a GPU); no validation (that is
config/validate.py) and nothing built.
"""
from __future__ import annotations

# every offloadable kind of every training role in host memory between phases: `spmdrl plan`'s last resort
FULL_OFFLOAD = {"memory.actor_offload": ["params", "optimizer", "grads"],
                "memory.critic_offload": ["params", "optimizer", "grads"], "memory.ref_offload": ["params"]}


def uses_ref(cfg) -> bool:
    """Whether the run needs the reference policy's log-probs (a KL loss or a KL penalty in the reward)."""
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def builds_ref(cfg) -> bool:
    """Whether the run builds a ref model: it needs the reference policy and the actor is not LoRA (whose
    reference is the actor with its adapters disabled)."""
    return uses_ref(cfg) and not cfg.lora.enable


def distills(cfg) -> bool:
    """Whether the run distils a teacher into the actor (distill.teacher_path set): a teacher model is built."""
    return bool(cfg.distill.teacher_path)


def on_policy(cfg) -> bool:
    """Whether the update's own log-probs are the old ones: one epoch over one mini-batch (the whole batch), no
    KL penalty in the reward and no distillation (both need the student's log-probs before the update).
    Off-policy runs compute the old log-probs in a forward pass of their own."""
    a = cfg.actor
    mini = a.ppo_mini_batch_size or cfg.data.train_batch_size
    return (a.ppo_epochs == 1 and mini == cfg.data.train_batch_size and not cfg.algorithm.use_kl_in_reward
            and not distills(cfg))


def sampler_truncates(cfg) -> bool:
    """Whether training rollouts sample from a truncated distribution (top-k or top-p)."""
    return cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0


def rollout_correction_active(cfg) -> bool:
    """Whether the update computes importance weights or a rejection mask (and so needs pi_old before it): the
    [rollout_correction] section's, or decoupled PPO's."""
    rc = cfg.rollout_correction
    return (rc.rollout_is != "none" or rc.rollout_rs != "none" or rc.rollout_token_veto_threshold > 0
            or rc.decoupled)


def rolls_out_trajectories(cfg) -> bool:
    """Whether rollouts are trajectories with holes in the loss mask (multi_turn.enable or agent.enable): the
    batch carries each sample's turns (`trajectory`)."""
    return bool(cfg.multi_turn.enable or cfg.agent.enable)


def uses_vllm(cfg) -> bool:
    """Whether the rollout engine is vLLM (rollout.engine = "vllm", or "auto" where vLLM is installed) rather than
    the transformers fallback; vLLM loads TP shards, the fallback whole tensors."""
    if cfg.rollout.engine == "vllm":
        return True
    if cfg.rollout.engine != "auto":
        return False
    from spmdrl.rollout import vllm_available

    return vllm_available()


def resolve_dtype(name: str, on_gpu: bool) -> str:
    """A dtype setting ("auto", "bfloat16", "float32") as the engines run it: "auto" is bfloat16 on a GPU and
    float32 on CPU."""
    return "bfloat16" if name == "bfloat16" or (name == "auto" and on_gpu) else "float32"


def rollout_dtype_name(cfg, on_gpu: bool) -> str:
    """The rollout engine's dtype (rollout.dtype)."""
    return resolve_dtype(cfg.rollout.dtype, on_gpu)


def compute_dtype_name(cfg, on_gpu: bool) -> str:
    """The training engines' compute dtype (model.dtype)."""
    return resolve_dtype(cfg.model.dtype, on_gpu)


# The trainer-vs-sampler bounds in nats, by precision: float32 when both the training engines and the rollout
# compute in float32 (gaps near 1e-6 there), half otherwise (docs/models.md says what the half bounds rest on).
PARITY_TOL = {"float32": 1e-3, "half": 0.5}  # the parity check: largest |actor - rollout| log-prob
DIFF_WARN = {"float32": 0.1, "half": 2.0}  # rollout/logprob_diff_max past it: one warning line per run
DIFF_ERROR = {"float32": 0.05, "half": 0.5}  # rollout/logprob_diff_mean past it: the run stops


def _precision(cfg, on_gpu: bool) -> str:
    both = {compute_dtype_name(cfg, on_gpu), rollout_dtype_name(cfg, on_gpu)}
    return "float32" if both == {"float32"} else "half"


def parity_tolerance(cfg, on_gpu: bool) -> float:
    """The parity check's bound on the largest |actor - rollout| log-prob before step 1 (rollout.parity_tol, 0:
    by precision)."""
    return cfg.rollout.parity_tol or PARITY_TOL[_precision(cfg, on_gpu)]


def logprob_diff_bounds(cfg, on_gpu: bool) -> tuple[float, float]:
    """(warning bound on rollout/logprob_diff_max, error bound on rollout/logprob_diff_mean) during training
    (rollout.logprob_diff_warn / logprob_diff_error; 0: by precision; negative: off, returned as inf)."""
    p = _precision(cfg, on_gpu)

    def bound(value: float, default: dict) -> float:
        return float("inf") if value < 0 else (value or default[p])

    return bound(cfg.rollout.logprob_diff_warn, DIFF_WARN), bound(cfg.rollout.logprob_diff_error, DIFF_ERROR)


def offload_kinds(cfg, split: bool = False) -> dict[str, list[str]]:
    """memory.<role>_offload per role: the kinds of state each training engine keeps in host memory between its
    stages. Split placement offloads nothing (nothing shares a device with vLLM); ref.offload (FSDP2
    CPUOffloadPolicy) already keeps the ref on the host."""
    if split:
        return {"actor": [], "critic": [], "ref": [], "teacher": []}
    m = cfg.memory
    return {"actor": m.actor_offload, "critic": m.critic_offload, "ref": [] if cfg.ref.offload else m.ref_offload,
            "teacher": m.teacher_offload}


def lora_settings(cfg):
    """The [lora] section when LoRA is on (lora.enable), else None."""
    lora = getattr(cfg, "lora", None)
    if lora is None or not getattr(lora, "enable", False) or int(getattr(lora, "rank", 0) or 0) <= 0:
        return None
    return lora


def lora_sync_mode(cfg, on_cuda: bool | None = None) -> str | None:
    """How a LoRA actor's updates reach the rollout engine: "adapter" or "merge"; None without LoRA.
    auto: adapter on vLLM on CUDA; merge on the transformers engine and on CPU, where vLLM's LoRA layers run
    generation several times slower than merged weights (docs/lora.md). on_cuda: the run's device (None: any
    trainer.device but "cpu", as `spmdrl plan` reads it)."""
    if lora_settings(cfg) is None:
        return None
    mode = cfg.rollout.lora_sync
    if mode == "auto":
        cuda = cfg.trainer.device != "cpu" if on_cuda is None else on_cuda
        return "adapter" if uses_vllm(cfg) and cuda else "merge"
    return mode


def megatron_host_optimizer(setting: bool | None, role: str, *, on_gpu: bool, experts: int) -> tuple[bool, str]:
    """Whether a Megatron role's optimizer runs in host memory (float32 masters and AdamW moments on the host, the
    step on the CPU: engines/megatron/host_optim.py) rather than megatron's distributed optimizer, and why, in words
    for the log and `spmdrl plan`. memory.<role>_host_optimizer decides when set; unset, a mixture of experts on a
    GPU takes the host optimizer (MOE_DISTRIBUTED_OPTIMIZER says why) and anything else the distributed optimizer.
    On CPU the distributed optimizer never runs (engines/megatron/engine.py). experts: the model's expert count
    (0 for a dense model)."""
    key = f"memory.{role}_host_optimizer"
    if setting is not None:
        return bool(setting), f"{key} = {str(bool(setting)).lower()}"
    if on_gpu and experts:
        return True, (f"{key} unset and the model is a mixture of experts ({experts} experts) on a GPU: "
                      f"{MOE_DISTRIBUTED_OPTIMIZER}")
    return False, f"{key} unset" + ("" if experts else " and the model is dense")


# why a mixture of experts on a GPU does not take megatron's distributed optimizer
MOE_DISTRIBUTED_OPTIMIZER = ("megatron's distributed optimizer keeps the expert parameters in a second optimizer of "
                             "their own, whose state spmdrl's checkpoints do not save")


def moe_distributed_optimizer_refusal(role: str, experts: int) -> str:
    """The one refusal of megatron's distributed optimizer for a mixture of experts (memory.<role>_host_optimizer =
    false on a GPU): config validation raises it before launch, the Megatron engine at build."""
    return (f"memory.{role}_host_optimizer = false with a mixture of experts ({experts} experts) on a GPU: "
            f"{MOE_DISTRIBUTED_OPTIMIZER}; leave memory.{role}_host_optimizer unset (a mixture of experts on a GPU "
            "then trains with the host optimizer) or set trainer.backend = 'fsdp'")


def megatron_router_refusal(role: str, pp: int, *, replay: bool, losses: bool, full_recompute: bool,
                            losses_key: str = "actor.moe_aux_loss_coef / moe_z_loss_coef") -> str:
    """Why the Megatron backend cannot run a mixture of experts' router options in this layout ("" when it can):
    the router losses at pp > 1 (a stage's terms would have to reach the last stage's loss) or under full
    activation recompute (the first forward runs without autograd), routing replay at pp > 1 under full recompute
    (1F1B recomputes a micro-batch after later micro-batches set their routes). Config validation raises it
    before launch, the engine at build. losses_key: how the message names the router loss coefficients."""
    fix = "set model.checkpoint_policy = 'selective' or model.gradient_checkpointing = false"
    if losses and pp > 1:
        return (f"{losses_key}: the Megatron router losses run at pipeline parallelism 1 (placement.{role}_pp = "
                f"{pp}); set the coefficients to 0 or {role}_pp = 1")
    if replay and pp > 1 and full_recompute:
        return (f"actor.router_replay = 'rollout' with placement.{role}_pp = {pp} and full activation recompute: a "
                f"micro-batch's recompute runs after later micro-batches' forwards set their routes; {fix}")
    if losses and full_recompute:
        return (f"{losses_key}: the Megatron router losses need the routers' forward under autograd, which full "
                f"activation recompute defers; {fix}")
    return ""


# ---- batch sizes: every role's mini- and micro-batch, read by the loop, the benchmark and `spmdrl plan` --------
AUTO_BUDGET = -1  # max_tokens_per_micro_batch = -1: the token budget follows the sample split


def mini_batch_prompts(cfg) -> int:
    """Prompts per mini-batch over the world, for the actor's and the critic's updates alike:
    actor.ppo_mini_batch_size, 0 meaning data.train_batch_size (one mini-batch per step)."""
    return cfg.actor.ppo_mini_batch_size or cfg.data.train_batch_size


def micro_batch_samples(cfg, role: str, *, forward: bool = False) -> int:
    """Samples per micro-batch of `role` on one rank. role: actor | critic (update, or with forward=True their
    forward-only passes: old log-probs, values) | ref | teacher (forward-only: ref.micro_batch_size, 0 meaning
    the actor's forward micro-batch)."""
    if role in ("ref", "teacher"):
        return cfg.ref.micro_batch_size or micro_batch_samples(cfg, "actor", forward=True)
    sec = getattr(cfg, role)
    return (getattr(sec, "forward_micro_batch_size", 0) if forward else 0) or sec.micro_batch_size


def micro_batch_limits(cfg, role: str, longest: int, *, forward: bool = False) -> tuple[int, int]:
    """(samples cap, token budget) of `role`'s micro-batches (roles as micro_batch_samples; ref and teacher take
    the actor's forward token budget and packing). longest: the longest possible sequence,
    data.max_prompt_length + data.max_response_length. The automatic budget (-1) with packing is samples x
    longest tokens with no cap on samples: never more tokens than the sample split could hold, and as many short
    sequences as fit; without packing it is the sample split."""
    size = micro_batch_samples(cfg, role, forward=forward)
    sec = cfg.actor if role in ("ref", "teacher") else getattr(cfg, role)
    forward = forward or role in ("ref", "teacher")
    budget = (getattr(sec, "forward_max_tokens_per_micro_batch", 0) if forward else 0) or sec.max_tokens_per_micro_batch
    if budget == AUTO_BUDGET:
        return (0, size * longest) if sec.use_packing else (size, 0)
    return size, budget


def replays_routes(cfg) -> bool:
    """Whether the actor's forwards replay the experts vLLM routed each token to (actor.router_replay =
    "rollout"): vLLM records the routes, the rollout batch carries them and the training engines replay them."""
    return cfg.actor.router_replay == "rollout"
