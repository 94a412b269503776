"""The RL loop. Every rank runs this same code. `Trainer.step` runs one of two role loops, each on one screen and
each stage in it one visible, timed call:

    training role:  take a batch (rollout -> batch move -> reward) -> old logprobs -> ref logprobs
                    -> teacher logprobs -> values -> advantages -> updates -> send weights
    rollout role:   generate and post batches -> load weights -> see the sends complete

and both end in the same metric reduction. Colocated, every rank runs the training role, whose first stage
generates the batch (the two roles interleaved in one process).

with every memory phase change on the line before the stage it serves. The Trainer builds every component
once, in `__init__`, and calls each through a named attribute: `generator` (rollouts, loop/generate.py),
`scorer` (rewards, loop/scoring.py), `learner` (forward passes, advantages, updates, loop/learner.py),
`validator` (loop/validate.py), `checkpointer` and `bad_steps` (loop/run_state.py), `memory` (loop/memory.py),
`weight_sync` (reshard/sync.py), `hooks` (hooks.py); dynamic sampling's arithmetic is `SampleRounds`
(loop/collect.py).

Split placement (placement.mode = "split"): the rollout ranks run the rollout role (loop/split.py) and the
training ranks the training role, taking each batch from the stream; they meet at the metric reduction, with no
transfer pending on either side.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from spmdrl.algos.kl import AdaptiveKLController, FixedKLController
from spmdrl.batch import Batch
from spmdrl.checkpoint import CheckpointManager, checkpoint_root, resolve_resume, resume_advice
from spmdrl.config import Config, to_toml
from spmdrl.config.derived import (logprob_diff_bounds, offload_kinds, on_policy, rollout_correction_active,
                                    sampler_truncates, uses_ref)
from spmdrl.data.prompts import PromptDataset
from spmdrl.data.sampler import DistributedPromptSampler
from spmdrl.dist.collectives import reduce_max, reduce_mean, redistribute
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.data.images import VisionPrompts
from spmdrl.models.model import load_hf_config
from spmdrl.models.vision import is_vision_language
from spmdrl.faults import graceful_stop, inject_fault_if_asked, named_failures, set_collective_timeout
from spmdrl.hooks import HookRunner, StageHooks
from spmdrl.loop.build import (
    build_agent, build_engines, build_rollout, build_tools, build_weight_sync, rollout_load_format, sampling_specs,
    tool_schemas,
)
from spmdrl.loop.collect import SampleRounds
from spmdrl.loop.correction import MismatchWatch
from spmdrl.loop.generate import Generator
from spmdrl.loop.generations import GenerationLog
from spmdrl.loop.learner import Learner
from spmdrl.loop.memory import MemoryLifecycle
from spmdrl.loop.parity import ParityCheck
from spmdrl.loop.run_state import BadSteps, RunCheckpointer
from spmdrl.loop.scoring import Scorer
from spmdrl.loop.split import BatchStream
from spmdrl.loop.turn_metrics import trajectory_metrics
from spmdrl.loop.validate import Validator
from spmdrl.metrics import MetricsLogger, StageTimer, device_peak_tflops, flops_metrics, logger_for, peak_memory_gb
from spmdrl.reshard.adapter import AdapterSync
from spmdrl.reshard.sync import WeightSync
from spmdrl.rewards.custom import build_reward_fn, extra_means
from spmdrl.rng import seed_everything

log = logging.getLogger("spmdrl")


class Trainer:
    """One rank's RL run. Every component is built in `__init__`; `fit` / `step` / `train` call them by name."""

    generator: Generator | None  # rollouts (a rollout rank only)
    scorer: Scorer  # rewards, and reward error counts
    learner: Learner  # forward passes, advantages, updates
    validator: Validator | None  # None without data.val_files
    checkpointer: RunCheckpointer  # save / exact resume
    bad_steps: BadSteps
    memory: MemoryLifecycle
    weight_sync: WeightSync | AdapterSync  # AdapterSync: a LoRA actor, rollout.lora_sync = adapter
    stream: BatchStream | None  # split placement only
    hooks: StageHooks
    generations: GenerationLog  # logging.log_generations / dump_rollouts
    logger: MetricsLogger

    def __init__(self, cfg: Config, layout: dict, rank: int, world_size: int, device: torch.device,
                 config_toml: str | None = None):
        """config_toml: the run's config as the user gave it, recorded in output_dir/config.toml and in every
        checkpoint (default: to_toml(cfg); spmdrl.train passes the config before its hub ids became local
        snapshot directories, spmdrl.hub)."""
        from transformers import AutoTokenizer

        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.config_toml = to_toml(cfg) if config_toml is None else config_toml
        seed_everything(cfg.trainer.seed)
        self.meshes = RoleMeshes(layout, rank, device.type)
        print(f"[rank{rank}] {self.meshes.describe()}", flush=True)  # every rank: its place in every mesh
        self.rollout_mesh, self.actor_mesh = self.meshes["rollout"], self.meshes["actor"]
        # split placement: this rank does the stages of the roles it holds (rollout, or the training roles)
        split, self.trains = self.meshes.split, self.actor_mesh.active
        # ---- data: tokenizer, prompt datasets, sampler, reward function
        tok_path = cfg.model.tokenizer_path or cfg.model.path
        tokenizer = self.tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=cfg.model.trust_remote_code)
        pad_id = self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        d = cfg.data
        tools = build_tools(cfg)  # multi-turn: the prompts name them (docs/tools.md)
        ds_kw = dict(
            max_prompt_length=d.max_prompt_length, truncation=d.truncation, filter_overlong=d.filter_overlong,
            prompt_key=d.prompt_key, apply_chat_template=d.apply_chat_template, tools=tool_schemas(tools),
        )
        if is_vision_language(load_hf_config(cfg.model.path, cfg.model.trust_remote_code)):  # images in the prompts
            ds_kw.update(vision=VisionPrompts(cfg.model.path, tokenizer, load_hf_config(cfg.model.path)),
                         image_key=d.image_key)
        train_ds = self.train_ds = PromptDataset(d.train_files, tokenizer, **ds_kw)
        val_ds = PromptDataset(d.val_files, tokenizer, **ds_kw) if d.val_files else None
        sampler = self.sampler = DistributedPromptSampler(  # training ranks of a split layout only count its draws
            len(train_ds), dp_rank=self.rollout_mesh.dp_rank if self.rollout_mesh.active else 0,
            dp_size=self.rollout_mesh.dp_size,
            batch_size=d.train_batch_size, seed=cfg.trainer.seed, shuffle=d.shuffle,
        )
        reward_fn = build_reward_fn(cfg.reward)  # a user function runs in a worker process (rewards/worker.py)
        # ---- models: training engines (training ranks), memory lifecycle, reward model, rollout engine, weight sync
        self.memory = MemoryLifecycle(device, {}, offload_kinds(cfg, split), components=cfg.memory.report_components)
        self.memory.begin_build()
        engines = build_engines(cfg, self.meshes, device, on_built=self.memory.adopt) if self.trains else None
        self.actor, self.ref, self.critic, self.teacher = (
            (engines.actor, engines.ref, engines.critic, engines.teacher) if engines else (None,) * 4)
        self.memory.settle()  # configured state to host memory before vLLM sizes itself to the free GPU memory
        alg = cfg.algorithm
        kl_ctrl = (
            AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon) if alg.kl_ctrl == "adaptive"
            else FixedKLController(alg.kl_coef)
        )
        self.hooks = StageHooks(HookRunner(cfg.hooks.files), cfg, self.meshes, tokenizer)
        self.on_policy = on_policy(cfg)  # the update's own log-probs are the old ones
        self.truncates, self.corrects = sampler_truncates(cfg), rollout_correction_active(cfg)
        # the reference policy's log-probs: the ref engine's, or with LoRA the actor's with its adapters disabled
        self.uses_ref = self.trains and uses_ref(cfg)
        reward_model = None
        if cfg.reward.model_path and self.trains:
            from spmdrl.rewards.model import RewardModelScorer

            reward_model = RewardModelScorer(
                cfg.reward.model_path, self.meshes["reward"], device, tokenizer_path=cfg.reward.model_tokenizer_path,
                policy_tokenizer=tokenizer, micro_batch_size=cfg.reward.model_micro_batch_size,
                trust_remote_code=cfg.model.trust_remote_code, dtype=cfg.model.dtype,
            )
        resume_from = resolve_resume(cfg)
        load_format = rollout_load_format(cfg, device, resuming=resume_from is not None)
        rollout = None  # this rank's rollout engine (a rollout rank only)
        if self.rollout_mesh.active:
            rollout = self.memory.rollout = build_rollout(cfg, self.meshes, device, tok_path, load_format)
        self.rollout = rollout
        seed_everything(cfg.trainer.seed)  # building the engine reseeds the global RNG
        self.weight_sync = build_weight_sync(
            cfg, self.actor, rollout, self.meshes, device, memory=self.memory, split=split,
            actor_grid=layout["actor"].mesh_ranks(),
            hf_config=self.actor.hf_config() if self.actor is not None and not split
            else load_hf_config(cfg.model.path, cfg.model.trust_remote_code),
        )
        # ---- the loop's components, each given what it needs (docs/architecture.md, "The loop")
        specs = sampling_specs(cfg, tokenizer.eos_token_id)
        self.learner = Learner(cfg, self.meshes, self.actor, self.ref, self.critic, kl_ctrl, pad_id, teacher=self.teacher)
        scorer = self.scorer = Scorer(cfg, tokenizer, reward_fn, reward_model)
        generator = None
        agent = build_agent(cfg, tokenizer, rollout, self.meshes, tools) if rollout is not None else None
        if rollout is not None:
            generator = Generator(cfg, self.rollout_mesh, rollout, specs, train_ds, pad_id, scorer,
                                  greedy_baseline="baseline_rewards" in getattr(self.learner.adv_fn, "requires", ()),
                                  agent=agent, sampler=sampler)
        self.generator = generator
        cuda = device.type == "cuda"
        self.parity = None  # trainer = sampler, checked before step 1 (colocated: actor and rollout on every rank)
        if cfg.rollout.parity_check and self.trains and rollout is not None:
            self.parity = ParityCheck(cfg, self.actor, rollout, train_ds, pad_id,
                                      lambda engine, batch: self.learner.logprobs(engine, batch, count_routes=False), cuda,
                                      self.weight_sync)
        self.mismatch = MismatchWatch(*logprob_diff_bounds(cfg, cuda))
        self.stream = BatchStream(cfg, self.meshes, generator, sampler, self.weight_sync, self.memory) if split else None
        self.tool_names = [t.name for t in tools]  # multi-turn: the keys of the per-tool metrics
        self.generations = GenerationLog(cfg.logging, cfg.trainer.output_dir, rank,
                                         lambda *rows: self.logger.log_generations(*rows))
        self.validator = None
        if val_ds is not None:
            self.validator = Validator(cfg, self.rollout_mesh, val_ds, rollout, self.memory, specs, scorer, self.hooks,
                                       pad_id, agent=agent, generations=self.generations)
        # ---- outputs and run state: config copy, metrics, checkpoints, resume
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        if rank == 0:
            with open(os.path.join(cfg.trainer.output_dir, "config.toml"), "w") as f:
                f.write(self.config_toml)
        self.logger = logger_for(cfg, rank, resume=resume_from is not None,
                                 progress_total=cfg.trainer.total_steps)
        self.global_step = 0
        self.actor_version = 0  # the step of the actor's last update (split placement's weight versions)
        # reliability (docs/reliability.md): checkpoints, bounded collectives, reward guard, resume
        root = checkpoint_root(cfg.trainer.output_dir)
        manager = CheckpointManager(root, keep_last=cfg.checkpoint.keep_last, device=device,
                                    fallback=cfg.checkpoint.resume == "auto",
                                    writer=self.actor_mesh.layout.ranks[0])  # it holds the engines
        self.bad_steps = BadSteps(cfg.trainer.max_bad_steps, root)
        trained = {} if self.actor is None else {"actor": self.actor}  # what a checkpoint holds
        if self.critic is not None:
            trained["critic"] = self.critic
        self.checkpointer = RunCheckpointer(cfg, manager, trained, tokenizer, sampler, kl_ctrl, self.bad_steps,
                                            self.weight_sync, self.stream, rank, self.config_toml, self.memory,
                                            partial=generator.partial if generator is not None else None)
        set_collective_timeout(cfg.trainer.dist_timeout_s)
        self.resumed_from = resume_from
        # whether the rollout engine's weights came through the sync (else it read the checkpoint itself)
        self.rollout_synced = bool(resume_from) or load_format == "dummy" or isinstance(self.weight_sync, AdapterSync)
        if resume_from:
            self.resume(resume_from)
        elif load_format == "dummy" or isinstance(self.weight_sync, AdapterSync):
            self.memory.for_sync()
            self.weight_sync()  # vLLM holds random weights (or no adapter) until the actor's arrive

    def resume(self, path: str) -> None:
        """Continue from checkpoint `path` (loop/run_state.py), the actor's weights synced to the rollout engine."""
        self.global_step = self.checkpointer.load(path)
        if self.trains and self.global_step > self.cfg.trainer.critic_warmup:
            self.actor_version = self.global_step

    # ---- the loop -----------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        last: dict[str, float] = {}
        timer = StageTimer(self.device)  # names validation and checkpointing in failure messages
        set_collective_timeout(cfg.trainer.dist_timeout_s)
        try:
            # a stop signal: the step ends, is saved and the run stops (checkpoint.grace_s; docs/reliability.md)
            with named_failures(lambda: self.global_step, cfg.trainer.dist_timeout_s,
                                lambda: resume_advice(cfg.trainer.output_dir)), \
                    graceful_stop(self.checkpointer.grace_s()):
                parity = {}  # logged with step 1 (a resumed run checks again, and says so in its log only)
                if self.parity is not None:
                    with timer("parity_check"):
                        parity = self.parity.run(self.memory, self.rollout_synced)
                    parity = {} if self.resumed_from else parity
                if self.validator is not None and cfg.trainer.val_before_train and not self.resumed_from:
                    with timer("validation"):
                        self.logger.log(0, self.validator.run(self.global_step))
                if self.global_step >= cfg.trainer.total_steps:
                    log.info("at step %d of trainer.total_steps = %d: nothing to train (raise it to go on)",
                             self.global_step, cfg.trainer.total_steps)
                while self.global_step < cfg.trainer.total_steps:
                    self.global_step += 1
                    StageTimer.failed = StageTimer.last = None
                    inject_fault_if_asked(self.rank, self.global_step, self.actor)  # tests only (spmdrl/faults.py)
                    metrics = self.step(self.global_step)
                    metrics.update(parity)
                    parity = {}
                    since_save_s = metrics.pop("_since_save_s")
                    self.generations.flush(self.global_step, "train")
                    metrics.update(self.scorer.error_metrics())
                    bad = self.bad_steps.count(metrics)
                    done = self.global_step == cfg.trainer.total_steps
                    freq = cfg.trainer.test_freq
                    if self.validator is not None and (done or (freq and self.global_step % freq == 0)):
                        with timer("validation"):
                            metrics.update(self.validator.run(self.global_step))
                    self.logger.log(self.global_step, metrics)
                    self.mismatch.check(self.global_step, metrics)
                    last = metrics
                    self.bad_steps.check(self.global_step)
                    saved = None
                    if not bad and self.checkpointer.due(self.global_step, done, since_save_s):
                        with timer("checkpoint"):
                            saved = self.checkpointer.save(self.global_step)
                    stop = self.checkpointer.stop_agreed()  # the step boundary: all ranks stop here, or none
                    if stop and not done:
                        if not bad and saved is None:
                            with timer("checkpoint"):
                                saved = self.checkpointer.save(self.global_step)
                        raise self.checkpointer.stopped(stop, self.global_step, saved)
        finally:
            self.logger.close()
        return last

    def step(self, step: int) -> dict[str, float]:
        """One RL step: the rollout role's loop body on the rollout ranks of a split layout, the training role's on
        the training ranks; colocated, every rank runs the training role, whose first stage generates the batch
        (the two roles interleaved in one process). Both meet at the metric reduction with nothing in flight."""
        timer, t0 = StageTimer(self.device), time.perf_counter()
        if self.stream is not None and self.rollout_mesh.active:
            batch, metrics = None, self.rollout_role(step, timer)
        else:
            batch, metrics = self.training_role(step, timer)
        return self.reduce_step_metrics(batch, metrics, timer, t0)

    def rollout_role(self, step: int, timer: StageTimer) -> dict[str, float]:
        """Split placement, the rollout ranks (loop/split.py): generate and post the batches up to step + k (the
        asynchronous stream: admit, step the engine, post each group as it completes), then load this
        step's weights and see every batch send complete."""
        self.stream.produce(step, timer)
        metrics = self.stream.take_metrics()
        if step > self.cfg.trainer.critic_warmup:
            self.memory.for_sync()
            with timer("wait_weights"):
                metrics.update(self.stream.load_weights(step))
        with timer("rollout_wait"):
            self.stream.wait_sends()
        return metrics

    def training_role(self, step: int, timer: StageTimer) -> tuple[Batch, dict[str, float]]:
        """The training ranks: take a batch, score it, forward passes, advantages, updates, send the weights."""
        cfg, memory, learner, hooks = self.cfg, self.memory, self.learner, self.hooks
        train_actor = step > cfg.trainer.critic_warmup
        batch, metrics = self.take_batch(step, timer)
        self.generations.record(step, "train", batch, self.actor_mesh)
        # ---- forward passes: old log-probs, ref log-probs, values
        memory.for_training("actor", update=False, keep_rollout_weights=not train_actor)
        if not self.on_policy:
            with timer("old_logprob"):
                batch["old_log_probs"] = learner.logprobs(self.actor, batch)
        if train_actor and self.truncates:  # top-k / top-p sampling: the actor under the same truncation
            with timer("truncated_logprob"):
                metrics.update(learner.truncated_mismatch(batch))
        if self.uses_ref:
            memory.for_training("ref" if self.ref is not None else "actor", update=False)
            with timer("ref_logprob"):
                batch["ref_log_probs"] = learner.ref_logprobs(batch)
        if self.teacher is not None:  # on-policy distillation: the teacher scores the student's tokens
            memory.for_training("teacher", update=False)
            with timer("teacher_logprob"):
                batch["teacher_log_probs"] = learner.teacher_logprobs(batch)
        if self.critic is not None:
            memory.for_training("critic", update=False)
            with timer("values"):
                batch["values"] = learner.values(batch)
        # ---- advantages
        with timer("advantage"):
            metrics.update(learner.kl_in_reward(batch))
            metrics.update(learner.advantages(batch))
            if self.teacher is not None:
                metrics.update(learner.distill(batch))
        metrics.update(hooks("after_advantage", step, batch))
        metrics.update(hooks("before_update", step, batch))
        # ---- updates
        if self.critic is not None:
            memory.for_training("critic")
            with timer("update_critic"):
                metrics.update(learner.update_critic(batch))
        if train_actor:
            memory.for_training("actor")
            actor_batch = batch
            if self.corrects:  # [rollout_correction]: weights and rejection (on-policy after one pi_old pass)
                with timer("rollout_correction"):
                    actor_batch, corrected = learner.correct_rollout(batch)
                    metrics.update(corrected)
            with timer("update_actor"):
                metrics.update(learner.update_actor(actor_batch, batch, measured=self.truncates))
        metrics.update(hooks("after_update", step, batch))
        metrics.update(learner.batch_metrics(batch, self.actor_version))  # before the sync: the pre-update lag
        # ---- send the weights (split placement: the batches posted for the next steps taken in first)
        if self.stream is not None:
            with timer("wait_batch"):
                self.stream.take_in(step)
        if train_actor:
            memory.for_sync()
            with timer("weight_sync"):
                metrics.update(self.weight_sync())
            self.actor_version = step
        metrics.update(memory.step_metrics())
        metrics.update(hooks("after_step", step, batch, metrics=dict(metrics)))
        return batch, metrics

    def take_batch(self, step: int, timer: StageTimer) -> tuple[Batch, dict[str, float]]:
        """This step's scored batch: colocated, generated now and moved from the rollout layout to the actor's;
        split placement, the one the rollout ranks posted. In rounds while dynamic sampling lacks informative
        groups (loop/collect.py)."""
        metrics: dict[str, float] = {}
        hooks = self.hooks
        rounds = SampleRounds(self.cfg, self.meshes, self.scorer, self.train_ds)
        while rounds.more():
            if self.stream is None:
                self.memory.for_rollout()
                with timer("rollout"):
                    batch = self.generator.generate(next(self.sampler), step, rounds.index, self.actor_version)
                with timer("reshard_batch"):  # from the rollout layout to the actor's
                    batch = redistribute(batch, self.rollout_mesh, self.actor_mesh)
                for k, v in self.generator.take_metrics().items():  # the multi-turn loop's time, summed
                    metrics[k] = metrics.get(k, 0.0) + v
            else:
                with timer("wait_batch"):
                    batch = self.stream.receive(step)
                metrics.update(self.stream.take_messages())  # asynchronous: the posts its groups were streamed in
            self.scorer.attach_meta(batch, self.train_ds, self.actor_mesh)
            if "trajectory" in batch:  # multi-turn: turns, tool calls and failures, of the last round
                metrics.update(trajectory_metrics(batch, self.tool_names, self.actor_mesh))
            metrics.update(hooks("after_rollout", step, batch))
            with timer("reward"):
                metrics.update(self.scorer.score(batch, self.actor_mesh))
            metrics.update(hooks("after_reward", step, batch))
            self.scorer.place_token_scores(batch)
            rounds.add(batch)
        batch, sampled = rounds.batch(step)
        metrics.update(sampled)
        return batch, metrics

    def reduce_step_metrics(self, batch: Batch | None, metrics: dict, timer: StageTimer, t0: float) -> dict[str, float]:
        """One all-reduce of every metric (tp copies weighted out); the token count rides along. Split placement:
        the roles report different keys (each key is averaged over the ranks that have it) and their timings
        go in too (rank 0, which logs, is a rollout rank); the time a role waits here for the other is
        timing/<role>_wait_s."""
        if batch is not None:  # throughput counts prompt and model tokens; the FLOPs, every token computed on
            metrics["_tokens"] = float(batch["response_mask"].sum() + batch["prompt_len"].sum())
            metrics["_seq_tokens"] = float(batch["response_len"].sum() + batch["prompt_len"].sum())
            metrics["_seq_sq"] = float(((batch["response_len"] + batch["prompt_len"]).double() ** 2).sum())
            metrics["_response_tokens"] = float(batch["response_len"].sum())
            metrics["_trained_tokens"] = float(batch["response_mask"].sum())
        metrics["_since_save_s"] = self.checkpointer.since_save()  # checkpoint.save_every_min: one clock for all ranks
        mesh = self.actor_mesh if self.trains else self.rollout_mesh
        split = self.stream is not None
        if split:
            with timer("train_wait" if self.trains else "rollout_wait"):
                split_max = self.split_maxima(metrics)
            metrics.update(timer.as_metrics())
            metrics.update(self.busy(metrics, time.perf_counter() - t0))
        metrics = extra_means(reduce_mean(metrics, weight=mesh.leader_weight()))
        if split:
            metrics.update(split_max)
        tokens = metrics.pop("_tokens") * self.actor_mesh.dp_size
        seq_tokens = metrics.pop("_seq_tokens") * self.actor_mesh.dp_size
        seq_sq = metrics.pop("_seq_sq") * self.actor_mesh.dp_size
        response_tokens = metrics.pop("_response_tokens") * self.actor_mesh.dp_size
        trained_tokens = metrics.pop("_trained_tokens") * self.actor_mesh.dp_size
        if not split:
            metrics.update(timer.as_metrics())
        step_s = time.perf_counter() - t0
        if not split:
            metrics.update(self.busy(metrics, step_s))
        metrics["timing/step_s"] = step_s
        metrics["perf/tokens_per_s"] = tokens / step_s
        metrics["perf/trained_tokens_per_s"] = trained_tokens / step_s
        metrics.update(flops_metrics(
            self.weight_sync.hf_config, seq_lens_sum=seq_tokens, seq_sq_sum=seq_sq, head_tokens=response_tokens,
            update_s=metrics.get("timing/update_actor_s", 0.0), rollout_s=metrics.get("timing/rollout_s", 0.0),
            devices=self.world_size, peak_tflops=device_peak_tflops(self.device, self.cfg.trainer.device_peak_tflops),
            update_passes=self.cfg.actor.ppo_epochs,
        ))
        metrics["perf/peak_memory_gb"] = peak_memory_gb(self.device)
        return metrics

    def busy(self, metrics: dict, elapsed: float) -> dict[str, float]:
        """The fraction of the step each role's devices work for it: perf/rollout_busy (generating) and
        perf/train_busy (everything but waiting for the other role; colocated: everything but the rollout)."""
        rollout_s = metrics.get("timing/rollout_s", 0.0)
        if self.stream is None:
            return {"perf/rollout_busy": rollout_s / elapsed, "perf/train_busy": 1.0 - rollout_s / elapsed}
        if self.trains:
            waits = metrics.get("timing/wait_batch_s", 0.0) + metrics.get("timing/train_wait_s", 0.0)
            return {"perf/train_busy": 1.0 - waits / elapsed}
        return {"perf/rollout_busy": rollout_s / elapsed}

    def split_maxima(self, metrics: dict) -> dict[str, float]:
        """Split placement, at the meeting point: per step, the most weight bytes a rollout rank received and the
        most batch bytes a training rank received, and in asynchronous split the trained tokens' least and most
        version lag (one max all-reduce over the world, which is also where the roles wait for each other)."""
        recv = metrics.pop("weight_sync/bytes_recv", 0.0)
        metrics.pop("weight_sync/bytes_sent", None)
        batch_bytes = float(self.stream.take_bytes()) if self.trains else 0.0
        lags = self.stream.take_lags() if self.trains else None
        lo, hi = (-float(lags.min()), float(lags.max())) if lags is not None and len(lags) else (-1e9, -1e9)
        if lags is not None and len(lags):
            metrics["rollout/version_lag_mean"] = float(lags.mean())
        weights_max, batch_max, neg_lo, hi = reduce_max(torch.tensor([recv, batch_bytes, lo, hi], dtype=torch.float64))
        out = {"weight_sync/bytes_recv_max": weights_max, "weight_sync/bytes_lower_bound": float(self.weight_sync.lower_bound),
               "batch_move/bytes_recv_max": batch_max}
        if hi > -1e9:
            out.update({"rollout/version_lag_min": -neg_lo, "rollout/version_lag_max": hi})
        return out
