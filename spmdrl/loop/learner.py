"""The training roles' stages of a step: forward passes (old, ref, teacher log-probs; values), the KL penalty in
the reward, advantages (with the distillation term), the critic and actor updates, and the batch's training
metrics."""
from __future__ import annotations

import torch

from spmdrl.algos import ADV_ESTIMATORS, DISTILL_MODES, POLICY_LOSSES, distill_sums, kl_penalty, masked_mean
from spmdrl.algos.kl import AdaptiveKLController, FixedKLController, controller_kl
from spmdrl.batch import Batch
from spmdrl.dist.collectives import redistribute, reduce_max, reduce_sum
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.engines import TrainEngine
from spmdrl.engines.router_replay import router_metrics
from spmdrl.config.derived import micro_batch_limits, mini_batch_prompts, replays_routes
from spmdrl.loop.correction import correct_rollout, logprob_diff
from spmdrl.loop.generate import BRANCH, sessions_only
from spmdrl.rollout.routes import route_shape
from spmdrl.loop.update import ActorObjective, CriticObjective, forward_all, run_updates


class Learner:
    """actor, ref, critic, teacher: the training engines (ref, critic and the distillation teacher None when the
    config has none); kl_ctrl: the KL-in-reward coefficient's controller (its state goes into checkpoints)."""

    def __init__(self, cfg, meshes: RoleMeshes, actor: TrainEngine, ref: TrainEngine | None,
                 critic: TrainEngine | None, kl_ctrl: AdaptiveKLController | FixedKLController, pad_id: int,
                 teacher: TrainEngine | None = None):
        self.cfg, self.meshes, self.pad_id, self.kl_ctrl = cfg, meshes, pad_id, kl_ctrl
        self.actor, self.ref, self.critic, self.teacher = actor, ref, critic, teacher
        self.distill_fn = DISTILL_MODES.get(cfg.distill.mode) if teacher is not None else None
        self.adv_fn = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
        self.loss_fn = POLICY_LOSSES.get(cfg.actor.policy_loss)
        self.longest = cfg.data.max_prompt_length + cfg.data.max_response_length  # a sequence's bound, in tokens
        # routing replay: the forwards of actor and ref send each token to the experts of batch["routed_experts"]
        hf = actor.hf_config() if actor is not None else None
        self.moe_shape = route_shape(hf) if hf is not None else None  # (layers, top_k) of a MoE, else None
        self.num_experts = int(getattr(hf, "num_experts", 0) or getattr(hf, "num_local_experts", 0)) if hf else 0
        self.route_shape = self.moe_shape if replays_routes(cfg) else None
        self.router_counts: dict = {}  # the actor's first forward pass of the step (engines/router_replay.py)

    def dp_sum(self, stats: torch.Tensor) -> torch.Tensor:
        """Sum over the actor's data-parallel ranks (one rank per TP group: TP peers hold the same samples)."""
        return reduce_sum(stats, group=self.meshes["actor"].group("dp"))

    def dp_max(self, stats: torch.Tensor) -> list[float]:
        """Element-wise max over the actor's data-parallel ranks."""
        return reduce_max(stats, group=self.meshes["actor"].group("dp"))

    # ---- forward passes --------------------------------------------------------------------------------
    def logprobs(self, engine: TrainEngine, batch: Batch, top_k: int = -1, top_p: float = 1.0, *,
                 role: str = "actor", count_routes: bool = True) -> torch.Tensor:
        """Log-probs of the sampled tokens at the rollout temperature; with top_k / top_p, of the truncated
        sampling distribution (what the rollout engine's processed log-probs are). role: whose forward
        micro-batches (actor | ref | teacher, config/derived.micro_batch_limits); count_routes: keep the actor's
        router counts of this pass for the step's moe/* metrics (not for the base model's or a check's pass)."""
        a = self.cfg.actor
        size, budget = micro_batch_limits(self.cfg, role, self.longest, forward=True)
        out = forward_all(
            engine, batch, size, self.pad_id, "logprobs", max_tokens=budget, packed=a.use_packing,
            temperature=self.cfg.rollout.temperature, chunk_size=a.logprob_chunk_size, top_k=top_k, top_p=top_p,
            route_shape=self.route_shape,
        )
        if count_routes and role == "actor":
            self._note_routing(engine)
        else:
            engine.moe_counts()  # the base model's routing, or a check's: not the policy's of this step
        return out

    def _note_routing(self, engine: TrainEngine) -> None:
        """Keep the router counts of the actor's first forward pass of the step (the weights vLLM sampled with)."""
        counts = engine.moe_counts()
        if engine is self.actor and counts and not self.router_counts:
            self.router_counts = counts

    def router_metrics(self) -> dict[str, float]:
        """moe/* (engines/router_replay.router_metrics) of the actor's first forward pass of the step, summed over
        the dp ranks; {} for a dense model."""
        if self.moe_shape is None:
            return {}
        self._note_routing(self.actor)
        counts, self.router_counts = self.router_counts, {}
        keys = ("agree_own", "agree_used", "routed")
        load = counts.get("load", torch.zeros(self.moe_shape[0], self.num_experts, dtype=torch.float64)).cpu()
        flat = torch.cat([torch.stack([counts.get(k, torch.zeros((), dtype=torch.float64)).cpu() for k in keys]),
                          load.reshape(-1)])
        flat = self.dp_sum(flat).cpu()  # every rank of a MoE actor takes part, counts or not
        summed = dict(zip(keys, flat[:3]))
        summed["load"] = flat[3:].view_as(load)
        return router_metrics(summed)

    def ref_logprobs(self, batch: Batch) -> torch.Tensor:
        """The reference policy's log-probs: the ref engine's, or with LoRA (no ref engine) the actor's with its
        adapters disabled, which is exactly the base model."""
        if self.ref is not None:
            return self.logprobs(self.ref, batch, role="ref")
        with self.actor.adapters_disabled():
            self._note_routing(self.actor)  # the actor's own passes so far, before the base model's
            return self.logprobs(self.actor, batch, role="ref")

    def teacher_logprobs(self, batch: Batch) -> torch.Tensor:
        """The distillation teacher's log-probs of the sampled tokens (at the rollout temperature, as the
        student's), [B, R] in the actor's layout. A teacher laid out unlike the actor (teacher_tp != actor_tp)
        takes the token columns in its own layout, every rank of a teacher tp group holding the same samples, and
        its log-probs go back the same way (dist.collectives.redistribute, both ways)."""
        a, t = self.meshes["actor"], self.meshes["teacher"]
        if (a.dp_size, a.pp_size, a.tp_size) == (t.dp_size, t.pp_size, t.tp_size):
            return self.logprobs(self.teacher, batch, role="teacher")
        group = self.meshes.train_group  # None when colocated: the world
        keys = ("prompts", "responses", "prompt_len", "response_len", "response_mask")
        tokens = redistribute(Batch({k: batch[k] for k in keys}), a, t, group=group)
        scored = Batch({"teacher_log_probs": self.logprobs(self.teacher, tokens, role="teacher")})
        return redistribute(scored, t, a, group=group)["teacher_log_probs"][:, : batch["responses"].shape[1]]

    def values(self, batch: Batch) -> torch.Tensor:
        size, budget = micro_batch_limits(self.cfg, "critic", self.longest, forward=True)
        return forward_all(self.critic, batch, size, self.pad_id, "values", max_tokens=budget,
                           packed=self.cfg.critic.use_packing)

    # ---- rewards and advantages ----------------------------------------------------------------------------
    def kl_in_reward(self, batch: Batch) -> dict[str, float]:
        """token_level_rewards: the token-level scores, minus beta * KL(old || ref) with algorithm.use_kl_in_reward."""
        if not self.cfg.algorithm.use_kl_in_reward:
            batch["token_level_rewards"] = batch["token_level_scores"]
            return {}
        mask = batch["response_mask"]
        kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], self.cfg.algorithm.kl_penalty) * mask
        beta = self.kl_ctrl.value
        batch["token_level_rewards"] = batch["token_level_scores"] - beta * kl
        current = controller_kl(kl, mask, reduce=self.dp_sum)  # global mean of per-sequence means
        self.kl_ctrl.update(current, self.cfg.data.train_batch_size * self.cfg.rollout.n)
        return {"actor/reward_kl": current, "actor/kl_coef": beta}

    def advantages(self, batch: Batch) -> dict[str, float]:
        alg = self.cfg.algorithm
        kw = dict(gamma=alg.gamma, lam=alg.lam, epsilon=alg.epsilon, norm_by_std=alg.norm_adv_by_std,
                  reduce=self.dp_sum)  # batch statistics (whitening) over the global batch
        if BRANCH in batch and "index" in getattr(self.adv_fn, "requires", ()):  # [agent] branch rows
            batch["advantages"], batch["returns"] = session_advantages(self.adv_fn, batch, **kw)
            return {}
        batch["advantages"], batch["returns"] = self.adv_fn(
            batch["token_level_rewards"], batch["response_mask"], index=batch["uid"],
            values=batch.tensors.get("values"), baseline_rewards=batch.tensors.get("baseline_rewards"), **kw)
        return {}

    def distill(self, batch: Batch) -> dict[str, float]:
        """On-policy distillation (algos/distill.py), after the reward's advantages: a mode of stage "advantage"
        adds distill.coef x its term to them (the loss stage is the actor objective's); and the distill/* metrics
        over the global batch's model tokens: the per-token KL estimate log pi_student - log pi_teacher (mean, max),
        both log-probs' means, and with an advantage-stage mode the teacher's share of sum |advantage|."""
        d, mask = self.cfg.distill, batch["response_mask"]
        student, teacher = batch["old_log_probs"], batch["teacher_log_probs"]
        sums, top = distill_sums(student, teacher, mask)
        extra = torch.zeros(2, dtype=torch.float64)
        if self.distill_fn.stage == "advantage":
            term = d.coef * self.distill_fn(student, teacher, mask, kl_type=d.kl_type)
            valid = mask != 0
            extra = torch.stack([batch["advantages"].double().abs()[valid].sum(), term.double().abs()[valid].sum()])
            batch["advantages"] = batch["advantages"] + term.to(batch["advantages"].dtype)
        total = self.dp_sum(torch.cat([sums, extra]))
        n = max(float(total[3]), 1.0)
        m = {"distill/kl_mean": float(total[0]) / n, "distill/kl_max": self.dp_max(top)[0],
             "distill/teacher_logprob_mean": float(total[1]) / n, "distill/student_logprob_mean": float(total[2]) / n}
        if self.distill_fn.stage == "advantage":
            m["distill/teacher_adv_share"] = float(total[5]) / max(float(total[4] + total[5]), 1e-30)
        return m

    # ---- updates ---------------------------------------------------------------------------------------
    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self._update(self.critic, batch, CriticObjective(self.cfg), "critic")

    def truncated_mismatch(self, batch: Batch) -> dict[str, float]:
        """rollout/logprob_diff_* with a truncating sampler (top-k / top-p), whose rollout log-probs are of the
        truncated distribution: one forward pass of the actor under the same truncation, compared with them."""
        r = self.cfg.rollout
        return self.mismatch(batch, self.logprobs(self.actor, batch, top_k=r.top_k, top_p=r.top_p))

    def mismatch(self, batch: Batch, actor_lp: torch.Tensor) -> dict[str, float]:
        """rollout/logprob_diff_* of the actor's log-probs `actor_lp` against the sampled ones (loop/correction.py)."""
        return logprob_diff([(actor_lp, batch["rollout_log_probs"], batch["response_mask"])], self.dp_sum, self.dp_max)

    def correct_rollout(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """[rollout_correction]: the batch the actor update trains on (importance weights, the rejection mask, and
        on-policy the old log-probs of one forward pass) and the correction's metrics; `batch` is not modified."""
        return correct_rollout(self.cfg, self.actor, batch, self.logprobs, self.dp_sum, self.dp_max)

    def update_actor(self, batch: Batch, sampled: Batch, *, measured: bool) -> dict[str, float]:
        """The actor update on `batch` (the step's, or correct_rollout's). Unless the mismatch was measured already
        (measured: a truncating sampler's own pass), rollout/logprob_diff_* of the old log-probs against the
        `sampled` batch's, or on-policy (no old-log-prob pass) of the update's own before its one optimizer step."""
        actor_lp = None if measured else batch.tensors.get("old_log_probs")
        objective = ActorObjective(self.cfg, self.loss_fn, self.cfg.rollout.temperature,
                                   keep_logprobs=not measured and actor_lp is None, distill_fn=self.distill_fn)
        metrics = self._update(self.actor, batch, objective, "actor")
        metrics.update(self.router_metrics())
        if actor_lp is not None:
            metrics.update(self.mismatch(sampled, actor_lp))
        elif not measured:
            metrics.update(logprob_diff(objective.own_logprobs, self.dp_sum, self.dp_max))
        return metrics

    def _update(self, engine: TrainEngine, batch: Batch, objective, role: str) -> dict[str, float]:
        sec = getattr(self.cfg, role)
        mesh = self.meshes[role]
        n = self.cfg.rollout.n
        mini = mesh.dp_share(mini_batch_prompts(self.cfg) * n, "mini-batch samples")
        if BRANCH in batch:  # [agent] branch rows: as many optimizer steps, each over its groups' rows
            sessions = max(int((batch[BRANCH] == 0).sum()), 1)
            mini = -(-mini * len(batch) // sessions)
        size, budget = micro_batch_limits(self.cfg, role, self.longest)
        return run_updates(
            engine, batch, epochs=sec.ppo_epochs, mini_size=mini, micro_size=size, pad_id=self.pad_id,
            dp_size=mesh.dp_size, dp_group=mesh.group("dp"), objective=objective, prefix=role, max_tokens=budget,
            packed=sec.use_packing, route_shape=self.route_shape if role == "actor" else None,
        )

    # ---- metrics ---------------------------------------------------------------------------------------
    def batch_metrics(self, batch: Batch, actor_version: int) -> dict[str, float]:
        """The batch's rewards, lengths and advantages; in split placement how many actor versions old its
        weights are (actor_version: the step of the actor's last update)."""
        advantage_mean = float(masked_mean(batch["advantages"], batch["response_mask"]))  # every trained token
        batch = sessions_only(batch)  # [agent] branch rows: a session counts once
        m = {
            "train/reward_mean": float(batch["scores"].mean()),
            "train/reward_std": float(batch["scores"].std()) if len(batch) > 1 else 0.0,
            "train/response_length_mean": float(batch["response_len"].float().mean()),
            "train/response_clip_ratio": float(batch["truncated"].mean()),
            "train/advantage_mean": advantage_mean,
        }
        if "weight_version" in batch:
            m["train/weight_version_lag"] = actor_version - float(batch["weight_version"].double().mean())
        return m


def session_advantages(adv_fn, batch: Batch, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """[agent] branch rows (loop/generate.py branch_rows) with an estimator that groups samples (GRPO, RLOO, ...):
    the estimator runs over the sessions' final branches, one row per session and n per group as without branches,
    so a session with many branches weighs no more in its group's statistics; every other branch of a session takes
    its session's advantage (and return) on its own model tokens; padding rows get 0."""
    final = (batch[BRANCH] == 0).nonzero().flatten()
    part = {k: batch[k].index_select(0, final) for k in ("token_level_rewards", "response_mask", "uid")}
    baseline = batch.tensors.get("baseline_rewards")
    adv_f, ret_f = adv_fn(part["token_level_rewards"], part["response_mask"], index=part["uid"],
                          baseline_rewards=None if baseline is None else baseline.index_select(0, final), **kw)
    valid = part["response_mask"] != 0
    first = valid.long().argmax(-1, keepdim=True)  # a group estimator's advantage is one value per row
    per_session = {(int(u), int(s)): k for k, (u, s) in enumerate(zip(part["uid"].tolist(),
                                                                     batch["session"][final].tolist()))}
    src = torch.tensor([per_session.get((int(u), int(s)), -1) if s >= 0 else -1
                        for u, s in zip(batch["uid"].tolist(), batch["session"].tolist())], dtype=torch.long)
    mask = batch["response_mask"] != 0
    has = src >= 0
    out = []
    for x in (adv_f, ret_f):
        value = x.gather(-1, first)[:, 0] * valid.any(-1)
        full = torch.zeros(batch["response_mask"].shape, dtype=x.dtype)
        full[has] = torch.where(mask[has], value[src[has]][:, None], torch.zeros((), dtype=x.dtype))
        full[final] = x
        out.append(full)
    return out[0], out[1]
