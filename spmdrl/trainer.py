"""The RL loop. Every rank runs this same code; each stage is one visible, timed call.

    rollout -> reward -> old logprobs -> ref logprobs -> advantages -> actor update -> weight sync -> metrics
"""
from __future__ import annotations

import copy
import logging
import os
import time

import torch
import torch.distributed as dist

from spmdrl.algos import ADV_ESTIMATORS, POLICY_LOSSES, kl_penalty, masked_mean
from spmdrl.algos.kl import AdaptiveKLController, FixedKLController
from spmdrl.algos.sampling import informative_groups, overlong_penalty
from spmdrl.batch import Batch
from spmdrl.checkpoint import CheckpointManager, checkpoint_root, latest_checkpoint, resolve_resume
from spmdrl.config import Config, to_toml
from spmdrl.data.prompts import PromptDataset
from spmdrl.data.sampler import DistributedPromptSampler
from spmdrl.errors import SpmdrlError
from spmdrl.faults import FAULT_ENV, inject_fault, injected_fault, is_bad_step, named_failures, set_collective_timeout
from spmdrl.dist.collectives import reduce_mean, reduce_min, reduce_sum, redistribute
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.engines.fsdp import FSDPEngine
from spmdrl.hooks import HookContext, HookRunner
from spmdrl.metrics import MetricsLogger, StageTimer, peak_memory_gb
from spmdrl.reshard.sync import sync_weights
from spmdrl.rewards import default_compute_score, load_reward_fn
from spmdrl.rng import rng_state, seed_everything, set_rng_state
from spmdrl.rewards.custom import GuardedReward, compute_rewards
from spmdrl.rewards.model import combine_rewards
from spmdrl.rollout import SamplingSpec, build_engine
from spmdrl.update import actor_body, critic_body, forward_all, run_updates

log = logging.getLogger("spmdrl")


def request_seeds(seed: int, step: int, first: int, count: int) -> list[int]:
    """Per-prompt sampling seeds: a function of (run seed, step, global prompt position) only, so every rank
    of a rollout TP group samples identically and a rerun samples the same tokens."""
    return [(seed * 1_000_003 + step * 100_003 + first + i) % (2**31 - 1) for i in range(count)]


