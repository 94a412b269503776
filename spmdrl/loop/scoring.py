"""The reward stage: per-sample metadata and decoded text, the rule (or custom) score, the reward model and
reward shaping. Each sample is decoded and scored once: the ranks of a TP group (which hold the same samples)
split the work and share the results."""
from __future__ import annotations

from typing import Callable

import torch

from spmdrl.algos.sampling import overlong_penalty
from spmdrl.batch import Batch
from spmdrl.data.prompts import PromptDataset
from spmdrl.dist.collectives import all_gather_strings, gather_tp_slices, reduce_sum, sum_over_tp
from spmdrl.dist.meshes import RoleMesh
from spmdrl.rewards.custom import GuardedReward, WeightedRewards, compute_rewards, extra_sums, takes_trajectory
from spmdrl.rewards.model import RewardModelScorer, combine_rewards
from spmdrl.rewards.registry import accuracy_score_fn
from spmdrl.rollout.trajectory import decode_infos, messages_of


def agent_rewards(batch: Batch, scores: torch.Tensor) -> torch.Tensor:
    """[agent] rollouts: the reward a session's agent returned replaces the reward function's score of it."""
    given = [(i, (t.get("agent") or {}).get("reward")) for i, t in enumerate(batch.meta.get("trajectory") or [])]
    given = [(i, r) for i, r in given if r is not None]
    if not given:
        return scores
    scores = scores.clone()
    for i, r in given:
        scores[i] = float(r)
    return scores


