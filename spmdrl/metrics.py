"""Where metrics go: tensorboard scalars, one JSON line per step, wandb and MLflow (spmdrl.trackers), a console
line; plus stage timing and memory.

Metric names are `group/name` (train/reward_mean, actor/pg_loss, timing/rollout_s, perf/tokens_per_s); the
same names appear in tensorboard, metrics.jsonl and reports. Only rank 0 writes; other ranks' loggers are
no-ops, so callers never branch on rank.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from collections import defaultdict
from typing import Iterator

import torch

from spmdrl.errors import DataError

log = logging.getLogger("spmdrl")

# (label on the console, metric name): the few numbers worth a glance every step; a line shows those the step has
# (the features in use).
CONSOLE_KEYS = (
    ("reward", "train/reward_mean"),
    ("val_acc", "val/accuracy"),
    ("pg_loss", "actor/pg_loss"),
    ("vf_loss", "critic/vf_loss"),
    ("distill_kl", "distill/kl_mean"),  # with a teacher (distill.teacher_path)
    ("router_agree", "moe/router_agreement"),  # with routing replay (actor.router_replay = "rollout")
    ("loss", "sft/loss"),
    ("turns", "multi_turn/turns_mean"),
    ("tool_calls", "tools/calls"),
    ("tool_fail", "tools/failures"),
    ("step_s", "timing/step_s"),
    ("tok/s", "perf/tokens_per_s"),
)


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4g}" if abs(v) < 1e3 else f"{v:.0f}"


class _Tensorboard:
    def __init__(self, output_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where it is used

        self.writer = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        text = "\n\n".join("```\n" + json.dumps(r, indent=1, ensure_ascii=False) + "\n```" for r in rows)
        self.writer.add_text(name, text, global_step=step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class _Jsonl:
    def __init__(self, output_dir: str, append: bool):
        # Append: a resumed run continues the same file (read_jsonl keeps the last record of a step).
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a" if append else "w", encoding="utf-8")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": int(step), **values}) + "\n")
        self.file.flush()

    def close(self, failed: bool) -> None:
        self.file.close()


class MetricsLogger:
    """Writes each step's metrics to the selected backends (tensorboard under output_dir/tensorboard,
    output_dir/metrics.jsonl, wandb, MLflow: spmdrl.trackers) and a line to stdout.

    A backend whose call raises is warned about and counted, never fatal: from then on each step also carries
    `logging/<backend>_failures` (the count so far) to every backend. wandb and MLflow run in the background
    (spmdrl.trackers.Background) and count lost records the same way."""

    def __init__(self, output_dir: str, *, tensorboard: bool = True, jsonl: bool = True, console: bool = True,
                 rank: int = 0, append: bool = True, progress_total: int = 0, backends: list[str] | None = None,
                 run=None, logging_config=None, console_every: int = 1, last_step: int = 0):
        """backends: names from spmdrl.trackers.BACKENDS (default: tensorboard and jsonl as the two flags say);
        wandb and mlflow need `run` (a spmdrl.trackers.TrackerRun) and `logging_config` (the [logging] section).
        console_every: steps between console lines (last_step, the run's last, always has one)."""
        self.output_dir = output_dir
        self.console_every, self.last_step = max(1, console_every), last_step
        self._bar = None
        self.enabled = rank == 0
        self.console = console and self.enabled
        self._sinks: dict[str, object] = {}
        self._failures: dict[str, int] = {}
        if not self.enabled:
            return
        if backends is None:
            backends = [b for b, on in (("tensorboard", tensorboard), ("jsonl", jsonl)) if on]
        os.makedirs(output_dir, exist_ok=True)
        for name in backends:
            if name == "tensorboard":
                self._sinks[name] = _Tensorboard(output_dir)
            elif name == "jsonl":
                self._sinks[name] = _Jsonl(output_dir, append)
            else:
                from spmdrl.trackers import open_tracker

                self._sinks[name] = open_tracker(name, run, logging_config)
        if progress_total and self.console:
            from tqdm import tqdm

            # disable=None: a bar on a terminal, plain lines when the output goes to a file or a pipe
            self._bar = tqdm(total=progress_total, desc="steps", unit="step", dynamic_ncols=True, leave=True, disable=None)

    def _count(self, name: str, sink) -> int:
        return self._failures.get(name, 0) + getattr(sink, "failures", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step. Values are anything float() accepts (Python, numpy or 0-d torch numbers)."""
        if not self.enabled:
            return
        values = {k: float(v) for k, v in metrics.items()}
        for name, sink in self._sinks.items():
            if self._count(name, sink):
                values[f"logging/{name}_failures"] = float(self._count(name, sink))
        for name, sink in self._sinks.items():
            try:
                sink.log(step, values)
            except Exception as e:
                self._failures[name] = self._failures.get(name, 0) + 1
                n = self._failures[name]
                if n == 1 or n % 100 == 0:
                    log.warning("%s: logging step %d failed (%s: %s); training goes on (failure %d, logged as "
                                "logging/%s_failures)", name, step, type(e).__name__, e, n, name)
        if self.console and (step % self.console_every == 0 or step == self.last_step):
            parts = [f"step {step}"] + [f"{label} {_fmt(values[k])}" for label, k in CONSOLE_KEYS if k in values]
            line = " | ".join(parts)
            if self._bar is not None and not self._bar.disable:
                self._bar.write(line)
                if step > self._bar.n:
                    self._bar.update(step - self._bar.n)
            else:
                print(line, file=sys.stdout, flush=True)

    def log_generations(self, step: int, split: str, rows: list[dict]) -> None:
        """Sampled generations (spmdrl.loop.generations rows): appended to output_dir/generations.jsonl, and to
        every backend that shows tables as `generations/<split>` (tensorboard text, a wandb table, an MLflow
        artifact). A backend that fails is counted as for metrics."""
        if not self.enabled or not rows:
            return
        with open(os.path.join(self.output_dir, "generations.jsonl"), "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        for name, sink in self._sinks.items():
            if hasattr(sink, "log_table"):
                try:
                    sink.log_table(step, f"generations/{split}", rows)
                except Exception as e:
                    self._failures[name] = self._failures.get(name, 0) + 1
                    log.warning("%s: logging the generations of step %d failed (%s: %s)", name, step,
                                type(e).__name__, e)

    def close(self) -> None:
        """Close every backend; called while an exception propagates (a finally block), the tracker runs are
        marked failed."""
        failed = sys.exc_info()[0] is not None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        sinks, self._sinks = self._sinks, {}
        for name, sink in sinks.items():
            try:
                sink.close(failed)
            except Exception as e:
                log.warning("%s: closing failed (%s: %s)", name, type(e).__name__, e)
            if self._count(name, sink):
                log.warning("%s: %d logging call(s) failed or were dropped during this run", name, self._count(name, sink))

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def logger_for(cfg, rank: int, *, resume: bool, progress_total: int) -> MetricsLogger:
    """The MetricsLogger of a run (Config or SFTConfig): its [logging] backends, the tracker run named by the
    config; `resume` appends to metrics.jsonl and continues the tracker runs of output_dir/trackers.json."""
    from spmdrl.trackers import selected_backends, tracker_run

    lg = cfg.logging
    backends = selected_backends(lg)
    run = tracker_run(cfg, resume=resume) if rank == 0 and any(b in ("wandb", "mlflow") for b in backends) else None
    every = lg.console_every or (max(1, progress_total // 20) if hasattr(cfg, "sft") else 1)
    return MetricsLogger(cfg.trainer.output_dir, console=lg.console, rank=rank, append=resume,
                         progress_total=progress_total if lg.progress else 0, backends=backends, run=run,
                         logging_config=lg, console_every=every, last_step=progress_total)


def read_jsonl(path: str, *, last_per_step: bool = False) -> list[dict]:
    """The records of a metrics.jsonl, in file order.

    A malformed final line (a run killed mid-write) is dropped; a malformed line elsewhere is a DataError.
    last_per_step keeps only the last record of each step (a resumed run re-logs the steps after its
    checkpoint), sorted by step.
    """
    if not os.path.isfile(path):
        raise DataError(f"file {path}: not found; metrics.jsonl is written under trainer.output_dir")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise DataError(f"file {path}, line {i + 1}: not valid JSON ({e.msg}); the file is corrupted") from None
    if last_per_step:
        by_step = {r["step"]: r for r in records if "step" in r}
        records = [by_step[s] for s in sorted(by_step)]
    return records


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def peak_memory_gb(device) -> float:
    """Peak memory in GiB: CUDA max_memory_allocated on a CUDA device, else this process's peak RSS."""
    if _is_cuda(device):
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20  # bytes on macOS, KiB on Linux


class StageTimer:
    """Wall time per named stage, summed over repeated entries until reset().

        timer = StageTimer(device)
        with timer("rollout"):
            ...
        timer.as_metrics()  # {"timing/rollout_s": ...}

    On CUDA the current stream is synchronized on entry and exit, so the kernels a stage queued (and the
    collectives it waited for, which the stream then waits on) are charged to it. Not the whole device: a
    device-wide synchronisation would also wait for point-to-point sends posted earlier and not waited for
    (split placement's batch sends), serialising them behind the timer. Without a device it synchronizes
    whenever CUDA is initialized.
    """

    # Where this process is, for failure messages (spmdrl.faults): the innermost stage being timed, the stage an
    # exception last escaped from (cleared when a stage starts), the stage that last finished.
    current: str | None = None
    failed: str | None = None
    last: str | None = None

    def __init__(self, device=None):
        self.device = device
        self._totals: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if _is_cuda(self.device):
            torch.cuda.current_stream(self.device).synchronize()
        elif self.device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        outer, StageTimer.current, StageTimer.failed = StageTimer.current, name, None
        try:
            yield
        except BaseException:
            StageTimer.failed = StageTimer.failed or name  # the innermost
            raise
        finally:
            self._sync()
            self._totals[name] += time.perf_counter() - start
            StageTimer.current = outer
        StageTimer.last = name

    def as_metrics(self) -> dict[str, float]:
        return {f"timing/{name}_s": t for name, t in self._totals.items()}

    def reset(self) -> None:
        self._totals.clear()


__all__ = ["MetricsLogger", "StageTimer", "logger_for", "peak_memory_gb", "read_jsonl"]


def summarize_run(run_dir: str) -> dict[str, float]:
    """Headline numbers of a finished run from its metrics.jsonl: first/last/best validation accuracy, reward
    at the start and end (mean of the first and last 5 steps; with distillation also the KL to the teacher),
    median step time and throughput."""
    import statistics

    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"), last_per_step=True)
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    train = [r for r in rows if "train/reward_mean" in r]
    out: dict[str, float] = {"steps": float(len(train))}
    if val:
        out.update({"val/accuracy first": val[0], "val/accuracy last": val[-1], "val/accuracy best": max(val)})
    if train:
        rewards = [r["train/reward_mean"] for r in train]
        out["train/reward first 5"] = statistics.fmean(rewards[:5])
        out["train/reward last 5"] = statistics.fmean(rewards[-5:])
        kl = [r["distill/kl_mean"] for r in train if "distill/kl_mean" in r]
        if kl:  # on-policy distillation: the per-token reverse KL to the teacher
            out["distill/kl_mean first 5"] = statistics.fmean(kl[:5])
            out["distill/kl_mean last 5"] = statistics.fmean(kl[-5:])
        for key in ("timing/step_s", "timing/rollout_s", "timing/update_actor_s", "timing/weight_sync_s", "perf/tokens_per_s"):
            vals = [r[key] for r in train if key in r]
            if vals:
                out[f"{key} (median)"] = statistics.median(vals)
    return out


def format_table(rows: list[tuple[str, dict[str, float]]]) -> str:
    """A plain-text table: one column per run, one row per metric."""
    keys = list(dict.fromkeys(k for _, d in rows for k in d))
    names = [n for n, _ in rows]
    width = max(len(k) for k in keys) if keys else 10
    cols = [max(len(n), 10) for n in names]
    lines = [" " * width + " | " + " | ".join(n.rjust(c) for n, c in zip(names, cols))]
    lines.append("-" * len(lines[0]))
    for k in keys:
        cells = [(_fmt(d[k]) if k in d else "-").rjust(c) for (_, d), c in zip(rows, cols)]
        lines.append(k.ljust(width) + " | " + " | ".join(cells))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- model FLOPs

# Dense bf16 peak of one device in TFLOP/s (vendor datasheets, without sparsity), by a substring of its name.
_PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0))