class Trainer:
    def __init__(self, cfg: Config, layout: dict, rank: int, world_size: int, device: torch.device):
        from transformers import AutoTokenizer

        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        seed_everything(cfg.trainer.seed)
        self.meshes = RoleMeshes(layout, rank, device.type)
        print(f"[rank{rank}] {self.meshes.describe()}", flush=True)  # every rank: its place in every mesh
        self.rollout_mesh, self.actor_mesh = self.meshes["rollout"], self.meshes["actor"]
        tok_path = cfg.model.tokenizer_path or cfg.model.path
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=cfg.model.trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        d = cfg.data
        ds_kw = dict(
            max_prompt_length=d.max_prompt_length, truncation=d.truncation, filter_overlong=d.filter_overlong,
            prompt_key=d.prompt_key, apply_chat_template=d.apply_chat_template,
        )
        self.train_ds = PromptDataset(d.train_files, self.tokenizer, **ds_kw)
        self.val_ds = PromptDataset(d.val_files, self.tokenizer, **ds_kw) if d.val_files else None
        # the same sorted list on every rank: it orders validation's all-reduce
        self.val_sources = sorted(set(self.val_ds.batch(list(range(len(self.val_ds)))).data_source)) if self.val_ds else []
        self.sampler = DistributedPromptSampler(
            len(self.train_ds), dp_rank=self.rollout_mesh.dp_rank, dp_size=self.rollout_mesh.dp_size,
            batch_size=d.train_batch_size, seed=cfg.trainer.seed, shuffle=d.shuffle,
        )
        self.reward_fn = load_reward_fn(cfg.reward.custom_fn) if cfg.reward.custom_fn else default_compute_score

        a = cfg.actor
        optim = dict(
            lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay, warmup_steps=a.warmup_steps,
            lr_scheduler=a.lr_scheduler, min_lr_ratio=a.min_lr_ratio, grad_clip=a.grad_clip,
        )
        mini = a.ppo_mini_batch_size or d.train_batch_size
        updates_per_step = a.ppo_epochs * (d.train_batch_size // mini)
        common = dict(dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
        self.actor = FSDPEngine(
            cfg.model.path, self.actor_mesh, device, trainable=True, optim=optim,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            total_steps=cfg.trainer.total_steps * updates_per_step, **common,
        )
        self.ref = (
            FSDPEngine(cfg.model.path, self.meshes["ref"], device, trainable=False, offload=cfg.ref.offload, **common)
            if a.use_kl_loss or cfg.algorithm.use_kl_in_reward else None
        )
        c = cfg.critic
        self.critic = (
            FSDPEngine(
                c.path or cfg.model.path, self.meshes["critic"], device, trainable=True, value_head=True,
                gradient_checkpointing=cfg.model.gradient_checkpointing, total_steps=cfg.trainer.total_steps * c.ppo_epochs,
                optim=dict(lr=c.lr, weight_decay=c.weight_decay, warmup_steps=c.warmup_steps, grad_clip=c.grad_clip),
                **common,
            )
            if c.enable else None
        )
        alg = cfg.algorithm
        self.kl_ctrl = (
            AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon) if alg.kl_ctrl == "adaptive"
            else FixedKLController(alg.kl_coef)
        )
        self.hooks = HookRunner(cfg.hooks.files)
        self.on_policy = a.ppo_epochs == 1 and mini == d.train_batch_size and not cfg.algorithm.use_kl_in_reward
        self.reward_model = None
        if cfg.reward.model_path:
            from spmdrl.rewards.model import RewardModelScorer

            self.reward_model = RewardModelScorer(
                cfg.reward.model_path, self.meshes["reward"], device, tokenizer_path=cfg.reward.model_tokenizer_path,
                policy_tokenizer=self.tokenizer, micro_batch_size=cfg.reward.model_micro_batch_size,
                trust_remote_code=cfg.model.trust_remote_code, dtype=cfg.model.dtype,
            )
        r = cfg.rollout
        cuda = device.type == "cuda"
        self.rollout_dtype = torch.bfloat16 if r.dtype == "bfloat16" or (r.dtype == "auto" and cuda) else torch.float32
        self.rollout = build_engine(
            r.engine, model_path=cfg.model.path, tokenizer_path=tok_path, tp_size=self.rollout_mesh.tp_size,
            dtype="bfloat16" if self.rollout_dtype == torch.bfloat16 else "float32",
            max_model_len=d.max_prompt_length + d.max_response_length, seed=cfg.trainer.seed,
            gpu_memory_utilization=r.gpu_memory_utilization, enable_sleep_mode=r.enable_sleep_mode and cuda,
            enforce_eager=r.enforce_eager, max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=max(r.max_num_batched_tokens, d.max_prompt_length + d.max_response_length),
            kv_cache_gb=r.kv_cache_gb, trust_remote_code=cfg.model.trust_remote_code,
        )
        seed_everything(cfg.trainer.seed)  # building the engine reseeds the global RNG
        stop_ids = sorted({self.tokenizer.eos_token_id, *r.stop_token_ids} - {None})
        self.train_spec = SamplingSpec(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=d.max_response_length,
            stop=list(r.stop), stop_token_ids=stop_ids,
        )
        self.val_spec = SamplingSpec(
            n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p, top_k=-1 if r.val_temperature == 0 else r.top_k,
            max_tokens=d.max_response_length, stop=list(r.stop), stop_token_ids=stop_ids,
        )
        self.greedy_spec = SamplingSpec(n=1, temperature=0.0, max_tokens=d.max_response_length, stop=list(r.stop),
                                        stop_token_ids=stop_ids)
        self.adv_fn = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
        self.loss_fn = POLICY_LOSSES.get(a.policy_loss)
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        if rank == 0:
            with open(os.path.join(cfg.trainer.output_dir, "config.toml"), "w") as f:
                f.write(to_toml(cfg))
        lg = cfg.logging
        self.logger = MetricsLogger(
            cfg.trainer.output_dir, tensorboard=lg.tensorboard, jsonl=lg.jsonl, console=lg.console, rank=rank,
            append=resolve_resume(cfg) is not None, progress_total=cfg.trainer.total_steps if lg.progress else 0,
        )
        self.global_step = 0
        # reliability (docs/reliability.md): checkpoints, bounded collectives, reward guard, resume
        self.checkpoints = CheckpointManager(checkpoint_root(cfg.trainer.output_dir), keep_last=cfg.checkpoint.keep_last,
                                             device=device, fallback=cfg.checkpoint.resume == "auto")
        self.bad_steps = self.bad_steps_total = 0
        if cfg.reward.on_error != "raise" or cfg.reward.timeout_s > 0:
            self.reward_fn = GuardedReward(self.reward_fn, on_error=cfg.reward.on_error, timeout_s=cfg.reward.timeout_s)
        set_collective_timeout(cfg.trainer.dist_timeout_s)
        self.resumed_from = resolve_resume(cfg)
        if self.resumed_from:
            self.load_checkpoint(self.resumed_from)

    # ---- the loop -----------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        last: dict[str, float] = {}
        timer = StageTimer(self.device)  # names validation and checkpointing in failure messages
        set_collective_timeout(cfg.trainer.dist_timeout_s)
        try:
            with named_failures(lambda: self.global_step, cfg.trainer.dist_timeout_s):
                if self.val_ds is not None and cfg.trainer.val_before_train and not self.resumed_from:
                    with timer("validation"):
                        self.logger.log(0, self.validate())
                if self.global_step >= cfg.trainer.total_steps:
                    log.info("at step %d of trainer.total_steps = %d: nothing to train (raise it to go on)",
                             self.global_step, cfg.trainer.total_steps)
                while self.global_step < cfg.trainer.total_steps:
                    self.global_step += 1
                    StageTimer.failed = StageTimer.last = None
                    self.inject_test_fault(self.global_step)
                    metrics = self.step(self.global_step)
                    metrics.update(self.reward_error_metrics())
                    bad = self.count_bad_step(metrics)
                    done = self.global_step == cfg.trainer.total_steps
                    if self.val_ds is not None and (done or (cfg.trainer.test_freq and self.global_step % cfg.trainer.test_freq == 0)):
                        with timer("validation"):
                            metrics.update(self.validate())
                    self.logger.log(self.global_step, metrics)
                    last = metrics
                    self.check_bad_steps()
                    freq = cfg.checkpoint.save_freq
                    if not bad and freq >= 0 and (done or (freq > 0 and self.global_step % freq == 0)):
                        with timer("checkpoint"):
                            self.save_checkpoint()
        finally:
            self.logger.close()
        return last

    def step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        timer = StageTimer(self.device)
        t0 = time.perf_counter()
        batch, metrics = self.collect(step, timer)
        self.rollout.sleep()  # GPU: free vLLM's weights and KV cache while actor/ref/critic run; the sync wakes it
        if not self.on_policy:  # on-policy (one epoch, one mini-batch) the update's own log-probs are the old ones
            with timer("old_logprob"):
                batch["old_log_probs"] = self.forward_logprobs(self.actor, batch)
        if self.ref is not None:
            with timer("ref_logprob"):
                batch["ref_log_probs"] = self.forward_logprobs(self.ref, batch)
        if self.critic is not None:
            with timer("values"):
                batch["values"] = forward_all(self.critic, batch, cfg.critic.micro_batch_size, self.pad_id,
                                              lambda eng, tb: eng.values(tb))
        with timer("advantage"):
            metrics.update(self.apply_kl_in_reward(batch))
            alg = cfg.algorithm
            batch["advantages"], batch["returns"] = self.adv_fn(
                batch["token_level_rewards"], batch["response_mask"], index=batch["index"],
                values=batch.tensors.get("values"), baseline_rewards=batch.tensors.get("baseline_rewards"),
                gamma=alg.gamma, lam=alg.lam, epsilon=alg.epsilon, norm_by_std=alg.norm_adv_by_std,
            )
        metrics.update(self.run_hooks("after_advantage", step, batch))
        metrics.update(self.run_hooks("before_update", step, batch))
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(self.update(self.critic, batch, critic_body(cfg), "critic"))
        train_actor = step > cfg.trainer.critic_warmup
        if train_actor:
            with timer("update_actor"):
                metrics.update(self.update(self.actor, batch, actor_body(cfg, self.loss_fn, cfg.rollout.temperature), "actor"))
        metrics.update(self.run_hooks("after_update", step, batch))
        if train_actor:
            with timer("weight_sync"):
                sync = sync_weights(self.actor, self.rollout, bucket_mb=cfg.rollout.weight_sync_bucket_mb, dtype=self.rollout_dtype)
            metrics["perf/weight_sync_mb"] = sync["perf/weight_sync_mb"]
        metrics.update(self.batch_metrics(batch))
        metrics.update(self.run_hooks("after_step", step, batch, metrics=dict(metrics)))
        # the step's token count rides in the same all-reduce: a mean over the actor's dp ranks, times dp
        metrics["_tokens"] = float(batch["response_mask"].sum() + batch["prompt_len"].sum())
        metrics = reduce_mean(metrics, weight=1.0 if self.actor_mesh.tp_rank == 0 else 0.0)
        tokens = metrics.pop("_tokens") * self.actor_mesh.dp_size
        step_s = time.perf_counter() - t0
        metrics.update(timer.as_metrics())
        metrics["timing/step_s"] = step_s
        metrics["perf/tokens_per_s"] = tokens / step_s
        metrics["perf/peak_memory_gb"] = peak_memory_gb(self.device)
        return metrics

    # ---- stages -------------------------------------------------------------------------------------
    def collect(self, step: int, timer: StageTimer) -> tuple[Batch, dict[str, float]]:
        """Rollout -> reshard -> reward, repeated while dynamic sampling still lacks informative groups.

        With algorithm.filter_groups, groups whose scores are all equal carry no GRPO signal and are
        dropped; more prompts are generated until every rank holds a full batch (or max_sample_rounds).
        Ranks end with the same number of samples (the minimum over ranks), so the update stays in lockstep.
        """
        cfg = self.cfg
        n = cfg.rollout.n
        target = cfg.data.train_batch_size * n // self.actor_mesh.dp_size
        kept, metrics, rounds, generated = None, {}, 0, 0
        while True:
            rounds += 1
            with timer("rollout"):
                batch = self.generate(next(self.sampler), step, rounds - 1)
            with timer("reshard_batch"):
                batch = redistribute(batch, self.rollout_mesh, self.actor_mesh)
            self.attach_meta(batch)
            metrics.update(self.run_hooks("after_rollout", step, batch))
            with timer("reward"):
                metrics.update(self.compute_reward(batch))
            metrics.update(self.run_hooks("after_reward", step, batch))
            self.place_token_scores(batch)
            generated += len(batch)
            if cfg.algorithm.filter_groups:
                batch = batch.select(informative_groups(batch["scores"], batch["index"]))
            kept = batch if kept is None else Batch.cat([kept, batch])
            have = int(reduce_min(len(kept)))
            if not cfg.algorithm.filter_groups or have >= target or rounds >= cfg.algorithm.max_sample_rounds:
                break
        keep = min(have, target) if cfg.algorithm.filter_groups else have
        if cfg.algorithm.filter_groups:
            keep -= keep % n  # whole groups
            metrics["train/kept_sample_ratio"] = len(kept) / max(generated, 1)
            metrics["train/sample_rounds"] = float(rounds)
        if keep == 0:
            raise SpmdrlError(
                f"step {step}: no samples left to train on after {rounds} rollout round(s) (dynamic sampling or a "
                "hook dropped them all); raise algorithm.max_sample_rounds or check the reward"
            )
        return kept.select(slice(0, keep)), metrics

    def generate(self, prompt_idx: list[int], step: int, round_: int = 0) -> Batch:
        """Rollout on this rank's TP group: same prompts and seeds on every rank of the group."""
        r = self.rollout_mesh
        prompts = [self.train_ds.prompt_ids(i) for i in prompt_idx]
        first = (round_ * self.cfg.data.train_batch_size) + r.dp_rank * len(prompts)
        seeds = request_seeds(self.cfg.trainer.seed, step, first, len(prompts))
        self.rollout.wake_up()
        out = self.rollout.generate(prompts, self.train_spec, seeds)
        n = self.train_spec.n
        batch = self.to_batch(prompts, prompt_idx, out, n)
        if "baseline_rewards" in getattr(self.adv_fn, "requires", ()):  # ReMax: greedy rollout as the baseline
            greedy = self.rollout.generate(prompts, self.greedy_spec, seeds)
            gb = self.to_batch(prompts, prompt_idx, greedy, 1)
            self.attach_meta(gb)
            self.compute_reward(gb)  # the same shaped reward the samples get
            batch["baseline_rewards"] = gb["scores"].repeat_interleave(n)
        return batch

    def to_batch(self, prompts: list[list[int]], prompt_idx: list[int], out, n: int) -> Batch:
        B = len(prompts) * n
        P = max(len(p) for p in prompts)
        R = max(1, max(len(x) for x in out.response_ids))
        prompt_t = torch.full((B, P), self.pad_id, dtype=torch.long)
        resp_t = torch.full((B, R), self.pad_id, dtype=torch.long)
        lp_t = torch.zeros(B, R)
        plen = torch.zeros(B, dtype=torch.long)
        rlen = torch.zeros(B, dtype=torch.long)
        for i in range(B):
            p, resp = prompts[i // n], out.response_ids[i]
            prompt_t[i, : len(p)] = torch.tensor(p)
            resp_t[i, : len(resp)] = torch.tensor(resp, dtype=torch.long)
            lp_t[i, : len(resp)] = torch.tensor(out.logprobs[i], dtype=torch.float32)
            plen[i], rlen[i] = len(p), len(resp)
        idx = torch.tensor(prompt_idx, dtype=torch.long).repeat_interleave(n)
        return Batch({
            "prompts": prompt_t, "prompt_len": plen, "responses": resp_t, "response_len": rlen,
            "response_mask": (torch.arange(R)[None] < rlen[:, None]).float(), "rollout_log_probs": lp_t,
            "index": idx, "truncated": torch.tensor([f == "length" for f in out.finish_reason], dtype=torch.float32),
        })

    def attach_meta(self, batch: Batch, ds: PromptDataset | None = None) -> None:
        """Per-sample metadata, re-derived locally from the dataset row in `index`."""
        ds = ds or self.train_ds
        rows = batch["index"].tolist()
        uniq = sorted(set(rows))
        pb = ds.batch(uniq)
        pos = {row: i for i, row in enumerate(uniq)}
        batch.meta["data_source"] = [pb.data_source[pos[r]] for r in rows]
        batch.meta["ground_truth"] = [pb.ground_truth[pos[r]] for r in rows]
        batch.meta["extra_info"] = [pb.extra_info[pos[r]] for r in rows]
        batch.meta["raw_prompt"] = [pb.raw_prompt[pos[r]] for r in rows]
        batch.meta["response_text"] = self.tokenizer.batch_decode(
            [batch["responses"][i, : int(batch["response_len"][i])].tolist() for i in range(len(batch))],
            skip_special_tokens=True,
        )

    def compute_reward(self, batch: Batch, shaping: bool = True) -> dict[str, float]:
        """batch["scores"] [B]: rule/custom score, weighted, plus DAPO overlong shaping (shaping=False: the raw
        rule score, which validation reports as accuracy)."""
        r = self.cfg.reward
        scores, _ = compute_rewards(
            self.reward_fn, batch.meta["data_source"], batch.meta["response_text"], batch.meta["ground_truth"],
            batch.meta["extra_info"],
        )
        metrics = {}
        if not shaping:
            batch["scores"] = scores
            return metrics
        if self.reward_model is not None:  # a weighted sum with the rule score
            lens = batch["prompt_len"].tolist(), batch["response_len"].tolist()
            rm = self.reward_model.score(
                batch.meta["raw_prompt"], batch.meta["response_text"],
                [batch["prompts"][i, :p].tolist() for i, p in enumerate(lens[0])],
                [batch["responses"][i, :n].tolist() for i, n in enumerate(lens[1])],
            )
            metrics["reward/model_score_mean"] = float(rm.mean())
            metrics["reward/rule_score_mean"] = float(scores.mean())
            scores = combine_rewards(scores, rm, r.rule_weight, r.model_weight)
        else:
            scores = r.rule_weight * scores
        if r.overlong_buffer_len > 0:
            penalty = overlong_penalty(batch["response_len"], self.cfg.data.max_response_length, r.overlong_buffer_len,
                                       r.overlong_penalty_factor)
            scores = scores + penalty
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        batch["scores"] = scores
        return metrics

    def place_token_scores(self, batch: Batch) -> None:
        """Outcome score on the last response token (what token-level estimators consume)."""
        R = batch["responses"].shape[1]
        last = (batch["response_len"] - 1).clamp(min=0)
        token_scores = torch.zeros(len(batch), R)
        token_scores[torch.arange(len(batch)), last] = batch["scores"] * (batch["response_len"] > 0)
        batch["token_level_scores"] = token_scores

    def apply_kl_in_reward(self, batch: Batch) -> dict[str, float]:
        if not self.cfg.algorithm.use_kl_in_reward:
            batch["token_level_rewards"] = batch["token_level_scores"]
            return {}
        mask = batch["response_mask"]
        kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], self.cfg.algorithm.kl_penalty) * mask
        beta = self.kl_ctrl.value
        batch["token_level_rewards"] = batch["token_level_scores"] - beta * kl
        current = float(reduce_mean({"kl": float(masked_mean(kl, mask))})["kl"])  # same value on every rank
        self.kl_ctrl.update(current, self.cfg.data.train_batch_size * self.cfg.rollout.n)
        return {"actor/reward_kl": current, "actor/kl_coef": beta}

    def forward_logprobs(self, engine: FSDPEngine, batch: Batch) -> torch.Tensor:
        a = self.cfg.actor
        return forward_all(engine, batch, a.micro_batch_size, self.pad_id, lambda eng, tb: eng.logprobs(
            tb, temperature=self.cfg.rollout.temperature, chunk_size=a.logprob_chunk_size)[0])

    def update(self, engine: FSDPEngine, batch: Batch, body, role: str) -> dict[str, float]:
        sec = getattr(self.cfg, role)
        mesh = self.meshes[role]
        mini = (self.cfg.actor.ppo_mini_batch_size or self.cfg.data.train_batch_size) * self.cfg.rollout.n // mesh.dp_size
        return run_updates(
            engine, batch, epochs=sec.ppo_epochs, mini_size=mini, micro_size=sec.micro_batch_size, pad_id=self.pad_id,
            agg_mode=sec.loss_agg_mode, dp_size=mesh.dp_size, dp_group=mesh.mesh.get_group("dp"), body=body, prefix=role,
        )

    def run_hooks(self, stage: str, step: int, batch: Batch, metrics: dict | None = None) -> dict[str, float]:
        if not self.hooks.by_stage[stage]:
            return {}
        ctx = HookContext(stage, step, self.cfg, batch, self.meshes, self.tokenizer, metrics=metrics or {})
        before = set(ctx.metrics)
        self.hooks.run(stage, ctx)
        return {k: v for k, v in ctx.metrics.items() if k not in before}

    def batch_metrics(self, batch: Batch) -> dict[str, float]:
        mask = batch["response_mask"]
        m = {
            "train/reward_mean": float(batch["scores"].mean()),
            "train/reward_std": float(batch["scores"].std()) if len(batch) > 1 else 0.0,
            "train/response_length_mean": float(batch["response_len"].float().mean()),
            "train/response_clip_ratio": float(batch["truncated"].mean()),
            "train/advantage_mean": float(masked_mean(batch["advantages"], mask)),
        }
        if "old_log_probs" in batch:  # else the update measured it (on-policy)
            lp_diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()
            m["rollout/logprob_diff_mean"] = float(masked_mean(lp_diff, mask))
            m["rollout/logprob_diff_max"] = float((lp_diff * mask).max())
        return m

    # ---- validation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Accuracy per data source on the validation set (its own sampling settings), all ranks reduced."""
        r, ds = self.rollout_mesh, self.val_ds
        t0 = time.perf_counter()
        per = -(-len(ds) // r.dp_size)
        rows = list(range(r.dp_rank * per, min(len(ds), (r.dp_rank + 1) * per)))
        sources = self.val_sources
        sums = torch.zeros(2 * len(sources), dtype=torch.float64)
        hook_metrics: dict[str, float] = {}
        self.rollout.wake_up()  # stays awake: the next step's rollout follows
        chunk = max(1, self.cfg.data.val_batch_size // r.dp_size) if self.cfg.data.val_batch_size else max(1, len(rows))
        for start in range(0, len(rows), chunk):
            part = rows[start: start + chunk]
            prompts = [ds.prompt_ids(i) for i in part]
            seeds = request_seeds(self.cfg.trainer.seed + 1, 0, part[0], len(part))
            out = self.rollout.generate(prompts, self.val_spec, seeds)
            batch = self.to_batch(prompts, part, out, self.val_spec.n)
            self.attach_meta(batch, ds)
            self.compute_reward(batch, shaping=False)
            for k, v in self.run_hooks("on_validation", self.global_step, batch).items():  # mean over chunks
                hook_metrics[k] = hook_metrics.get(k, 0.0) + v * len(part) / len(rows)
            if r.tp_rank == 0:
                for s, src in zip(batch["scores"].tolist(), batch.meta["data_source"]):
                    k = sources.index(src)
                    sums[k] += s
                    sums[len(sources) + k] += 1
        sums = reduce_sum(sums)
        acc = {f"val/accuracy/{src}": float(sums[k] / max(sums[len(sources) + k], 1)) for k, src in enumerate(sources)}
        acc["val/accuracy"] = sum(acc.values()) / len(acc)
        acc.update(reduce_mean(hook_metrics, weight=1.0 if r.tp_rank == 0 else 0.0))
        acc["timing/validation_s"] = time.perf_counter() - t0
        if dist.get_rank() == 0:
            log.info("validation: %s", ", ".join(f"{k}={v:.3f}" for k, v in acc.items()))
        return acc

    # ---- checkpoints and faults (docs/reliability.md) --------------------------------------------------
    def engines(self) -> dict[str, FSDPEngine]:
        """The trainable engines a checkpoint holds."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def save_checkpoint(self) -> str:
        state = {
            "sampler": self.sampler.state_dict(), "bad_steps": self.bad_steps, "bad_steps_total": self.bad_steps_total,
            "kl_ctrl": self.kl_ctrl.state_dict(),
        }

        def hf_files(out_dir: str) -> None:  # what `spmdrl export` needs besides the weights
            config = copy.deepcopy(self.actor.hf.config)
            config.use_cache = True  # the engine turns the KV cache off for training; an exported model wants it
            config.save_pretrained(out_dir)
            self.tokenizer.save_pretrained(out_dir)

        return self.checkpoints.save(self.global_step, engines=self.engines(), trainer_state=state,
                                     config_toml=to_toml(self.cfg), rng=rng_state(), hf_files=hf_files)

    def load_checkpoint(self, path: str) -> None:
        """Restore everything a step depends on, so the run continues exactly as if it had not stopped."""
        state = self.checkpoints.load(path, engines=self.engines(), config_toml=to_toml(self.cfg))
        self.sampler.load_state_dict(state["sampler"])
        self.global_step = int(state["step"])
        self.bad_steps, self.bad_steps_total = int(state.get("bad_steps", 0)), int(state.get("bad_steps_total", 0))
        if state.get("kl_ctrl") is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        sync_weights(self.actor, self.rollout, bucket_mb=self.cfg.rollout.weight_sync_bucket_mb, dtype=self.rollout_dtype)
        if "rng" in state:
            set_rng_state(state["rng"])
        else:  # another world size: per-rank RNG streams cannot carry over
            seed_everything(self.cfg.trainer.seed + self.global_step)
            log.warning("resumed on a different world size: RNG states reseeded, not restored")
        log.info("resumed from %s at step %d", state.get("path", path), self.global_step)

    def inject_test_fault(self, step: int) -> None:
        """Test-only: the fault env SPMDRL_FAULT_INJECT asks of this rank at this step (spmdrl.faults)."""
        if FAULT_ENV in os.environ:
            inject_fault(injected_fault(self.rank, step), self.rank, step, self.actor)

    def reward_error_metrics(self) -> dict[str, float]:
        """reward/errors and reward/timeouts of this step, summed over ranks (reward.on_error = zero)."""
        if not isinstance(self.reward_fn, GuardedReward) or self.reward_fn.on_error != "zero":
            return {}
        errors, timeouts = self.reward_fn.take_counts()
        w = 1.0 if self.actor_mesh.tp_rank == 0 else 0.0  # TP ranks score the same samples
        t = reduce_sum(torch.tensor([errors * w, timeouts * w]))
        return {"reward/errors": float(t[0]), "reward/timeouts": float(t[1])}

    def count_bad_step(self, metrics: dict[str, float]) -> bool:
        """A step with a non-finite loss or grad norm was skipped by the engine; count it (metrics agree on
        every rank, so every rank counts the same)."""
        bad = is_bad_step(metrics)
        self.bad_steps = self.bad_steps + 1 if bad else 0
        self.bad_steps_total += int(bad)
        metrics["train/bad_steps"] = float(self.bad_steps_total)
        return bad

    def check_bad_steps(self) -> None:
        limit = self.cfg.trainer.max_bad_steps
        if self.bad_steps >= limit:
            last = latest_checkpoint(self.checkpoints.root)
            raise SpmdrlError(
                f"{self.bad_steps} consecutive steps (up to step {self.global_step}) had a non-finite loss or grad "
                f"norm and were skipped (trainer.max_bad_steps = {limit}); the last good checkpoint is "
                f"{last or 'none (none was saved)'}; lower actor.lr or check the data and reward of those steps"
            )