class Scorer:
    """reward_fn: the rule or custom score (GuardedReward when reward.on_error / timeout_s guard it);
    reward_model: a RewardModelScorer whose score is added with reward.model_weight, or None."""

    def __init__(self, cfg, tokenizer, reward_fn: Callable, reward_model: RewardModelScorer | None):
        self.cfg, self.tokenizer, self.reward_fn, self.reward_model = cfg, tokenizer, reward_fn, reward_model
        # validation's accuracy: the rule scorers, even when a custom function gives the training reward
        self.accuracy_fn = accuracy_score_fn(reward_fn) if cfg.reward.custom_fn or cfg.reward.custom_fns else None
        if self.accuracy_fn is not None:  # it hands a multi-turn `trajectory` on to the custom function
            self.accuracy_fn.takes_trajectory = takes_trajectory(reward_fn)

    def attach_meta(self, batch: Batch, ds: PromptDataset, mesh: RoleMesh) -> None:
        """Per-sample metadata, re-derived locally from the dataset row in `index`. Responses are decoded once
        per sample: each rank of a tp group (which holds the same samples) decodes its share, and the texts are
        shared over the group as one packed byte tensor."""
        rows = batch["index"].tolist()
        uniq = sorted(set(rows))
        pb = ds.batch(uniq)
        pos = {row: i for i, row in enumerate(uniq)}
        batch.meta["data_source"] = [pb.data_source[pos[r]] for r in rows]
        batch.meta["ground_truth"] = [pb.ground_truth[pos[r]] for r in rows]
        batch.meta["extra_info"] = [pb.extra_info[pos[r]] for r in rows]
        batch.meta["raw_prompt"] = [pb.raw_prompt[pos[r]] for r in rows]
        if pb.vision is not None:  # a vision-language model's images, for the training forwards (loop/update.py)
            batch.meta["vision"] = [pb.vision[pos[r]] for r in rows]
        mine = mesh.tp_range(len(batch))
        if "trajectory" in batch:  # multi-turn: the turns, and the final turn's text as the solution
            infos = decode_infos(batch["trajectory"])
            batch.meta["trajectory"] = [{**info, "messages": messages_of(p, info)}
                                        for p, info in zip(batch.meta["raw_prompt"], infos)]
        texts = self.tokenizer.batch_decode([self.solution_ids(batch, i) for i in mine], skip_special_tokens=True)
        batch.meta["response_text"] = all_gather_strings(texts, mesh, len(batch)) if mesh.tp_size > 1 else texts

    @staticmethod
    def solution_ids(batch: Batch, i: int) -> list[int]:
        """What the reward scores of sample i: the whole response, or with multi-turn rollouts (tool/glue tokens
        masked) the model's last turn, the last run of model tokens."""
        n = int(batch["response_len"][i])
        ids = batch["responses"][i, :n]
        if "trajectory" not in batch:
            return ids.tolist()
        model = batch["response_mask"][i, :n] > 0
        idx = torch.nonzero(model).flatten()
        if len(idx) == 0:
            return []
        end = int(idx[-1]) + 1
        holes = torch.nonzero(~model[:end]).flatten()
        start = int(holes[-1]) + 1 if len(holes) else 0
        return ids[start:end].tolist()

    def _scores(self, fn: Callable, batch: Batch, mesh: RoleMesh, extras: dict | None = None) -> torch.Tensor:
        """Scores of every sample (each tp rank scores its share; all-gathered). extras: filled with the sums
        and counts of the numeric extra keys the function returned over this tp group's samples
        (rewards/custom.py extra_sums; the trainer turns them into reward/extra/<key>)."""
        mine = mesh.tp_range(len(batch))
        meta = batch.meta
        trajectories = [meta["trajectory"][i] for i in mine] if "trajectory" in meta and takes_trajectory(fn) else None
        scores, returned = compute_rewards(
            fn, *([meta[k][i] for i in mine] for k in ("data_source", "response_text", "ground_truth", "extra_info")),
            trajectories=trajectories,
        )
        if extras is not None:
            extras.update(sum_over_tp(extra_sums(returned), mesh))
        return gather_tp_slices(scores.float(), mesh, len(batch)) if mesh.tp_size > 1 else scores

    def score(self, batch: Batch, mesh: RoleMesh, shaping: bool = True) -> dict[str, float]:
        """batch["scores"] [B]: rule/custom score, weighted, plus DAPO overlong shaping. shaping=False
        (validation): the raw rule/custom score, and batch["accuracy"], what validation reports as accuracy: the
        rule scorer of each sample's data_source (the custom function only where none is registered). Each
        function runs once per sample: each rank of a tp group scores its share, all-gathered over the group."""
        r = self.cfg.reward
        meta = batch.meta
        metrics = {}
        scores = agent_rewards(batch, self._scores(self.reward_fn, batch, mesh, extras=metrics if shaping else None))
        batch["rule_scores"] = scores  # before weighting, reward model and shaping: dynamic sampling's default signal
        if not shaping:
            batch["scores"] = scores
            batch["accuracy"] = scores if self.accuracy_fn is None else \
                agent_rewards(batch, self._scores(self.accuracy_fn, batch, mesh))
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

    @staticmethod
    def place_token_scores(batch: Batch) -> None:
        """Outcome score on the last VALID response token (what token-level estimators consume): with holes in
        the response mask (tool output in a multi-turn trajectory, a response cut inside a tool segment) the
        last token may be masked, and a score there would be dropped by every estimator. No valid token: no score."""
        R = batch["responses"].shape[1]
        if "response_mask" in batch:
            valid = batch["response_mask"][:, :R] != 0
        else:
            valid = torch.arange(R)[None] < batch["response_len"][:, None]
        last = torch.where(valid, torch.arange(R)[None], torch.full_like(valid, -1, dtype=torch.long)).amax(-1)
        token_scores = torch.zeros(len(batch), R)
        rows = (last >= 0).nonzero().flatten()
        token_scores[rows, last[rows]] = batch["scores"][rows].to(token_scores.dtype)
        batch["token_level_scores"] = token_scores

    def error_metrics(self) -> dict[str, float]:
        """reward/errors and reward/timeouts since the last call, summed over ranks (reward.on_error = zero).
        Every sample is scored on exactly one rank (tp groups split the scoring), so every rank's count adds."""
        if not isinstance(self.reward_fn, (GuardedReward, WeightedRewards)) or self.reward_fn.on_error != "zero":
            return {}
        errors, timeouts = self.reward_fn.take_counts()
        t = reduce_sum(torch.tensor([float(errors), float(timeouts)]))
        return {"reward/errors": float(t[0]), "reward/timeouts": float(t[1])}