def forward_flops_per_token(hf_config, context: float, head: bool = True) -> float:
    """Forward FLOPs of one token of a decoder-only transformer (Qwen2/Llama layout) that attends to `context`
    earlier tokens on average: 2 x (q, k, v, o, gate, up, down weights, and the lm_head's when `head`) + 2 x 2 x
    hidden x context per layer for QK^T and AV. Embedding lookups, norms and activations are not counted; nor is a
    vision-language model's vision tower (its language model's are)."""
    hf_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    h = hf_config.hidden_size
    layers = hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    kv = getattr(hf_config, "num_key_value_heads", heads) * head_dim
    q = heads * head_dim
    ffn = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None) or 4 * h  # GPT-2's
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * ffn
    matmul_params = layers * per_layer + (hf_config.vocab_size * h if head else 0)
    return 2.0 * matmul_params + 4.0 * layers * q * context


def _flop_terms(hf_config) -> tuple[float, float, float]:
    """Forward FLOPs per token of the transformer layers' matmuls, per token of the lm_head, and per query-key
    pair of attention (over all layers)."""
    body = forward_flops_per_token(hf_config, 0.0, head=False)
    lm_head = forward_flops_per_token(hf_config, 0.0) - body
    return body, lm_head, forward_flops_per_token(hf_config, 1.0) - body - lm_head


