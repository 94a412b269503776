"""Rollout on this rank's TP group: prompts in, a Batch of sampled responses out.

Every rank of a rollout TP group issues the same requests with the same seeds, so the group samples
identically (docs/architecture.md, "Sampling in a TP group").
"""
from __future__ import annotations

import torch

from spmdrl.batch import Batch
from spmdrl.data.prompts import PromptDataset
from spmdrl.dist.meshes import RoleMesh
from spmdrl.loop.build import Specs
from spmdrl.loop.memory import MemoryLifecycle
from spmdrl.loop.scoring import Scorer


def request_seeds(seed: int, step: int, first: int, count: int) -> list[int]:
    """Per-prompt sampling seeds: a function of (run seed, step, global prompt position) only, so every rank
    of a rollout TP group samples identically and a rerun samples the same tokens."""
    return [(seed * 1_000_003 + step * 100_003 + first + i) % (2**31 - 1) for i in range(count)]


def rollout_to_batch(prompts: list[list[int]], prompt_idx: list[int], out, n: int, pad_id: int) -> Batch:
    """The rollout engine's output (n samples per prompt, prompt-major) as padded tensors."""
    B = len(prompts) * n
    P = max(len(p) for p in prompts)
    R = max(1, max(len(x) for x in out.response_ids))
    prompt_t = torch.full((B, P), pad_id, dtype=torch.long)
    resp_t = torch.full((B, R), pad_id, dtype=torch.long)
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


class Generator:
    """Training rollouts of this rank's rollout TP group, in the rollout layout (a rollout rank only).

    greedy_baseline: also generate one greedy response per prompt and score it (ReMax's baseline)."""

    def __init__(self, cfg, mesh: RoleMesh, engine, memory: MemoryLifecycle, specs: Specs, dataset: PromptDataset,
                 pad_id: int, scorer: Scorer, *, greedy_baseline: bool):
        self.cfg, self.mesh, self.engine, self.memory, self.specs = cfg, mesh, engine, memory, specs
        self.dataset, self.pad_id, self.scorer, self.greedy_baseline = dataset, pad_id, scorer, greedy_baseline

    def generate(self, prompt_idx: list[int], step: int, round_: int = 0) -> Batch:
        """The samples of dataset rows `prompt_idx` (this rollout dp rank's share of a step's prompts): same
        prompts and seeds on every rank of the TP group."""
        r = self.mesh
        prompts = [self.dataset.prompt_ids(i) for i in prompt_idx]
        first = round_ * self.cfg.data.train_batch_size + r.dp_offset(len(prompts))
        seeds = request_seeds(self.cfg.trainer.seed, step, first, len(prompts))
        self.memory.for_rollout()  # vLLM's KV cache back (loop/memory.py)
        out = self.engine.generate(prompts, self.specs.train, seeds)
        n = self.specs.train.n
        batch = rollout_to_batch(prompts, prompt_idx, out, n, self.pad_id)
        # the group id: one per prompt draw (step, round, global position), never the dataset row, so two
        # draws of one prompt in a step (an epoch boundary, a dynamic-sampling round) stay two groups
        uid = step * self.cfg.algorithm.max_sample_rounds * self.cfg.data.train_batch_size + first
        batch["uid"] = torch.arange(uid, uid + len(prompts), dtype=torch.long).repeat_interleave(n)
        if self.greedy_baseline:  # ReMax: greedy rollout as the baseline
            greedy = self.engine.generate(prompts, self.specs.greedy, seeds)
            gb = rollout_to_batch(prompts, prompt_idx, greedy, 1, self.pad_id)
            self.scorer.attach_meta(gb, self.dataset, r)
            self.scorer.score(gb, r)  # the same shaped reward the samples get
            batch["baseline_rewards"] = gb["scores"].repeat_interleave(n)
        return batch
