"""The RL loop. Every rank runs this same code; each stage is one visible, timed call.

    rollout -> reward -> old logprobs -> ref logprobs -> advantages -> actor update -> weight sync -> metrics
"""
from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from spmdrl.algos import ADV_ESTIMATORS, POLICY_LOSSES, agg_loss, kl_penalty, masked_mean
from spmdrl.batch import Batch
from spmdrl.config import Config, to_toml
from spmdrl.data.prompts import PromptDataset
from spmdrl.data.sampler import DistributedPromptSampler
from spmdrl.dist.collectives import reduce_mean, reduce_sum, redistribute
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.engines.fsdp import FSDPEngine, pack_sequences
from spmdrl.metrics import MetricsLogger, StageTimer, peak_memory_gb
from spmdrl.reshard.sync import sync_weights
from spmdrl.rewards import default_compute_score, load_reward_fn
from spmdrl.rng import seed_everything
from spmdrl.rewards.custom import compute_rewards
from spmdrl.rollout import SamplingSpec, build_engine

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
        log.info(self.meshes.describe())
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
        self.use_ref = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.ref = (
            FSDPEngine(cfg.model.path, self.meshes["ref"], device, trainable=False, offload=cfg.ref.offload, **common)
            if self.use_ref else None
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
        self.rollout.sleep()
        stop_ids = sorted({self.tokenizer.eos_token_id, *r.stop_token_ids} - {None})
        self.train_spec = SamplingSpec(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=d.max_response_length,
            stop=list(r.stop), stop_token_ids=stop_ids,
        )
        self.val_spec = SamplingSpec(
            n=r.val_n, temperature=r.val_temperature, top_p=r.val_top_p, top_k=-1 if r.val_temperature == 0 else r.top_k,
            max_tokens=d.max_response_length, stop=list(r.stop), stop_token_ids=stop_ids,
        )
        self.adv_fn = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
        self.loss_fn = POLICY_LOSSES.get(a.policy_loss)
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        if rank == 0:
            with open(os.path.join(cfg.trainer.output_dir, "config.toml"), "w") as f:
                f.write(to_toml(cfg))
        lg = cfg.logging
        self.logger = MetricsLogger(
            cfg.trainer.output_dir, tensorboard=lg.tensorboard, jsonl=lg.jsonl, console=lg.console, rank=rank,
            append=False, progress_total=cfg.trainer.total_steps if lg.progress else 0,
        )
        self.global_step = 0

    # ---- the loop -----------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        last: dict[str, float] = {}
        if self.val_ds is not None and cfg.trainer.val_before_train:
            self.logger.log(0, self.validate())
        while self.global_step < cfg.trainer.total_steps:
            self.global_step += 1
            metrics = self.step(self.global_step)
            done = self.global_step == cfg.trainer.total_steps
            if self.val_ds is not None and (done or (cfg.trainer.test_freq and self.global_step % cfg.trainer.test_freq == 0)):
                metrics.update(self.validate())
            self.logger.log(self.global_step, metrics)
            last = metrics
        self.logger.close()
        return last

    def step(self, step: int) -> dict[str, float]:
        cfg, timer = self.cfg, StageTimer(self.device)
        t0 = time.perf_counter()
        with timer("rollout"):
            batch = self.generate(next(self.sampler), step)
        with timer("reshard_batch"):
            batch = redistribute(batch, self.rollout_mesh, self.actor_mesh)
        with timer("reward"):
            self.attach_meta(batch)
            self.compute_reward(batch)
        with timer("old_logprob"):
            batch["old_log_probs"] = self.forward_logprobs(self.actor, batch)
        if self.ref is not None:
            with timer("ref_logprob"):
                batch["ref_log_probs"] = self.forward_logprobs(self.ref, batch)
        with timer("advantage"):
            kl_metrics = self.apply_kl_in_reward(batch)
            adv, ret = self.adv_fn(
                batch["token_level_rewards"], batch["response_mask"], index=batch["index"],
                values=batch.tensors.get("values"), gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                epsilon=cfg.algorithm.epsilon, norm_by_std=cfg.algorithm.norm_adv_by_std,
            )
            batch["advantages"], batch["returns"] = adv, ret
        with timer("update_actor"):
            update_metrics = self.update_actor(batch)
        with timer("weight_sync"):
            sync_metrics = sync_weights(self.actor, self.rollout, bucket_mb=cfg.rollout.weight_sync_bucket_mb, dtype=self.rollout_dtype)
            self.rollout.sleep()
        metrics = {**self.batch_metrics(batch), **kl_metrics, **update_metrics, **{k: v for k, v in sync_metrics.items() if k != "timing/weight_sync_s"}}
        metrics = reduce_mean(metrics, weight=1.0 if self.actor_mesh.tp_rank == 0 else 0.0)
        step_s = time.perf_counter() - t0
        metrics.update(timer.as_metrics())
        metrics["timing/step_s"] = step_s
        tokens = reduce_sum(torch.tensor([float(batch["response_mask"].sum() + batch["prompt_len"].sum())]))
        metrics["perf/tokens_per_s"] = float(tokens[0]) / step_s / max(1, self.actor_mesh.tp_size)
        metrics["perf/peak_memory_gb"] = peak_memory_gb(self.device)
        return metrics

    # ---- stages -------------------------------------------------------------------------------------
    def generate(self, prompt_idx: list[int], step: int) -> Batch:
        """Rollout on this rank's TP group: same prompts and seeds on every rank of the group."""
        r = self.rollout_mesh
        prompts = [self.train_ds.prompt_ids(i) for i in prompt_idx]
        seeds = request_seeds(self.cfg.trainer.seed, step, r.dp_rank * len(prompts), len(prompts))
        self.rollout.wake_up()
        out = self.rollout.generate(prompts, self.train_spec, seeds)
        n = self.train_spec.n
        return self.to_batch(prompts, prompt_idx, out, n)

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
        batch.meta["response_text"] = self.tokenizer.batch_decode(
            [batch["responses"][i, : int(batch["response_len"][i])].tolist() for i in range(len(batch))],
            skip_special_tokens=True,
        )

    def compute_reward(self, batch: Batch) -> None:
        scores, _ = compute_rewards(
            self.reward_fn, batch.meta["data_source"], batch.meta["response_text"], batch.meta["ground_truth"],
            batch.meta["extra_info"],
        )
        batch["scores"] = scores
        R = batch["responses"].shape[1]
        last = (batch["response_len"] - 1).clamp(min=0)
        token_scores = torch.zeros(len(batch), R)
        token_scores[torch.arange(len(batch)), last] = scores * (batch["response_len"] > 0)
        batch["token_level_scores"] = token_scores

    def apply_kl_in_reward(self, batch: Batch) -> dict[str, float]:
        if not self.cfg.algorithm.use_kl_in_reward:
            batch["token_level_rewards"] = batch["token_level_scores"]
            return {}
        kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], self.cfg.algorithm.kl_penalty) * batch["response_mask"]
        batch["token_level_rewards"] = batch["token_level_scores"] - self.cfg.algorithm.kl_coef * kl
        return {"actor/reward_kl": float(masked_mean(kl, batch["response_mask"]))}

    def micro_batches(self, batch: Batch, size: int):
        for mb in batch.split(size):
            prompts = [mb["prompts"][i, : int(mb["prompt_len"][i])] for i in range(len(mb))]
            resps = [mb["responses"][i, : int(mb["response_len"][i])] for i in range(len(mb))]
            yield mb, pack_sequences(prompts, resps, self.pad_id)

    @torch.no_grad()
    def forward_logprobs(self, engine: FSDPEngine, batch: Batch) -> torch.Tensor:
        engine.module.eval()
        R = batch["responses"].shape[1]
        out = torch.zeros(len(batch), R)
        i = 0
        for mb, tb in self.micro_batches(batch, self.cfg.actor.micro_batch_size):
            logp, _ = engine.logprobs(tb, temperature=self.cfg.rollout.temperature, chunk_size=self.cfg.actor.logprob_chunk_size)
            out[i: i + len(mb), : logp.shape[1]] = logp.float().cpu()
            i += len(mb)
        return out

    def update_actor(self, batch: Batch) -> dict[str, float]:
        a, n = self.cfg.actor, self.cfg.rollout.n
        mini = (a.ppo_mini_batch_size or self.cfg.data.train_batch_size) * n // self.actor_mesh.dp_size
        dp_group = self.actor_mesh.mesh.get_group("dp")
        sums: dict[str, float] = {}
        count = 0
        for epoch in range(a.ppo_epochs):
            # fixed order: the same config and seed give the same updates
            for mb_batch in batch.split(mini):
                seq_mode = a.loss_agg_mode != "token-mean"
                unit = (mb_batch["response_mask"].sum(-1) > 0).float().sum() if seq_mode else mb_batch["response_mask"].sum()
                total = float(reduce_sum(unit.reshape(1), group=dp_group)[0])
                micro = list(self.micro_batches(mb_batch, a.micro_batch_size))

                def loss_fn(item, engine, total=total, seq_mode=seq_mode):
                    mb, tb = item
                    mask = mb["response_mask"].to(self.device)
                    logp, ent = engine.logprobs(
                        tb, temperature=self.cfg.rollout.temperature, with_entropy=True, chunk_size=a.logprob_chunk_size
                    )
                    R = logp.shape[1]
                    mask = mask[:, :R]
                    old = mb["old_log_probs"][:, :R].to(self.device)
                    adv = mb["advantages"][:, :R].to(self.device)
                    pg_loss, pg_m = self.loss_fn(
                        old, logp, adv, mask, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                        clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode,
                    )
                    entropy = agg_loss(ent, mask, a.loss_agg_mode)
                    loss = pg_loss - a.entropy_coeff * entropy
                    m = {"actor/pg_loss": pg_loss.detach(), "actor/entropy": entropy.detach(),
                         "actor/clipfrac": pg_m["pg_clipfrac"], "actor/ppo_kl": pg_m["ppo_kl"]}
                    if a.use_kl_loss:
                        kl = agg_loss(kl_penalty(logp, mb["ref_log_probs"][:, :R].to(self.device), a.kl_loss_type), mask, a.loss_agg_mode)
                        loss = loss + a.kl_loss_coef * kl
                        m["actor/kl"] = kl.detach()
                    else:
                        m["actor/kl"] = masked_mean((old - logp).detach(), mask)
                    local = ((mask.sum(-1) > 0).float().sum() if seq_mode else mask.sum())
                    weight = float(local) / max(total, 1.0) * self.actor_mesh.dp_size
                    return loss * weight, m

                out = self.actor.train_step(micro, loss_fn)
                for k, v in out.items():
                    key = k if "/" in k else f"actor/{k}"
                    sums[key] = sums.get(key, 0.0) + v
                count += 1
        return {k: v / count for k, v in sums.items()}

    def batch_metrics(self, batch: Batch) -> dict[str, float]:
        mask = batch["response_mask"]
        lp_diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()
        return {
            "train/reward_mean": float(batch["scores"].mean()),
            "train/reward_std": float(batch["scores"].std()) if len(batch) > 1 else 0.0,
            "train/response_length_mean": float(batch["response_len"].float().mean()),
            "train/response_clip_ratio": float(batch["truncated"].mean()),
            "train/advantage_mean": float(masked_mean(batch["advantages"], mask)),
            "rollout/logprob_diff_mean": float(masked_mean(lp_diff, mask)),
            "rollout/logprob_diff_max": float((lp_diff * mask).max()),
        }

    # ---- validation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Accuracy per data source on the validation set (its own sampling settings), all ranks reduced."""
        r, ds = self.rollout_mesh, self.val_ds
        t0 = time.perf_counter()
        per = -(-len(ds) // r.dp_size)
        rows = list(range(r.dp_rank * per, min(len(ds), (r.dp_rank + 1) * per)))
        sources = sorted(set(ds.batch(list(range(len(ds)))).data_source))
        sums = torch.zeros(2 * len(sources), dtype=torch.float64)
        if rows:
            prompts = [ds.prompt_ids(i) for i in rows]
            seeds = request_seeds(self.cfg.trainer.seed + 1, 0, rows[0], len(rows))
            self.rollout.wake_up()
            out = self.rollout.generate(prompts, self.val_spec, seeds)
            batch = self.to_batch(prompts, rows, out, self.val_spec.n)
            self.attach_meta(batch, ds)
            self.compute_reward(batch)
            if r.tp_rank == 0:
                for s, src in zip(batch["scores"].tolist(), batch.meta["data_source"]):
                    k = sources.index(src)
                    sums[k] += s
                    sums[len(sources) + k] += 1
        self.rollout.sleep()
        sums = reduce_sum(sums)
        acc = {f"val/accuracy/{src}": float(sums[k] / max(sums[len(sources) + k], 1)) for k, src in enumerate(sources)}
        acc["val/accuracy"] = sum(acc.values()) / len(acc)
        acc["timing/validation_s"] = time.perf_counter() - t0
        if dist.get_rank() == 0:
            log.info("validation: %s", ", ".join(f"{k}={v:.3f}" for k, v in acc.items()))
        return acc