def executed_forward_flops(hf_config, *, rows: int, width: int, head_tokens: float,
                           seq_sq_sum: float | None = None) -> float:
    """Forward FLOPs a micro-batch of `rows` x `width` tokens runs: the layers on every position, padding
    included, and the lm_head on `head_tokens` positions. Attention (QK^T and AV) with a dense kernel: padded
    rows, and the rows of the row-packed layout, run all width x width pairs of each row, masked or not (torch
    SDPA's math kernel, eager attention); a packed variable-length batch (one row of every sequence's tokens,
    seq_sq_sum given) runs each sequence's own n x n pairs, seq_sq_sum = sum of n^2 (causal flash kernels
    skip about half of those). Hardware FLOPs, the counterpart of flops_metrics' model FLOPs."""
    body, lm_head, attn_per_pair = _flop_terms(hf_config)
    pairs = rows * width * width if seq_sq_sum is None else seq_sq_sum
    return body * rows * width + lm_head * head_tokens + attn_per_pair * pairs


def device_peak_tflops(device, configured: float = 0.0) -> float:
    """Peak of one device for MFU: `configured` when > 0, else the bf16 dense peak of a known CUDA device,
    else 0 (CPU and unknown devices: only achieved TFLOP/s are reported)."""
    if configured > 0:
        return configured
    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        for key, peak in _PEAK_BF16_TFLOPS:
            if key in name:
                return peak
    return 0.0


