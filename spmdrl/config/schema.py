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
    image_key: str = "images"
    """A vision-language model's column of each prompt's images (verl's multimodal schema: a list of {bytes, path},
    bytes or paths; an `<image>` placeholder in the prompt per image). Read only when model.path is one."""
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
    """Recompute activations in the backward pass to save memory (actor and critic), with checkpoint_policy."""
    checkpoint_policy: str = "full"
    """With gradient_checkpointing: full (a layer keeps only its input and reruns its forward in backward) | selective
    (a layer keeps its matmul and attention outputs and reruns only the elementwise ops between them; megatron:
    its selective recompute of core attention)."""
    checkpoint_every_n_layers: int = 1
    """With gradient_checkpointing: checkpoint every n-th decoder layer only; the others keep their activations (fsdp
    backend only)."""
    checkpoint_offload: bool = False
    """With gradient_checkpointing on CUDA: keep what the checkpoints save in pinned host memory (fsdp backend only)."""
    compile: bool = False
    """torch.compile each decoder block's forward (dynamic shapes) in the training engines (fsdp backend only). The
    first micro-batches pay the compilation (tens of seconds per engine)."""
    attn_implementation: str = "auto"
    """Attention of the FSDP2 backend's actor, ref and critic: auto (spmdrl's kernels, switched to transformers'
    eager attention for a model whose attention they do not compute: attention soft-capping, attention sinks, or a
    difference the parity check finds before step 1) | spmdrl (spmdrl's kernels only: no mask tensor, packed
    micro-batches through a variable-length causal attention over their sequence boundaries, padded ones through
    causal SDPA, grouped-query attention without repeating key/value heads, sliding windows) | sdpa
    (transformers' SDPA with explicit masks; packed micro-batches in rows with a dense block-diagonal mask) |
    eager (transformers' eager attention, the model's own code, explicit masks; the slowest). The Megatron
    backend has its own attention."""
    logprob_head: str = "auto"
    """How the FSDP2 backend turns hidden states into log-probs: fused (spmdrl's chunked kernel: the LM head's
    matmul, final-logit soft-capping, temperature and log-softmax a chunk of tokens at a time, no [tokens, vocab]
    tensor kept) | model (the model's own forward to its logits, then temperature and log-softmax: whatever its
    head computes, such as a logit scale; keeps [tokens, vocab] logits) | auto (fused, or model when the parity
    check finds the fused head computes another function than the model's)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (PEFT LoRA) instead of full fine-tuning: the base weights are frozen, and the reference
    policy is the actor with its adapters disabled (no ref model is built). FSDP2 backend only; see docs/lora.md."""

    enable: bool = False
    """Train LoRA adapters on the actor (and with critic = true on the critic) instead of every weight."""
    rank: int = 16
    """Adapter rank r."""
    alpha: int = 32
    """Scaling numerator: the adapter's update is (alpha / rank) B A."""
    dropout: float = 0.0
    """Dropout on the adapter's input during updates (forward-only passes run without it)."""
    target_modules: list[str] = field(default_factory=list)
    """Names (last component) of the linear layers that get adapters, e.g. ["q_proj", "v_proj"]; empty means every linear layer of the decoder blocks (the LM head and embeddings are never adapted)."""
    init: str = "default"
    """Adapter initialisation: default (A Kaiming-uniform, B zero; PEFT's default) | gaussian (A normal(0, 1/rank), B zero). Both start as the base model."""
    critic: bool = False
    """The critic trains LoRA adapters too (its value head is trained in full)."""


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
    freeze_vision_tower: bool = False
    """A vision-language model's vision tower (and its merger) is not trained (FSDP2 backend)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    ppo_mini_batch_size: int = 0
    """Prompts per optimizer step over all ranks (times rollout.n samples); 0 means data.train_batch_size."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one rank; gradients accumulate over a mini-batch."""
    max_tokens_per_micro_batch: int = -1
    """Token budget per forward/backward on one rank (prompt + response tokens); > 0 splits each mini-batch
    into the fewest micro-batches of near-equal token counts within this budget and micro_batch_size samples
    (the same count on every rank); -1 (auto): with use_packing, a budget of micro_batch_size x
    (data.max_prompt_length + data.max_response_length) tokens and no cap on samples (a micro-batch of short
    sequences holds more of them; memory stays bounded by the budget), without packing as 0; 0 splits by
    micro_batch_size samples only."""
    forward_micro_batch_size: int = 0
    """Samples per forward-only pass (old and ref log-probs), which keep no activations; 0 means micro_batch_size."""
    forward_max_tokens_per_micro_batch: int = 0
    """Token budget of forward-only passes; 0 means max_tokens_per_micro_batch (auto: forward_micro_batch_size x
    the longest sequence)."""
    use_packing: bool = True
    """Pack the sequences of a micro-batch one after another (per-sequence position ids and boundaries, no
    padding; see model.attn_implementation) instead of right-padding each to the longest of its micro-batch;
    same numbers, fewer padding tokens (actor, ref and old log-prob passes)."""
    policy_loss: str = "ppo"
    """Policy loss from the registry: ppo | gspo | gmpo | cispo | sapo | clip_cov | kl_cov | gpg (spmdrl.algos.losses)."""
    loss_agg_mode: str = "auto"
    """auto (the policy loss's own: seq-mean-token-mean for gspo/gmpo, which allow no other, and for sapo, its paper's objective; else token-mean) | token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    loss_agg_norm: float = 0.0
    """Constant divisor of seq-mean-token-sum-norm (Dr. GRPO) for the policy, entropy and KL terms; 0 means data.max_response_length."""
    clip_ratio_low: float = 0.2
    """Lower clip of the importance ratio: 1 - clip_ratio_low (1: no lower clip, as CISPO's paper); gmpo reads it as a log-ratio bound."""
    clip_ratio_high: float = 0.2
    """Upper clip of the importance ratio: 1 + clip_ratio_high (DAPO's clip-higher raises it); gmpo reads it as a log-ratio bound (paper: 0.4)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (> 1)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (subtracted from the loss)."""
    entropy_metric: bool = True
    """Log actor/entropy; with entropy_coeff = 0 it is computed without autograd, and false skips it."""
    use_kl_loss: bool = False
    """Add a KL(actor || ref) term to the loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss term."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss: kl (k1) | abs | mse (k2) | low_var_kl (k3) | k1+ | k3+ (value of k1/k3, gradient of k2)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when computing log-probs and entropy from the LM head (bounds the logits memory)."""
    sapo_tau_pos: float = 1.0
    """SAPO: gate temperature for tokens with a positive advantage (1.0: the paper's Qwen3-30B-A3B runs, also verl's)."""
    sapo_tau_neg: float = 1.05
    """SAPO: gate temperature for tokens with a negative (or zero) advantage (1.05: the paper's, also verl's)."""
    clip_cov_ratio: float = 0.0002
    """Clip-Cov: fraction of valid tokens whose gradient is detached (the k with the largest covariance; 2e-4: the authors' recipe, also verl's)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance of the tokens that may be detached."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound of the covariance of the tokens that may be detached."""
    kl_cov_ratio: float = 0.002
    """KL-Cov: fraction of valid tokens (largest covariance) that get the KL penalty (2e-3: the authors' Qwen2.5-7B recipe; their 32B recipe and verl use 2e-4)."""
    kl_cov_coef: float = 1.0
    """KL-Cov: coefficient of the |logp - logp_old| penalty on those tokens (1: the authors' recipes; verl's default is 0.1)."""
    moe_aux_loss_coef: float = 0.0
    """Mixture of experts: coefficient of the load-balancing loss E * sum_e f_e * P_e, summed over the MoE layers
    (0: off, as in the peers' RL recipes; docs/moe.md)."""
    moe_z_loss_coef: float = 0.0
    """Mixture of experts: coefficient of the router z-loss mean(logsumexp(router logits)^2), summed over the MoE
    layers (0: off)."""
    router_replay: str = "off"
    """Mixture-of-experts routing replay: off | rollout (the old, ref and actor forwards send each token to the
    experts the rollout engine chose for it; vLLM rollout, docs/moe.md)."""


@dataclass
class RefConfig:
    """The frozen reference policy, used for the KL term."""

    offload: bool = False
    """Keep the ref weights on CPU and stream them in for its forward (saves GPU memory)."""
    micro_batch_size: int = 0
    """Samples per forward of the reference policy on one rank, and of the distillation teacher (forward-only
    passes; the token budget and packing are the actor's forward ones); 0 means actor.forward_micro_batch_size."""


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md): a frozen teacher scores every token the student (the actor)
    sampled, and the student minimises the per-token reverse KL to it, alone or next to the reward's advantage."""

    teacher_path: str = ""
    """The teacher: an HF model directory or hub id of the student's tokenizer family, loaded like the ref; empty
    disables distillation."""
    teacher_tokenizer_path: str = ""
    """The teacher's tokenizer, compared with the student's before launch (same vocabulary and chat template);
    empty means teacher_path."""
    mode: str = "reverse_kl"
    """reverse_kl (the advantage of each sampled token gains -coef * (log pi_student - log pi_teacher), optimised by
    actor.policy_loss with its importance ratio and clipping) | kl_loss (coef x a per-token KL(student || teacher)
    estimate, kl_type, added to the actor's loss)."""
    coef: float = 1.0
    """Weight of the distillation term; the reward's advantage keeps weight 1 (reward.rule_weight = 0 and no reward
    model: pure distillation)."""
    kl_type: str = "k2"
    """kl_loss mode: the KL estimator (k1 | k2 | k3 | k1+ | k3+, as actor.kl_loss_type); k2 and the '+' variants
    have the gradient of the reverse KL on the student's samples, k1's is zero in expectation."""


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
    max_tokens_per_micro_batch: int = -1
    """Token budget per critic forward/backward on one rank; -1 (auto) and 0 as actor.max_tokens_per_micro_batch."""
    use_packing: bool = True
    """Pack the sequences of a micro-batch instead of padding them (see actor.use_packing)."""
    cliprange_value: float = 0.5
    """Clip of the value update around the old values."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss."""
    loss_agg_norm: float = 0.0
    """Constant divisor of seq-mean-token-sum-norm for the value loss; 0 means data.max_response_length."""


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
    enforce_eager: bool = False
    """Disable CUDA graphs in vLLM (GPU; the CPU backend always runs eager here)."""
    model_impl: str = "auto"
    """vLLM's model implementation: auto (vLLM's own for the architecture when it has one, else its Transformers modeling backend) | vllm | transformers (vLLM runs transformers' modeling code with its own attention and layers)."""
    max_num_seqs: int = 256
    """vLLM's max concurrent sequences (the transformers engine's decode batch size)."""
    per_request_seed: bool = False
    """One seeded request per sample: sample j of prompt i depends only on (prompt seed, j), not on the rest of
    the batch, so one trainer.seed draws the same trajectories at any rollout data-parallel size (on CPU; on
    GPU a batch-size-dependent kernel may still change a token). false: one request per prompt with n samples,
    the engine RNG reseeded per generate call from the call's prompt seeds (reproducible for one layout;
    another rollout data-parallel size draws other samples). Cost measured on CPU (vLLM, tiny model, 8 samples
    x 64 tokens, 32 or 128 prompts): 1.10x the CPU time of a generate call; unmeasured on GPU (docs/sweeps.md)."""
    max_num_batched_tokens: int = 8192
    """vLLM's token budget per scheduler step."""
    kv_cache_gb: float = 1.0
    """KV cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    weight_sync_bucket_mb: int = 256
    """Size of the buckets in which weights stream from the actor to the rollout engine."""
    dtype: str = "auto"
    """Rollout dtype: auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16."""
    load_format: str = "auto"
    """How vLLM gets its first weights: auto (dummy on CUDA and on resume, else the checkpoint) | dummy (random weights; the trainer syncs the actor's before the first rollout, so the checkpoint is read once) | checkpoint."""
    lora_sync: str = "auto"
    """With a LoRA actor (lora): adapter (only the adapter moves; vLLM serves it with its LoRA layers, a new version per sync) | merge (the adapter merged into the base weights, full weights through the planned resharding; for models or ranks vLLM's LoRA layers do not cover) | auto (adapter on vLLM on CUDA; merge on the transformers engine and on CPU, where vLLM's LoRA layers generate several times slower than merged weights)."""
    max_loras: int = 1
    """Adapters vLLM keeps resident at once (vLLM's max_loras); the rollout serves only the newest, so 1 suffices."""
    lora_dir: str = ""
    """Where the rollout writes each adapter version for vLLM to load (one small directory per rank, removed when superseded); empty: /dev/shm (memory-backed), else the temp directory."""
    expert_parallel: bool = False
    """A mixture of experts: each vLLM rank of a rollout TP group holds E / rollout_tp whole experts (vLLM's enable_expert_parallel) instead of a 1/tp slice of every expert's FFN width; the weight sync sends each rank its own experts only."""
    parity_check: bool = True
    """Before step 1, score a few real samples three ways: the actor's forward as it trains (spmdrl's kernels and
    log-prob head), transformers' own forward of the model, and the rollout engine's log-probs of its samples. A
    gap above rollout.parity_tol switches the FSDP2 actor to transformers' attention or head where
    model.attn_implementation / model.logprob_head are "auto" and that closes it; otherwise the run stops with
    one line naming the largest differing token and the model's modules."""
    parity_tol: float = 0.0
    """The parity check's bound on the largest |actor - rollout| log-prob, in nats; 0: 1e-3 when the training
    engines and the rollout both compute in float32, 0.5 otherwise."""
    logprob_diff_warn: float = 0.0
    """During training, rollout/logprob_diff_max above this gets one warning line per run; 0: 0.1 in float32,
    2.0 otherwise; negative: off."""
    logprob_diff_error: float = 0.0
    """During training, rollout/logprob_diff_mean above this stops the run (the trainer computes another policy
    than the one that sampled); 0: 0.05 in float32, 0.5 otherwise; negative: off."""
    partial: str = "off"
    """Partial rollouts (single- and multi-turn): off (every step's requests run to the end) | keep | recompute. A
    step's rollout ends as soon as data.train_batch_size prompt groups are complete; the unfinished requests stay in
    the engine and go on after the weight update with the new weights, keep: with the keys and values computed by
    the old ones | recompute: their prompt and tokens so far are prefilled again with the new weights first. Every
    token records the weight version that sampled it (the batch's `versions`), and the loss's old policy is each
    token's behaviour log-prob, the engine's (docs/architecture.md, partial rollouts). With placement.mode = "split"
    this is asynchronous split: the rollout ranks step their engines without draining them, post each batch when its
    groups are complete and load new weights between two engine steps, at points the config fixes
    (trainer.max_staleness >= 1 bounds the lag)."""
    max_version_lag: int = 1
    """With rollout.partial, colocated: a prompt group admitted more than this many weight versions ago is aborted
    and its prompt queued again, so that no trained token is older than this (split placement: trainer.max_staleness
    is the bound)."""
    oversample: float = 0.5
    """With rollout.partial: prompt groups kept in flight beyond the data.train_batch_size a step needs, as a
    fraction of it; they are what a step carries over (0 carries nothing over)."""
    verify_sync: bool = False
    """Debug: after every weight sync, each rollout rank checks that its engine holds exactly the actor's weights (every parameter whole, loaded through the engine's own loaders, compared byte for byte with what the sync left) and stops naming the parameter, rank and largest difference on a mismatch. Costs two host copies of the rollout weights and a second load per sync."""


@dataclass
class RewardConfig:
    """Reward: rule scorers by data_source, a custom function, or a reward model."""

    custom_fn: str = ""
    """Custom scorer 'path/to/file.py:function' or 'package.module:function', signature (data_source, solution_str, ground_truth, extra_info) -> float | dict."""
    custom_fns: list[str] = field(default_factory=list)
    """Several custom scorers (same specs and signature as custom_fn; instead of it): the reward is their weighted sum, and each one's mean is logged as reward/extra/<function name>."""
    weights: list[float] = field(default_factory=list)
    """Weights of reward.custom_fns, one per function; empty weighs each 1."""
    on_error: str = "raise"
    """When a reward function raises: raise (stop, naming the sample) | zero (score 0 and count it)."""
    timeout_s: float = 120.0
    """Per-sample time limit for reward functions in seconds (a stuck function ends in a named RewardTimeout); 0 disables (a hung function then hangs the job)."""
    in_process: bool = False
    """Run reward.custom_fn in the training process instead of a worker process per rank. The worker is killed and replaced when a call passes reward.timeout_s, whatever the function is doing; in the process a timer interrupts Python code only, so a long C call (a regex, a C extension) runs past the limit."""
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
    """Advantage estimator from the registry: grpo | drgrpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | gae | remax | grpo_passk | opo | gpg."""
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
    """KL estimator for the in-reward penalty: kl | abs | mse | low_var_kl (the '+' variants only change gradients, which a reward has none of)."""
    kl_ctrl: str = "fixed"
    """In-reward KL coefficient controller: fixed | adaptive."""
    kl_coef: float = 0.001
    """Initial in-reward KL coefficient."""
    kl_target: float = 0.1
    """Adaptive controller: target KL."""
    kl_horizon: int = 10000
    """Adaptive controller: horizon in samples. The controller is fed the global mean over responses of each response's token-mean KL."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and generate more until the batch is full."""
    max_sample_rounds: int = 4
    """Dynamic sampling: generation rounds per step at most; past it the step trains on what it has (on the last round unfiltered if that is not one group per rank)."""
    filter_metric: str = "rule_score"
    """Dynamic sampling: the per-sample value whose all-equal groups are dropped: rule_score (the rule / custom score before weighting, reward model and overlong shaping) | score (the final reward)."""


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling and rejection between the rollout engine's policy and the actor's old policy (verl's algorithm.rollout_correction); see docs/algorithms.md."""

    rollout_is: str = "none"
    """Truncated importance weights w = min(pi_old / pi_rollout, rollout_is_threshold), detached, multiplying the per-token policy loss: none | token (per-token ratio) | sequence (product of the response's token ratios, in log space)."""
    rollout_is_threshold: float = 2.0
    """Truncation cap C of the importance weights (> 0)."""
    rollout_is_in_loss: bool = True
    """Whether the importance weights multiply the policy loss; false computes and logs them only."""
    rollout_rs: str = "none"
    """Rejection sampling: drop from the loss tokens / responses whose ratio is outside [rollout_rs_threshold_lower, rollout_rs_threshold]: none | token (per-token ratio) | sequence (product of the token ratios) | geometric (their geometric mean)."""
    rollout_rs_threshold: float = 2.0
    """Upper bound U of the rejection ratio (> 0)."""
    rollout_rs_threshold_lower: float | None = None
    """Lower bound L of the rejection ratio (>= 0, below U); unset means 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: float = 0.0
    """Drop a whole response when any of its token ratios pi_old / pi_rollout is below this; 0 disables."""
    decoupled: bool = False
    """Decoupled PPO (Hilton et al. 2021; AReaL): the ratio and its clip use the proximal policy pi_prox, the actor's log-probs of the batch before the update (its old-log-prob pass, or on-policy one forward pass of its own), and each token's loss is weighted by w = pi_prox / pi_behav, pi_behav being the rollout engine's log-prob at the weight version that sampled the token (detached; capped by decoupled_cap). For runs whose tokens come from older weights (rollout.partial, split placement's staleness); instead of rollout_is."""
    decoupled_cap: float = 0.0
    """With decoupled: the cap C of the importance weights, w = min(pi_prox / pi_behav, C) (>= 1); 0: uncapped."""


@dataclass
class PlacementConfig:
    """Which ranks each role uses and its parallel degrees; data parallel is derived (ranks / (tp * pp * sp))."""

    mode: str = "colocate"
    """colocate: every role on all ranks. split: rollout_ranks (the first ranks of the world) run vLLM only, the other ranks run the training roles; batches and weights move between them point to point."""
    actor_ranks: list[int] = field(default_factory=list)
    """Ranks of the actor; empty means all ranks (split placement: every rank after the rollout ranks)."""
    actor_tp: int = 1
    """Actor tensor-parallel degree (DTensor TP inside each FSDP2 group)."""
    actor_pp: int = 1
    """Actor pipeline-parallel degree (Megatron backend only; must be 1 with FSDP2)."""
    actor_sp: int = 1
    """Actor sequence-parallel degree (FSDP2 backend, Ulysses): each sequence's tokens split over this many ranks, attention heads exchanged by all-to-all; needs actor_tp = 1 and the attention heads divisible by it."""
    actor_ep: int = 1
    """Actor expert-parallel degree (Megatron backend, mixture-of-experts models): each expert layer's experts split over this many of the actor's data-parallel ranks (tokens reach them by all-to-all); must divide the actor's data-parallel size and the expert count."""
    ref_ranks: list[int] = field(default_factory=list)
    """Ranks of the ref model; empty means the actor's ranks."""
    ref_tp: int = 1
    """Ref tensor-parallel degree."""
    ref_pp: int = 1
    """Ref pipeline-parallel degree (Megatron backend only)."""
    ref_sp: int = 1
    """Ref sequence-parallel degree (FSDP2 backend, Ulysses): each sequence's tokens split over this many ranks, attention heads exchanged by all-to-all; needs ref_tp = 1 and the attention heads divisible by it."""
    ref_ep: int = 1
    """Ref expert-parallel degree (Megatron backend, mixture-of-experts models): each expert layer's experts split over this many of the ref's data-parallel ranks (tokens reach them by all-to-all); must divide the ref's data-parallel size and the expert count."""
    critic_ranks: list[int] = field(default_factory=list)
    """Ranks of the critic; empty means the actor's ranks."""
    critic_tp: int = 1
    """Critic tensor-parallel degree."""
    critic_pp: int = 1
    """Critic pipeline-parallel degree (Megatron backend only)."""
    critic_sp: int = 1
    """Critic sequence-parallel degree (FSDP2 backend, Ulysses): each sequence's tokens split over this many ranks, attention heads exchanged by all-to-all; needs critic_tp = 1 and the attention heads divisible by it."""
    critic_ep: int = 1
    """Critic expert-parallel degree (Megatron backend, mixture-of-experts models): each expert layer's experts split over this many of the critic's data-parallel ranks (tokens reach them by all-to-all); must divide the critic's data-parallel size and the expert count."""
    rollout_ranks: list[int] = field(default_factory=list)
    """Ranks running vLLM; empty means all ranks (colocate). Split placement: required, the first R ranks [0, ..., R-1]."""
    rollout_tp: int = 1
    """vLLM tensor-parallel degree: ranks per engine."""
    teacher_ranks: list[int] = field(default_factory=list)
    """Ranks of the distillation teacher; empty means the actor's ranks."""
    teacher_tp: int = 1
    """Teacher tensor-parallel degree (a teacher larger than the student shards over more ranks)."""
    teacher_pp: int = 1
    """Teacher pipeline-parallel degree (Megatron backend only)."""
    teacher_ep: int = 1
    """Teacher expert-parallel degree (Megatron backend, mixture-of-experts models): each expert layer's experts split over this many of the teacher's data-parallel ranks (tokens reach them by all-to-all); must divide the teacher's data-parallel size and the expert count."""
    reward_ranks: list[int] = field(default_factory=list)
    """Ranks of the reward model; empty means the actor's ranks."""
    reward_tp: int = 1
    """Reward-model tensor-parallel degree."""


@dataclass
class MemoryConfig:
    """GPU/host memory: what goes to host memory between a role's phases, and the hardware `spmdrl plan` checks against."""

    actor_offload: list[str] = field(default_factory=lambda: ["optimizer", "grads"])
    """Kinds of actor state moved to host memory while the actor is not training (params | grads | optimizer; GPU only)."""
    critic_offload: list[str] = field(default_factory=lambda: ["optimizer", "grads"])
    """Kinds of critic state moved to host memory while the critic is not training (GPU only)."""
    ref_offload: list[str] = field(default_factory=list)
    """["params"] moves the ref weights to host memory outside its forward (GPU only; ref.offload streams them instead)."""
    actor_host_optimizer: bool | None = None
    """Megatron backend: the actor's float32 master weights and AdamW moments live in host memory and the optimizer step runs on the CPU, instead of megatron's distributed optimizer on the GPU (12 bytes a parameter / dp off each GPU; 16 bytes a local parameter in host memory, and the gradients and weights cross PCIe each step). Unset: on for a mixture of experts on a GPU (megatron's distributed optimizer keeps expert parameters in a second optimizer whose state spmdrl's checkpoints do not save), off otherwise; the log and `spmdrl plan` say which."""
    critic_host_optimizer: bool | None = None
    """The same for a Megatron critic."""
    defer_grad_sync: bool = False
    """Reduce-scatter gradients only on a mini-batch's last micro-batch. Costs an unsharded float32 gradient of the whole (tp-local) model per rank (4 bytes x params / tp) while accumulating; the default reduce-scatters every micro-batch."""
    teacher_offload: list[str] = field(default_factory=list)
    """["params"] moves the distillation teacher's weights to host memory outside its forward (GPU only)."""
    gpu_memory_gb: float = 80.0
    """GPU memory per device in GiB (2^30 bytes), for `spmdrl plan` (an 80 GB H100 has 79.6 GiB; `nvidia-smi` shows MiB)."""
    gpus_per_node: int = 8
    """GPUs (ranks) per node, for `spmdrl plan`'s host figures."""
    nodes: int = 1
    """Nodes of the run, for `spmdrl plan` (world size = nodes x gpus_per_node unless --world-size is given)."""
    host_memory_gb: float = 2048.0
    """Host memory per node in GiB (2^30 bytes), for `spmdrl plan`."""
    margin: float = 0.9
    """`spmdrl plan` says a phase fits when it uses at most this fraction of GPU and host memory."""
    report_components: bool = False
    """Also log, per phase, each role's params / grads / optimizer bytes on the device at the phase's end (memory/<phase>/<role>_<kind>_gb) and, on CUDA, the rest of the phase's peak (memory/<phase>/transient_gb): the figures launch/rehearse_memory.py compares with `spmdrl plan` component by component."""


@dataclass
class TrainerConfig:
    """The loop."""

    total_steps: int = 10
    """RL steps to run (set from total_epochs when that is > 0)."""
    total_epochs: int = 0
    """> 0: run this many passes over data.train_files instead: total_steps = total_epochs x (rows //
    data.train_batch_size), the rows counted before data.filter_overlong (verl's total_epochs), said at start.
    Leave total_steps at its default (or at that count): both set to different counts is refused."""
    device_peak_tflops: float = 0.0
    """Peak TFLOP/s of one device for perf/mfu_*; 0 uses the bf16 dense peak of a known GPU (H100, H200, A100)
    and on CPU reports only the achieved perf/*_tflops."""
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
    """Training backend of the actor and ref: fsdp (FSDP2 + DTensor TP) or megatron (megatron-core GPTModel, TP x PP x DP;
    Llama / Qwen2 / Qwen3 family; every Megatron role shares one tp/pp layout)."""
    critic_backend: str = ""
    """Training backend of the critic: fsdp or megatron; empty uses trainer.backend."""
    experiment_name: str = ""
    """Name shown in logs and sweep reports; empty means the output_dir's name."""
    dist_timeout_s: float = 600.0
    """Collective timeout: a rank that dies makes the others fail within about this long."""
    max_staleness: int = 0
    """Split placement: how many steps the rollout runs ahead of training. 0: batch s is generated with the weights after step s-1 (on-policy); 1: batch s+1 is generated with the weights after step s-1 while the training ranks update on batch s (one-step off-policy); k: k steps ahead. With rollout.partial (asynchronous split) the rollout ranks post one batch ahead and this is the most versions a trained token may lag the actor that trains on it (>= 1): a request may go on over max_staleness - 1 weight updates before it is aborted and its prompt queued again."""
    critic_warmup: int = 0
    """Steps at the start during which only the critic trains (the actor and rollout weights stay put)."""
    max_bad_steps: int = 3
    """Consecutive bad steps (a non-finite loss or grad norm, no finite reward, or every token rejected by rollout_correction; each skipped) before the run aborts."""
    overwrite: bool = False
    """A fresh run (checkpoint.resume off, or auto finding no checkpoint) into an output_dir holding another run's checkpoints, metrics.jsonl or tensorboard events deletes them; false refuses to start."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (torch.distributed.checkpoint)."""

    save_freq: int = 0
    """Save every this many steps (and at the end); 0 saves only at the end; -1 never."""
    save_every_min: float = 30.0
    """Also save after a step that ends this many minutes or more after the last save (or the start), so a stop
    loses at most about this much training; 0 disables it (-1 in save_freq disables every save)."""
    keep_last: int = 2
    """This run's complete checkpoints to keep (another run's are never deleted); 0 keeps all."""
    resume: str = "auto"
    """auto (newest intact checkpoint in output_dir; damaged newer ones are skipped with a warning) | off | a checkpoint path."""
    grace_s: float = 20.0
    """On SIGTERM or Ctrl-C the run finishes its step, saves a checkpoint and exits, if the step ends within this
    many seconds of the signal (else it exits without saving it); the default leaves 10 s of torchrun's 30 s before
    its SIGKILL for the save. SIGUSR1 (a scheduler's early warning) saves at the next step boundary however long
    the step takes. A second signal stops at once. 0: every signal stops at once (docs/reliability.md)."""


@dataclass
class LoggingConfig:
    """Where metrics go (docs/metrics.md, "Experiment trackers"). Rank 0 writes to every backend; the others log
    nothing. A backend that fails mid-run is a warning and a `logging/<backend>_failures` metric, never a stopped run."""

    backends: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    """Where each step's metrics go, any of: tensorboard (output_dir/tensorboard), jsonl (output_dir/metrics.jsonl),
    wandb (Weights & Biases; `pip install 'spmdrl[wandb]'`), mlflow (`pip install 'spmdrl[mlflow]'`)."""
    tensorboard: bool = True
    """false removes tensorboard from logging.backends (a shorthand kept for older configs)."""
    jsonl: bool = True
    """false removes jsonl from logging.backends (a shorthand kept for older configs)."""
    console: bool = True
    """Print a line of key metrics on rank 0 (every console_every steps)."""
    console_every: int = 0
    """Steps between console lines (the last step always has one); 0: every step of an RL run, about 20 lines over
    an SFT run."""
    progress: bool = True
    """Show progress bars for long stages on rank 0."""
    log_generations: int = 0
    """Samples shown per training step and per validation (prompt, response, reward, the turns' tool calls): written
    to output_dir/generations.jsonl and to the trackers as tables (tensorboard text, a wandb table, an MLflow
    artifact); 0 shows none. Training samples come from rank 0's batch (colocated placement)."""
    dump_rollouts: bool = False
    """Write every sample of every step and validation, in the same rows, to output_dir/rollouts/ (one file per
    step, split and rank; verl's rollout_data_dir)."""
    verbosity: str = "info"
    """Console logging: info (spmdrl's lines; vLLM, Triton, megatron-core and transformers warnings that need no
    action are quieted) | debug (everything, every library at its own level). The environment variable
    SPMDRL_VERBOSITY overrides it."""
    project: str = "spmdrl"
    """wandb project; the MLflow experiment is this name, or `project/group` when logging.group is set."""
    group: str = ""
    """wandb run group and the MLflow experiment's second part; `spmdrl sweep run` sets it to the sweep's name."""
    run_name: str = ""
    """The tracker run's name; empty uses trainer.experiment_name, else the output_dir's name (a sweep's run name)."""
    tags: list[str] = field(default_factory=list)
    """Tracker tags; `spmdrl sweep run` adds the run's overrides (`actor.lr=1e-06`)."""
    wandb_mode: str = ""
    """online | offline (no account or network; `wandb sync output_dir/wandb/offline-run-*` uploads later); empty
    uses the WANDB_MODE environment variable, else online (which needs WANDB_API_KEY or `wandb login`)."""
    wandb_entity: str = ""
    """wandb entity (user or team); empty uses WANDB_ENTITY or the account's default."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking server or store; empty uses MLFLOW_TRACKING_URI, else a file store `mlruns` in the directory
    the run is launched from."""
    tracker_timeout_s: float = 15.0
    """How long the end of a run waits for wandb and MLflow to take the last metrics and close (an unreachable
    server's retries included) before it goes on without them, with one warning line."""


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tool calls (docs/tools.md): the policy writes a turn, the tool calls at its end
    run, their results are appended (loss mask 0), and the next turn continues, until the policy answers
    without a call or a limit is reached. Turns are synchronous across each rollout TP group."""

    enable: bool = False
    """Roll out multi-turn trajectories with tools (training and validation)."""
    tools: list[str] = field(default_factory=list)
    """The tools the policy may call: built-in names (calculator, python, http_exec) or `module:function` /
    `path.py:function` naming a Tool, a function returning one, or a plain typed function."""
    format: str = "hermes"
    """How calls appear in the model's text: hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    Qwen's format)."""
    max_turns: int = 4
    """Assistant turns per trajectory; a trajectory still calling tools after the last one ends there."""
    max_calls_per_turn: int = 4
    """Tool calls run per turn; further calls in the same turn get an error result."""
    max_tool_response_tokens: int = 256
    """A tool result longer than this many tokens is cut to it."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call; a call that exceeds it gets an error result."""
    max_parallel_calls: int = 16
    """Tool calls running at once on one rank."""
    sandbox_timeout_s: float = 8.0
    """Wall-clock limit of one run of the python tool; its process group is killed then. Below tool_timeout_s,
    so the model sees the sandbox's own message."""
    sandbox_cpu_s: int = 5
    """CPU seconds one python-tool process may use (RLIMIT_CPU)."""
    sandbox_memory_mb: int = 1024
    """Address space of one python-tool process in MiB (RLIMIT_AS)."""
    sandbox_file_mb: int = 16
    """Largest file a python-tool program may write, in MiB (RLIMIT_FSIZE)."""
    sandbox_processes: int = 16
    """Processes (and threads) a python-tool program may start (RLIMIT_NPROC above the sandbox user's count)."""
    sandbox_output_chars: int = 4096
    """Characters of stdout and of stderr a python-tool run returns; the rest is cut."""
    sandbox_python: str = ""
    """The interpreter python-tool programs run in ("" = the trainer's own). When the trainer runs as root the
    programs run as the user nobody, who must be able to run it (a Python under /root is out of its reach)."""
    http_exec_url: str = ""
    """The code-execution service the http_exec tool posts to: the full endpoint, e.g.
    http://host:8080/run_code (SandboxFusion) or http://host:2000/api/v2/execute (Piston)."""
    http_exec_api: str = "sandbox_fusion"
    """The service's request and response format: sandbox_fusion or piston."""
    http_exec_timeout_s: float = 8.0
    """Wall-clock limit of one http_exec request (also sent to the service as its run timeout). Below
    tool_timeout_s."""


