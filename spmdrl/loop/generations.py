"""Generations you can read: a few samples per step and per validation (logging.log_generations) as rows of
prompt, response, reward and tool calls, and every sample of every step behind a flag (logging.dump_rollouts).

A row is plain JSON:

    {"step": 3, "split": "train", "uid": 12, "data_source": "synthetic/arith", "prompt": "user: 12+34=",
     "response": "46", "ground_truth": "46", "reward": 1.0, "accuracy": 1.0,
     "turns": [{"text": "...", "tool_calls": [{"name": "calculator", "arguments": {...}, "result": "...",
                "failure": ""}]}], "finish": "answer"}

("turns" and "finish" only with multi-turn rollouts). The sampled rows go to output_dir/generations.jsonl and
to the trackers as tables (MetricsLogger.log_generations); the dump goes to output_dir/rollouts/, one file per
step, split and rank (each tensor-parallel group's samples once).
"""
from __future__ import annotations

import json
import os
from typing import Callable

from spmdrl.batch import Batch
from spmdrl.dist.meshes import RoleMesh


def prompt_text(messages) -> str:
    """A chat prompt as `role: content` lines (a plain-string prompt as itself)."""
    if isinstance(messages, str):
        return messages
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages or [])


def sample_rows(batch: Batch, step: int, split: str, limit: int | None = None) -> list[dict]:
    """The first `limit` samples of a scored batch (Scorer.attach_meta and Scorer.score ran) as rows."""
    n = len(batch) if limit is None else min(limit, len(batch))
    meta = batch.meta
    rows = []
    padding = (batch["branch"] < 0).tolist() if "branch" in batch else [False] * n  # [agent]: loop/generate.py
    for i in range(n):
        if padding[i]:
            continue
        row = {
            "step": int(step), "split": split, "uid": int(batch["uid"][i]) if "uid" in batch else None,
            "data_source": meta["data_source"][i], "prompt": prompt_text(meta["raw_prompt"][i]),
            "response": meta["response_text"][i], "ground_truth": _plain(meta["ground_truth"][i]),
            "reward": float(batch["scores"][i]),
        }
        if "accuracy" in batch:
            row["accuracy"] = float(batch["accuracy"][i])
        if "trajectory" in meta:
            info = meta["trajectory"][i]
            row["turns"] = [{"text": t["text"], "tool_calls": [
                {"name": c["name"], "arguments": c["arguments"], "result": r["text"] if r else None,
                 "failure": r["failure"] if r else "not run"}
                for c, r in zip(t["calls"], t["results"] + [None] * (len(t["calls"]) - len(t["results"])))]}
                for t in info["turns"]]
            row["finish"] = info.get("finish", "")
        rows.append(row)
    return rows


def _plain(value):
    """A ground truth as JSON can hold it (numpy arrays and scalars from parquet become lists and numbers)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value if isinstance(value, (str, int, float, bool, type(None), list, dict)) else str(value)


class GenerationLog:
    """Picks the rows to show and writes the dumps. log(step, split, rows) is the run's logger's
    log_generations (rank 0 writes; the other ranks' loggers do nothing)."""

    def __init__(self, lg, output_dir: str, rank: int, log: Callable[[int, str, list[dict]], None]):
        self.n, self.dump, self.output_dir, self.rank, self.log = lg.log_generations, lg.dump_rollouts, output_dir, rank, log
        self._pending: dict[tuple[int, str], list[dict]] = {}

    def record(self, step: int, split: str, batch: Batch, mesh: RoleMesh) -> None:
        """A scored batch of this rank (validation: one chunk of it): dumped in full with dump_rollouts; its first
        samples kept for log_generations until `flush` (validation calls this once per chunk)."""
        if self.dump and mesh.is_tp_leader:
            path = os.path.join(self.output_dir, "rollouts", f"{split}_step_{step:06d}_rank{self.rank}.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                for row in sample_rows(batch, step, split):
                    f.write(json.dumps(row) + "\n")
        have = self._pending.setdefault((step, split), [])
        if self.n > len(have):
            have += sample_rows(batch, step, split, self.n - len(have))

    def flush(self, step: int, split: str) -> None:
        """Hand the kept rows of (step, split) to the logger."""
        rows = self._pending.pop((step, split), [])
        if rows:
            self.log(step, split, rows)
