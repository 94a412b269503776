"""The config tree: one flat dataclass per section, every field with a default and a one-line docstring.

The docstring under each field is the documentation: `docs/config.md` and `spmdrl config show --help`
are generated from it (see `spmdrl.config.docs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    """Prompt datasets in verl's parquet schema."""

    train_files: list[str] = field(default_factory=list)
    """Training parquet (or jsonl) files in verl's schema: data_source, prompt, ability, reward_model, extra_info."""
    val_files: list[str] = field(default_factory=list)
    """Validation files, same schema; empty disables validation."""
    prompt_key: str = "prompt"
    """Column holding the chat messages (list of {role, content})."""
    max_prompt_length: int = 512
    """Longest prompt in tokens, after the chat template."""
    max_response_length: int = 512
    """Longest generated response in tokens (rollout max_tokens)."""
    truncation: str = "error"
    """What to do with a prompt over max_prompt_length: error | left | right | middle."""
    filter_overlong: bool = False
    """Drop prompts over max_prompt_length instead of truncating or failing."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (add_generation_prompt=True)."""
    train_batch_size: int = 8
    """Prompts per RL step, over all ranks (each gets rollout.n samples)."""
    val_batch_size: int = 0
    """Prompts per validation generate call over all ranks; 0 means the whole validation set at once."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (from trainer.seed and the epoch)."""