@dataclass
class AgentConfig:
    """Black-box agents (docs/agents.md): each rollout is an agent program of yours, pointed at an OpenAI-compatible
    endpoint on its rollout group's leader rank; its calls are captured token-in/token-out and trained. n sessions
    per prompt (rollout.n) form a group."""

    enable: bool = False
    """Roll out with agent sessions (training and validation) instead of one generation per sample."""
    entry: str = ""
    """A Python agent: 'path/to/file.py:run' or 'module:run', called as run(base_url, api_key, sample) in a
    process of its own; it returns the reward (a number), a transcript (a list of messages) or None."""
    command: str = ""
    """An agent in any language: a shell command run with OPENAI_BASE_URL and OPENAI_API_KEY in its environment
    and the sample as JSON on its stdin; its last stdout line is the reward, a JSON transcript, or empty."""
    sessions: int = 4
    """Sessions running at once per rollout group."""
    timeout_s: float = 120.0
    """Wall-clock limit of one session; the agent and everything it started are killed then."""
    max_calls: int = 64
    """Calls one session may make to the endpoint; later ones get HTTP 429."""
    max_request_kb: int = 1024
    """Largest request body the endpoint reads, in KiB; larger ones get HTTP 413."""
    tool_format: str = "hermes"
    """How the model writes tool calls (what the endpoint parses into OpenAI tool_calls): hermes."""
    port: int = 0
    """The endpoint's port on 127.0.0.1 (0: a free one)."""
    train_branches: str = "all"
    """Which of a session's trajectories train: all (every branch: a call that did not extend the conversation
    started one; each carries its session's reward and GRPO advantage) or last (the branch of its last call)."""


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
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)


