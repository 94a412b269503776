"""The stages of one RL step, as methods the Trainer mixes in: rollout -> batch -> reward -> forward passes ->
KL -> updates. Each is called once per step from `Trainer.step` and timed there."""
from __future__ import annotations

import torch

from spmdrl.algos import kl_penalty, masked_mean
from spmdrl.algos.kl import controller_kl
from spmdrl.algos.sampling import dynamic_sampling_quota, informative_groups, overlong_penalty
from spmdrl.batch import Batch
from spmdrl.correction import prepare_actor_update, sampler_truncates
from spmdrl.data.prompts import PromptDataset
from spmdrl.dist.collectives import (
    all_gather_strings, gather_tp_slices, redistribute, reduce_max, reduce_min, reduce_sum, take_global_rows,
)
from spmdrl.errors import SpmdrlError
from spmdrl.metrics import StageTimer
from spmdrl.rewards.custom import compute_rewards
from spmdrl.rewards.model import combine_rewards
from spmdrl.update import forward_all, run_updates


def request_seeds(seed: int, step: int, first: int, count: int) -> list[int]:
    """Per-prompt sampling seeds: a function of (run seed, step, global prompt position) only, so every rank
    of a rollout TP group samples identically and a rerun samples the same tokens."""
    return [(seed * 1_000_003 + step * 100_003 + first + i) % (2**31 - 1) for i in range(count)]