def flops_metrics(hf_config, *, seq_lens_sum: float, seq_sq_sum: float, head_tokens: float, update_s: float,
                  rollout_s: float, devices: int, peak_tflops: float, update_passes: int = 1) -> dict[str, float]:
    """perf/actor_tflops and perf/rollout_tflops (achieved, per device) and, with a known peak, perf/mfu_actor
    and perf/mfu_rollout = achieved / peak.

    The transformer layers run on every prompt and response token (seq_lens_sum); the lm_head only on the
    `head_tokens` positions whose logits are computed: the response tokens (the training engines project response
    positions only, and a sampler computes logits for the token it samples). Actor update: 3 x forward (forward
    + backward), update_passes times (ppo_epochs). Attention by each sequence's own length: the token at position
    t (from 0) attends to the t + 1 keys of its sequence up to itself, so a sequence of n tokens has n(n+1)/2
    query-key pairs and the batch (seq_sq_sum + seq_lens_sum) / 2, whatever the layout (padding, and the
    masked-out blocks of a packed row, are not counted). Rollout: one forward (prefill + decode, the same
    count with a KV cache). Figures over all `devices` ranks; divided per device. These are model FLOPs:
    recomputation (the log-prob head's chunks in backward, gradient checkpointing) is not counted; see
    executed_forward_flops for what a padded or packed micro-batch runs.
    """
    body, lm_head, attn_per_pair = _flop_terms(hf_config)
    fwd = body * seq_lens_sum + lm_head * head_tokens + attn_per_pair * (seq_sq_sum + seq_lens_sum) / 2
    out = {}
    for name, flops, secs in (("actor", 3.0 * fwd * update_passes, update_s), ("rollout", fwd, rollout_s)):
        if secs > 0:
            achieved = flops / secs / max(devices, 1) / 1e12
            out[f"perf/{name}_tflops"] = achieved
            if peak_tflops > 0:
                out[f"perf/mfu_{name}"] = achieved / peak_tflops
    return out
