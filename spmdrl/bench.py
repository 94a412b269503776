"""Step-time benchmark: where a GRPO step's time goes, and how much of it is SPMD overhead.

    spmdrl bench [--nproc 2] [--steps 12] [--model DIR] [overrides...]

Runs the real trainer (torchrun, in-process vLLM) on the quickstart setup, then reads the per-stage timings
from metrics.jsonl. Overhead = step time - (generation + forward/backward/optimizer + weight sync): the time
spent moving batches between layouts, scoring rewards, computing advantages, reducing metrics and in Python
glue between the stages.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

GENERATION = ("timing/rollout_s",)
COMPUTE = ("timing/old_logprob_s", "timing/ref_logprob_s", "timing/values_s", "timing/update_actor_s", "timing/update_critic_s")
SYNC = ("timing/weight_sync_s",)


def prepare(work_dir: str, model: str | None) -> tuple[str, dict[str, str]]:
    from spmdrl.data.synthetic import make_arith
    from spmdrl.tiny import build_tiny

    data = make_arith(os.path.join(work_dir, "data"), n_train=2048, n_val=64, seed=0)
    if model is None:
        model = build_tiny(os.path.join(work_dir, "model"), seed=0)
    return model, data


def launch(work_dir: str, model: str, data: dict[str, str], nproc: int, steps: int, overrides: list[str]) -> str:
    out = os.path.join(work_dir, "run")
    repo_cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart", "grpo.toml")
    args = [
        "--config", repo_cfg, f"model.path={model}", f'data.train_files=["{data["train"]}"]', "data.val_files=[]",
        f"trainer.total_steps={steps}", f"trainer.output_dir={out}", "logging.tensorboard=false",
        "logging.progress=false", *overrides,
    ]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "spmdrl.train", *args]
    else:
        cmd = [sys.executable, "-m", "spmdrl.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env)
    return out


def breakdown(run_dir: str, skip: int = 2) -> dict[str, float]:
    """Median per-stage seconds over the steps after the first `skip` (warm-up), plus the overhead."""
    from spmdrl.metrics import read_jsonl

    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"), last_per_step=True) if "timing/step_s" in r]
    rows = rows[skip:] or rows
    samples = _samples_per_step(run_dir)
    keys = sorted({k for r in rows for k in r if k.startswith("timing/")} - {"timing/validation_s"})
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    # per-step sums, then the median, so the parts add up to the step they come from
    def part(names):
        return [sum(r.get(n, 0.0) for n in names) for r in rows]

    gen, comp, sync = part(GENERATION), part(COMPUTE), part(SYNC)
    step = [r["timing/step_s"] for r in rows]
    over = [s - g - c - w for s, g, c, w in zip(step, gen, comp, sync)]
    med.update({
        "generation_s": statistics.median(gen), "compute_s": statistics.median(comp),
        "weight_sync_s": statistics.median(sync), "overhead_s": statistics.median(over),
        "overhead_pct": 100 * statistics.median(o / s for o, s in zip(over, step)),
        "tokens_per_s": statistics.median(r.get("perf/tokens_per_s", 0.0) for r in rows),
        # completion tokens only: mean response length (a mean of equal-sized per-rank means) x samples per step
        "completion_tokens_per_s": statistics.median(
            r.get("train/response_length_mean", 0.0) * samples / r["timing/step_s"] for r in rows
        ),
        "steps_measured": float(len(rows)),
    })
    return med


def format_breakdown(b: dict[str, float]) -> str:
    lines = ["stage                      median s   % of step", "-" * 46]
    step = b["timing/step_s"]
    for k in sorted(k for k in b if k.startswith("timing/") and k != "timing/step_s"):
        lines.append(f"{k[7:]:<26} {b[k]:>9.4f}   {100 * b[k] / step:>8.1f}")
    lines += [
        "-" * 46,
        f"{'step':<26} {step:>9.4f}   {100.0:>8.1f}",
        f"{'generation':<26} {b['generation_s']:>9.4f}   {100 * b['generation_s'] / step:>8.1f}",
        f"{'fwd/bwd/optimizer':<26} {b['compute_s']:>9.4f}   {100 * b['compute_s'] / step:>8.1f}",
        f"{'weight sync':<26} {b['weight_sync_s']:>9.4f}   {100 * b['weight_sync_s'] / step:>8.1f}",
        f"{'SPMD overhead':<26} {b['overhead_s']:>9.4f}   {b['overhead_pct']:>8.1f}   (target <= 10%)",
        f"tokens/s {b['tokens_per_s']:.0f} (prompt + completion), completion tokens/s "
        f"{b['completion_tokens_per_s']:.0f}, over {int(b['steps_measured'])} measured steps",
    ]
    return "\n".join(lines)


def _samples_per_step(run_dir: str) -> int:
    """data.train_batch_size x rollout.n from the run's config.toml (samples generated and trained per step)."""
    import tomllib

    with open(os.path.join(run_dir, "config.toml"), "rb") as f:
        cfg = tomllib.load(f)
    return int(cfg["data"]["train_batch_size"]) * int(cfg["rollout"]["n"])


def compare(run_dirs: list[str], skip: int = 2) -> str:
    """One row per run: median step, stage seconds and completion tokens/s (for side-by-side A/B runs)."""
    cols = ("timing/step_s", "timing/rollout_s", "timing/old_logprob_s", "timing/update_actor_s",
            "timing/weight_sync_s", "overhead_s", "completion_tokens_per_s")
    head = f"{'run':<28}" + "".join(f"{c.split('/')[-1]:>24}" for c in cols)
    lines = [head, "-" * len(head)]
    for d in run_dirs:
        b = breakdown(d, skip)
        lines.append(f"{os.path.basename(os.path.normpath(os.path.dirname(d))) + '/' + os.path.basename(d):<28}"
                     + "".join(f"{b.get(c, 0.0):>24.4f}" for c in cols))
    return "\n".join(lines)


if __name__ == "__main__":  # python -m spmdrl.bench RUN_DIR [RUN_DIR ...]
    print(compare(sys.argv[1:]))