class Stages:
    # ---- rollout and the batch ------------------------------------------------------------------------
    def collect(self, step: int, timer: StageTimer) -> tuple[Batch, dict[str, float]]:
        """Rollout -> reshard -> reward, repeated while dynamic sampling still lacks informative groups.

        With algorithm.filter_groups, groups (same `uid`: one prompt draw) whose algorithm.filter_metric is
        all equal carry no GRPO signal and are dropped; rounds go on until the actor ranks together hold
        train_batch_size * n informative samples, or max_sample_rounds. The step trains on
        dynamic_sampling_quota samples per rank (whole groups, the same count on every rank), moved between
        ranks when some hold fewer. If that is 0 (not one informative group per rank), it trains on the last
        round unfiltered (its all-equal groups have zero advantage) and logs train/filter_fallback = 1.
        """
        cfg = self.cfg
        n = cfg.rollout.n
        dyn = cfg.algorithm.filter_groups
        target = cfg.data.train_batch_size * n
        kept, last, metrics, rounds, generated = None, None, {}, 0, 0
        while True:
            rounds += 1
            batch = self.rollout_batch(step, rounds - 1, timer)
            self.attach_meta(batch)
            metrics.update(self.run_hooks("after_rollout", step, batch))
            with timer("reward"):
                metrics.update(self.compute_reward(batch))
            metrics.update(self.run_hooks("after_reward", step, batch))
            self.place_token_scores(batch)
            generated += len(batch)
            if dyn:
                last = batch
                signal = batch["rule_scores"] if cfg.algorithm.filter_metric == "rule_score" else batch["scores"]
                batch = batch.select(informative_groups(signal, batch["uid"]))
            kept = batch if kept is None else Batch.cat([kept, batch])
            if not dyn:
                break
            counts = self.dp_reduce(torch.tensor([float(len(kept)), float(generated)]))
            if counts[0] >= target or rounds >= cfg.algorithm.max_sample_rounds:
                break
        if not dyn:
            keep = int(reduce_min(len(kept), group=self.meshes.train_group))
            if keep == 0:
                raise SpmdrlError(f"step {step}: no samples left to train on (a hook dropped them all); check the hooks")
            return kept.select(slice(0, keep)), metrics
        per_rank = dynamic_sampling_quota(int(counts[0]), target, n, self.actor_mesh.dp_size)
        metrics["train/kept_sample_ratio"] = float(counts[0] / counts[1])
        metrics["train/sample_rounds"] = float(rounds)
        metrics["train/filter_fallback"] = float(per_rank == 0)
        if per_rank == 0:  # no informative group on some rank: train on the last round as drawn
            keep = int(reduce_min(len(last), group=self.meshes.train_group))
            keep -= keep % n
            if keep == 0:
                raise SpmdrlError(f"step {step}: no samples left to train on (a hook dropped them all); check the hooks")
            return last.select(slice(0, keep)), metrics
        if int(reduce_min(len(kept), group=self.meshes.train_group)) >= per_rank:  # every rank has enough: no communication
            return kept.select(slice(0, per_rank)), metrics
        lo = self.actor_mesh.dp_offset(per_rank)
        kept = take_global_rows(kept, lo, lo + per_rank, group=self.actor_mesh.group("dp"))
        self.attach_meta(kept)
        return kept, metrics

    def rollout_batch(self, step: int, round_: int, timer: StageTimer) -> Batch:
        """This training rank's share of a rollout batch: generated here and moved to the actor layout, or, in
        split placement, received from the rollout ranks (spmdrl/split.py)."""
        if self.split:
            with timer("wait_batch"):
                return self.stream.receive(step)
        with timer("rollout"):
            batch = self.generate(next(self.sampler), step, round_)
        with timer("reshard_batch"):
            return redistribute(batch, self.rollout_mesh, self.actor_mesh)

    def generate(self, prompt_idx: list[int], step: int, round_: int = 0) -> Batch:
        """Rollout on this rank's TP group: same prompts and seeds on every rank of the group."""
        r = self.rollout_mesh
        prompts = [self.train_ds.prompt_ids(i) for i in prompt_idx]
        first = round_ * self.cfg.data.train_batch_size + r.dp_offset(len(prompts))
        seeds = request_seeds(self.cfg.trainer.seed, step, first, len(prompts))
        self.memory.for_rollout()  # vLLM's KV cache back (spmdrl/memory.py)
        out = self.rollout.generate(prompts, self.specs.train, seeds)
        n = self.specs.train.n
        batch = self.to_batch(prompts, prompt_idx, out, n)
        # the group id: one per prompt draw (step, round, global position), never the dataset row, so two
        # draws of one prompt in a step (an epoch boundary, a dynamic-sampling round) stay two groups
        uid = step * self.cfg.algorithm.max_sample_rounds * self.cfg.data.train_batch_size + first
        batch["uid"] = torch.arange(uid, uid + len(prompts), dtype=torch.long).repeat_interleave(n)
        if "baseline_rewards" in getattr(self.adv_fn, "requires", ()):  # ReMax: greedy rollout as the baseline
            greedy = self.rollout.generate(prompts, self.specs.greedy, seeds)
            gb = self.to_batch(prompts, prompt_idx, greedy, 1)
            self.attach_meta(gb, mesh=r)
            self.compute_reward(gb, mesh=r)  # the same shaped reward the samples get
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

    def attach_meta(self, batch: Batch, ds: PromptDataset | None = None, mesh=None) -> None:
        """Per-sample metadata, re-derived locally from the dataset row in `index`. Responses are decoded once
        per sample: each rank of a tp group (which holds the same samples) decodes its share, and the texts are
        shared over the group as one packed byte tensor."""
        ds = ds or self.train_ds
        mesh = mesh or self.actor_mesh
        rows = batch["index"].tolist()
        uniq = sorted(set(rows))
        pb = ds.batch(uniq)
        pos = {row: i for i, row in enumerate(uniq)}
        batch.meta["data_source"] = [pb.data_source[pos[r]] for r in rows]
        batch.meta["ground_truth"] = [pb.ground_truth[pos[r]] for r in rows]
        batch.meta["extra_info"] = [pb.extra_info[pos[r]] for r in rows]
        batch.meta["raw_prompt"] = [pb.raw_prompt[pos[r]] for r in rows]
        mine = mesh.tp_range(len(batch))
        texts = self.tokenizer.batch_decode(
            [batch["responses"][i, : int(batch["response_len"][i])].tolist() for i in mine], skip_special_tokens=True,
        )
        batch.meta["response_text"] = all_gather_strings(texts, mesh, len(batch)) if mesh.tp_size > 1 else texts

    # ---- reward -----------------------------------------------------------------------------------------
    def compute_reward(self, batch: Batch, shaping: bool = True, mesh=None) -> dict[str, float]:
        """batch["scores"] [B]: rule/custom score, weighted, plus DAPO overlong shaping (shaping=False: the raw
        rule score, which validation reports as accuracy). The rule scorer runs once per sample: each rank of a
        tp group scores its share and the scores are all-gathered over the group."""
        r = self.cfg.reward
        mesh = mesh or self.actor_mesh
        mine = mesh.tp_range(len(batch))
        meta = batch.meta
        scores, _ = compute_rewards(
            self.reward_fn, *([meta[k][i] for i in mine] for k in ("data_source", "response_text", "ground_truth", "extra_info")),
        )
        if mesh.tp_size > 1:
            scores = gather_tp_slices(scores.float(), mesh, len(batch))
        metrics = {}
        batch["rule_scores"] = scores  # before weighting, reward model and shaping: dynamic sampling's default signal
        if not shaping:
            batch["scores"] = scores
            return metrics
        if self.reward_model is not None:  # a weighted sum with the rule score
            lens = batch["prompt_len"].tolist(), batch["response_len"].tolist()
            rm = self.reward_model.score(
                meta["raw_prompt"], meta["response_text"],
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
        current = controller_kl(kl, mask, reduce=self.dp_reduce)  # global mean of per-sequence means
        self.kl_ctrl.update(current, self.cfg.data.train_batch_size * self.cfg.rollout.n)
        return {"actor/reward_kl": current, "actor/kl_coef": beta}

    # ---- forward passes and updates ----------------------------------------------------------------------
    def forward_logprobs(self, engine, batch: Batch, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
        """Log-probs of the sampled tokens at the rollout temperature; with top_k / top_p, of the truncated
        sampling distribution (what the rollout engine's processed log-probs are)."""
        a = self.cfg.actor
        return forward_all(
            engine, batch, a.forward_micro_batch_size or a.micro_batch_size, self.pad_id,
            lambda eng, tb: eng.logprobs(tb, temperature=self.cfg.rollout.temperature, chunk_size=a.logprob_chunk_size,
                                         top_k=top_k, top_p=top_p)[0],
            max_tokens=a.forward_max_tokens_per_micro_batch or a.max_tokens_per_micro_batch, packed=a.use_packing,
        )

    def forward_values(self, batch: Batch) -> torch.Tensor:
        c = self.cfg.critic
        return forward_all(self.critic, batch, c.micro_batch_size, self.pad_id, lambda eng, tb: eng.values(tb),
                           max_tokens=c.max_tokens_per_micro_batch, packed=c.use_packing)

    def update(self, engine, batch: Batch, body, role: str) -> dict[str, float]:
        sec = getattr(self.cfg, role)
        mesh = self.meshes[role]
        mini = mesh.dp_share((self.cfg.actor.ppo_mini_batch_size or self.cfg.data.train_batch_size) * self.cfg.rollout.n,
                             "mini-batch samples")
        extra = {}
        if role == "actor":  # the rollout/trainer mismatch, measured and corrected (spmdrl/correction.py)
            batch, extra = prepare_actor_update(self.cfg, engine, batch, self.forward_logprobs, self.dp_reduce,
                                                lambda t: reduce_max(t, group=mesh.group("dp")))
        out = run_updates(
            engine, batch, epochs=sec.ppo_epochs, mini_size=mini, micro_size=sec.micro_batch_size, pad_id=self.pad_id,
            dp_size=mesh.dp_size, dp_group=mesh.group("dp"), body=body, prefix=role,
            max_tokens=sec.max_tokens_per_micro_batch, packed=sec.use_packing,
        )
        return {**out, **extra}

    def dp_reduce(self, stats: torch.Tensor) -> torch.Tensor:
        """Sum over the actor's data-parallel ranks (one rank per TP group: TP peers hold the same samples)."""
        return reduce_sum(stats, group=self.actor_mesh.group("dp"))

    def batch_metrics(self, batch: Batch) -> dict[str, float]:
        mask = batch["response_mask"]
        m = {
            "train/reward_mean": float(batch["scores"].mean()),
            "train/reward_std": float(batch["scores"].std()) if len(batch) > 1 else 0.0,
            "train/response_length_mean": float(batch["response_len"].float().mean()),
            "train/response_clip_ratio": float(batch["truncated"].mean()),
            "train/advantage_mean": float(masked_mean(batch["advantages"], mask)),
        }
        if "weight_version" in batch:  # split placement: how many actor versions old the batch's weights are
            m["train/weight_version_lag"] = self.actor_version - float(batch["weight_version"].double().mean())
        if "old_log_probs" in batch and not sampler_truncates(self.cfg):  # else the update measured it
            lp_diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()
            m["rollout/logprob_diff_mean"] = float(masked_mean(lp_diff, mask))
            m["rollout/logprob_diff_max"] = float((lp_diff * mask).max())
        return m