@dataclass
class ModelConfig:
    """The policy model (actor, ref and rollout load it)."""

    path: str = ""
    """HF model directory or hub id, loaded with AutoModelForCausalLM."""
    tokenizer_path: str = ""
    """Tokenizer directory or hub id; empty means model.path."""
    trust_remote_code: bool = False
    """Pass trust_remote_code to transformers and vLLM."""
    dtype: str = "auto"
    """Parameter dtype for training: auto (bf16 params on CUDA under mixed precision, fp32 on CPU) | float32 | bfloat16."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""


@dataclass
class ActorConfig:
    """The policy's optimisation."""

    lr: float = 1e-6
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear learning-rate warmup, in optimizer steps."""
    lr_scheduler: str = "constant"
    """Schedule after warmup: constant | cosine | linear."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine/linear schedule as a fraction of lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    ppo_mini_batch_size: int = 0
    """Prompts per optimizer step over all ranks (times rollout.n samples); 0 means data.train_batch_size."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one rank; gradients accumulate over a mini-batch."""
    policy_loss: str = "ppo"
    """Policy loss from the registry: ppo | gspo | ... (spmdrl.algos.losses)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    clip_ratio_low: float = 0.2
    """Lower clip of the importance ratio: 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Upper clip of the importance ratio: 1 + clip_ratio_high (DAPO's clip-higher raises it)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (> 1)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Add a KL(actor || ref) term to the loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss term."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss: kl (k1) | abs | mse (k2) | low_var_kl (k3)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when computing log-probs and entropy from the LM head (bounds the logits memory)."""


@dataclass
class RefConfig:
    """The frozen reference policy, used for the KL term."""

    offload: bool = False
    """Keep the ref weights on CPU and stream them in for its forward (saves GPU memory)."""
    micro_batch_size: int = 8
    """Samples per ref forward on one rank."""


@dataclass
class CriticConfig:
    """The value model (PPO with GAE)."""

    enable: bool = False
    """Train a critic; required by the gae estimator."""
    path: str = ""
    """HF backbone for the critic; empty means model.path."""
    lr: float = 1e-5
    """Critic AdamW learning rate."""
    weight_decay: float = 0.01
    """Critic AdamW weight decay."""
    warmup_steps: int = 0
    """Critic learning-rate warmup steps."""
    grad_clip: float = 1.0
    """Critic gradient-norm clip; 0 disables."""
    ppo_epochs: int = 1
    """Critic passes over each batch."""
    micro_batch_size: int = 4
    """Samples per critic forward/backward on one rank."""
    cliprange_value: float = 0.5
    """Clip of the value update around the old values."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss."""


@dataclass
class RolloutConfig:
    """Generation: vLLM in-process on each rollout tensor-parallel group."""

    engine: str = "auto"
    """vllm | hf | auto (vllm when installed, else the slow transformers engine with a warning)."""
    n: int = 4
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    stop: list[str] = field(default_factory=list)
    """Stop strings."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop token ids (EOS is always a stop)."""
    val_temperature: float = 0.0
    """Temperature for validation (0 is greedy)."""
    val_top_p: float = 1.0
    """top_p for validation."""
    val_n: int = 1
    """Samples per validation prompt."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (CUDA only)."""
    enable_sleep_mode: bool = True
    """Release vLLM weights and KV cache while training (CUDA only; ignored on CPU where vLLM lacks it)."""
    enforce_eager: bool = True
    """Disable CUDA graphs in vLLM."""
    max_num_seqs: int = 256
    """vLLM's max concurrent sequences."""
    max_num_batched_tokens: int = 8192
    """vLLM's token budget per scheduler step."""
    kv_cache_gb: float = 1.0
    """KV cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    weight_sync_bucket_mb: int = 256
    """Size of the buckets in which weights stream from the actor to the rollout engine."""
    dtype: str = "auto"
    """Rollout dtype: auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16."""


@dataclass
class RewardConfig:
    """Reward: rule scorers by data_source, a custom function, or a reward model."""

    custom_fn: str = ""
    """Custom scorer 'path/to/file.py:function' or 'package.module:function', signature (data_source, solution_str, ground_truth, extra_info) -> float | dict."""
    on_error: str = "raise"
    """When a reward function raises: raise (stop, naming the sample) | zero (score 0 and count it)."""
    timeout_s: float = 120.0
    """Per-sample time limit for reward functions in seconds (a stuck function ends in a named RewardTimeout); 0 disables (a hung function then hangs the job)."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: penalise responses within this many tokens of max_response_length; 0 disables."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong shaping: the largest penalty, reached at max_response_length."""
    rule_weight: float = 1.0
    """Weight of the rule / custom-function score in the final reward."""
    model_path: str = ""
    """Sequence-classification reward model (HF path or hub id); empty disables it."""
    model_tokenizer_path: str = ""
    """Reward model tokenizer; empty means model_path's. Responses are re-tokenised when it differs from the policy's."""
    model_weight: float = 1.0
    """Weight of the reward model's score in the final reward."""
    model_micro_batch_size: int = 8
    """Samples per reward-model forward on one rank."""


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the KL-in-reward controller."""

    adv_estimator: str = "grpo"
    """Advantage estimator from the registry: grpo | drgrpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | gae | remax."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (false gives Dr.GRPO)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    epsilon: float = 1e-6
    """Added to the std in normalisations."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(actor || ref) from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty: kl | abs | mse | low_var_kl."""
    kl_ctrl: str = "fixed"
    """In-reward KL coefficient controller: fixed | adaptive."""
    kl_coef: float = 0.001
    """Initial in-reward KL coefficient."""
    kl_target: float = 0.1
    """Adaptive controller: target KL."""
    kl_horizon: int = 10000
    """Adaptive controller: horizon in samples."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and generate more until the batch is full."""
    max_sample_rounds: int = 4
    """Dynamic sampling: generation rounds per step at most; past it the step trains on what it has."""


@dataclass
class PlacementConfig:
    """Which ranks each role uses and its parallel degrees; data parallel is derived (ranks / (tp * pp))."""

    mode: str = "colocate"
    """colocate: every role on all ranks (the only mode implemented so far)."""
    actor_ranks: list[int] = field(default_factory=list)
    """Ranks of the actor; empty means all ranks."""
    actor_tp: int = 1
    """Actor tensor-parallel degree (DTensor TP inside each FSDP2 group)."""
    actor_pp: int = 1
    """Actor pipeline-parallel degree (reserved for the Megatron backend; must be 1 with FSDP2)."""
    ref_ranks: list[int] = field(default_factory=list)
    """Ranks of the ref model; empty means the actor's ranks."""
    ref_tp: int = 1
    """Ref tensor-parallel degree."""
    critic_ranks: list[int] = field(default_factory=list)
    """Ranks of the critic; empty means the actor's ranks."""
    critic_tp: int = 1
    """Critic tensor-parallel degree."""
    rollout_ranks: list[int] = field(default_factory=list)
    """Ranks running vLLM; empty means all ranks."""
    rollout_tp: int = 1
    """vLLM tensor-parallel degree: ranks per engine."""
    reward_ranks: list[int] = field(default_factory=list)
    """Ranks of the reward model; empty means the actor's ranks."""
    reward_tp: int = 1
    """Reward-model tensor-parallel degree."""


@dataclass
class TrainerConfig:
    """The loop."""

    total_steps: int = 10
    """RL steps to run."""
    seed: int = 0
    """Seed for data order, sampling and init; same config and seed give the same metrics on CPU."""
    output_dir: str = "outputs/run"
    """Where metrics, tensorboard events, the resolved config and checkpoints go."""
    test_freq: int = 0
    """Validate every this many steps (and at the end); 0 validates only before training and at the end."""
    val_before_train: bool = True
    """Validate once before the first step."""
    device: str = "auto"
    """auto (cuda when available) | cuda | cpu."""
    backend: str = "fsdp"
    """Training backend: fsdp (FSDP2 + DTensor TP)."""
    experiment_name: str = ""
    """Name shown in logs and sweep reports; empty means the output_dir's name."""
    dist_timeout_s: float = 600.0
    """Collective timeout: a rank that dies makes the others fail within about this long."""
    critic_warmup: int = 0
    """Steps at the start during which only the critic trains (the actor and rollout weights stay put)."""
    max_bad_steps: int = 3
    """Consecutive steps with a non-finite loss or grad norm (each skipped) before the run aborts."""
    overwrite: bool = False
    """A fresh run (checkpoint.resume off, or auto finding no checkpoint) into an output_dir holding another run's checkpoints, metrics.jsonl or tensorboard events deletes them; false refuses to start."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (torch.distributed.checkpoint)."""

    save_freq: int = 0
    """Save every this many steps (and at the end); 0 saves only at the end; -1 never."""
    keep_last: int = 2
    """This run's complete checkpoints to keep (another run's are never deleted); 0 keeps all."""
    resume: str = "auto"
    """auto (newest intact checkpoint in output_dir; damaged newer ones are skipped with a warning) | off | a checkpoint path."""


@dataclass
class LoggingConfig:
    """Where metrics go."""

    tensorboard: bool = True
    """Write tensorboard event files under output_dir/tensorboard."""
    jsonl: bool = True
    """Write output_dir/metrics.jsonl, one JSON object per step."""
    console: bool = True
    """Print a line of key metrics per step on rank 0."""
    progress: bool = True
    """Show progress bars for long stages on rank 0."""


@dataclass
class HooksConfig:
    """User Python hooks run at the stages of the loop."""

    files: list[str] = field(default_factory=list)
    """Python files or importable modules whose decorated functions are registered as stage hooks."""


@dataclass
class Config:
    """The whole run."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