# ------------------------------------------------------------------------------- the SFT warm start (spmdrl.sft)


@dataclass
class SFTSection:
    """The warm start's data and optimisation (`spmdrl sft`; docs/sft.md)."""

    train_files: list[str] = field(default_factory=list)
    """Parquet/jsonl files with a chat-message (or string) prompt column and a string response column, or with a
    messages column holding whole conversations (trained on their assistant turns)."""
    prompt_key: str = "prompt"
    """Prompt column."""
    response_key: str = "response"
    """Response column."""
    messages_key: str = "messages"
    """Conversation column; a file that has it is read as whole conversations instead of prompt + response."""
    tools_key: str = "tools"
    """Optional column of a conversation file: the tool schemas (a JSON string or a list of objects) passed to the
    chat template's `tools`."""
    image_key: str = "images"
    """Optional column of a prompt + response file for a vision-language model: each prompt's images, as in verl's
    multimodal parquet (data.image_key; docs/vlm.md)."""
    max_length: int = 512
    """Longest prompt + response (or conversation) in tokens."""
    truncation: str = "error"
    """Over-long rows: error | right."""
    epochs: int = 1
    """Passes over the data."""
    max_steps: int = 0
    """Stop after this many optimizer steps; 0 means run all epochs."""
    batch_size: int = 32
    """Samples per optimizer step over all ranks."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    lr_scheduler: str = "cosine"
    """constant | cosine | linear."""
    grad_clip: float = 1.0
    """Gradient-norm clip; 0 disables."""
    save_dir: str = ""
    """Where the HF model is written; empty means trainer.output_dir/hf_model."""
    freeze_vision_tower: bool = False
    """A vision-language model's vision tower (and its merger) is not trained (as actor.freeze_vision_tower); a text
    model is refused."""


@dataclass
class SFTConfig:
    """An SFT warm start (`spmdrl sft --config F`): [model], [sft], [placement], [trainer] and [logging]; the
    shared sections mean what they mean in an RL config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTSection = field(default_factory=SFTSection)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
