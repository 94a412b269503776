"""The batch that flows through the stages of a step: tensors with a leading sample dim, plus metadata.

Samples of a prompt are adjacent (prompt-major, n per prompt) and stay on one rank, so group statistics
(GRPO, RLOO) need no communication. Only tensors cross ranks; per-sample metadata (data_source, ground
truth, text) is re-derived locally from `index` (the prompt's dataset row), never pickled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    """tensors: name -> Tensor[B, ...]; meta: name -> list of B Python values (local only)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if len(self) and value.shape[0] != len(self):
            raise ValueError(f"tensor {key!r} has {value.shape[0]} rows, the batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def select(self, idx: torch.Tensor | slice | list[int]) -> "Batch":
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
        else:
            rows = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        if isinstance(idx, torch.Tensor) and idx.dtype == torch.bool:
            rows = idx.nonzero().flatten().tolist()
        t_idx = torch.tensor(rows, dtype=torch.long)
        return Batch(
            {k: v.index_select(0, t_idx) for k, v in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.meta.items()},
        )

    def keep_(self, idx: torch.Tensor | slice | list[int]) -> "Batch":
        """In place: keep only the rows `idx` (as in `select`) of every tensor and meta list; returns self.
        For code that shares this Batch object and must see the rows dropped (user hooks)."""
        kept = self.select(idx)
        self.tensors, self.meta = kept.tensors, kept.meta
        return self

    def split(self, size: int) -> list["Batch"]:
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def cat(batches: list["Batch"]) -> "Batch":
        first = batches[0]
        tensors = {}
        for k in first.tensors:
            parts = [b.tensors[k] for b in batches]
            if parts[0].dim() == 2:  # ragged second dim (responses): pad to the widest
                width = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
            tensors[k] = torch.cat(parts)
        return Batch(tensors, {k: [x for b in batches for x in b.meta[k]] for k in first.meta})


# What the training batch holds, stage by stage: (names, shape and dtype, the first hook stage that sees it,
# meaning). docs/hooks.md's table is generated from it (batch_key_table; tests/test_hooks.py holds it current).
BATCH_KEYS = [
    ("prompts", "[B, P] int64", "after_rollout", "prompt token ids"),
    ("prompt_len", "[B] int64", "after_rollout", "prompt lengths"),
    ("responses", "[B, R] int64", "after_rollout", "response token ids"),
    ("response_len", "[B] int64", "after_rollout", "response lengths"),
    ("response_mask", "[B, R] float32", "after_rollout", "1 on response tokens, 0 on padding"),
    ("rollout_log_probs", "[B, R] float32", "after_rollout", "the rollout engine's log-probs"),
    ("index", "[B] int64", "after_rollout", "the prompt's dataset row"),
    ("uid", "[B] int64", "after_rollout", "the group id: one per prompt draw (two draws of one prompt are two groups)"),
    ("truncated", "[B] float32", "after_rollout", "1 where generation stopped at `data.max_response_length`"),
    ("baseline_rewards", "[B] float32", "after_rollout", "ReMax only: the greedy rollout's score"),
    ("versions", "[B, R] int64", "after_rollout",
     "`rollout.partial` only: the weight version (the step whose update produced the weights) that sampled each "
     "response token"),
    ("routed_experts", "[B, S x layers x top_k] int16", "after_rollout",
     "`actor.router_replay = rollout` only: 1 + the expert vLLM routed each position of prompt + response to, per "
     "layer and choice, position-major; 0 where it routed none (docs/moe.md)"),
    ("scores", "[B] float32", "after_reward",
     "the reward: rule/custom score x `reward.rule_weight`, the reward model, DAPO overlong shaping"),
    ("token_level_scores", "[B, R] float32", "after_advantage", "`scores` on each response's last token"),
    ("old_log_probs", "[B, R] float32", "after_advantage",
     "the actor's log-probs before the update; absent on-policy (one epoch, one mini-batch, no KL in reward, no "
     "distillation), where the update's own log-probs serve"),
    ("ref_log_probs", "[B, R] float32", "after_advantage", "with a reference model (KL loss or KL in reward)"),
    ("teacher_log_probs", "[B, R] float32", "after_advantage",
     "with `distill.teacher_path`: the distillation teacher's log-probs of the sampled tokens"),
    ("values", "[B, R] float32", "after_advantage", "with a critic"),
    ("token_level_rewards", "[B, R] float32", "after_advantage",
     "`token_level_scores` minus the KL penalty when `algorithm.use_kl_in_reward`"),
    ("advantages`, `returns", "[B, R] float32", "after_advantage",
     "the estimator's output (advantages: plus the reverse-KL distillation term with `distill.mode = \"reverse_kl\"`), "
     "0 on padding"),
]


def batch_key_table() -> str:
    """BATCH_KEYS as the markdown table docs/hooks.md shows."""
    rows = ["| tensor | shape, dtype | from stage | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{name}` | {shape} | {stage} | {meaning} |" for name, shape, stage, meaning in BATCH_KEYS]
    return "\n".join(rows) + "\n"

