"""Step-time benchmark: where a GRPO step's time goes, and how much of it is SPMD overhead.

    spmdrl bench [--nproc 2] [--steps 12] [--model DIR] [overrides...]
    spmdrl bench --tools [--model SFT_MODEL_DIR]     the multi-turn turn loop on the calculator task
    spmdrl bench --async                             colocated / split, synchronous / asynchronous, long tail

Runs the real trainer (torchrun, in-process vLLM) on the quickstart setup, then reads the per-stage timings
from metrics.jsonl. Overhead = step time - (generation + forward/backward/optimizer + weight sync): the time
spent moving batches between layouts, scoring rewards, computing advantages, reducing metrics and in Python
glue between the stages.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys

from spmdrl.errors import SpmdrlError

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


def _quickstart_config(name: str) -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart", name)


def launch(work_dir: str, model: str, data: dict[str, str], nproc: int, steps: int, overrides: list[str],
           code_dir: str | None = None, run_name: str = "run", config: str = "grpo.toml") -> str:
    """Run the trainer with configs/quickstart/`config`; `code_dir` puts another checkout first on the trainer's
    PYTHONPATH (A/B runs)."""
    out = os.path.join(work_dir, run_name)
    shutil.rmtree(out, ignore_errors=True)  # the bench's own run directory: a fresh run every time
    repo_cfg = _quickstart_config(config)
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
    if code_dir:
        env["PYTHONPATH"] = os.pathsep.join([code_dir, env.get("PYTHONPATH", "")])
    # python -m puts the working directory first on sys.path: run from the checkout that is meant to run
    subprocess.run(cmd, check=True, env=env, cwd=code_dir or None)
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
        # the least disturbed step: a steadier figure than the median when other jobs share the machine
        "min_step_s": min(step),
        "best_completion_tokens_per_s": max(
            r.get("train/response_length_mean", 0.0) * samples / r["timing/step_s"] for r in rows
        ),
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
    cols = ("timing/step_s", "min_step_s", "timing/rollout_s", "timing/update_actor_s", "timing/weight_sync_s",
            "overhead_s", "completion_tokens_per_s", "best_completion_tokens_per_s")
    labels = ("step s", "min step s", "rollout s", "update s", "sync s", "overhead s", "compl tok/s", "best tok/s")
    head = f"{'run':<22}" + "".join(f"{c:>14}" for c in labels)
    lines = [head, "-" * len(head)]
    for d in run_dirs:
        b = breakdown(d, skip)
        lines.append(f"{os.path.basename(os.path.normpath(os.path.dirname(d))):<22}"
                     + "".join(f"{b.get(c, 0.0):>14.4f}" for c in cols))
    return "\n".join(lines)


PLACEMENT_COLS = (
    ("timing/step_s", "step"), ("timing/rollout_s", "rollout"), ("busy_train_s", "train busy"),
    ("timing/wait_batch_s", "wait batch"), ("timing/train_wait_s", "train wait"),
    ("timing/wait_weights_s", "wait weights"), ("timing/rollout_wait_s", "rollout wait"),
    ("timing/weight_sync_s", "sync"), ("completion_tokens_per_s", "compl tok/s"),
)
TRAIN_BUSY = COMPUTE + ("timing/reward_s", "timing/advantage_s", "timing/weight_sync_s")


def placements(nproc: int) -> dict[str, list[str]]:
    """The three setups `spmdrl bench --placements` compares on the same world: colocated (every rank does
    everything), split with the first half of the ranks on vLLM, on-policy (max_staleness 0) and one step
    off-policy (max_staleness 1)."""
    rollout = "[" + ",".join(str(r) for r in range(max(1, nproc // 2))) + "]"
    split = ["placement.mode=split", f"placement.rollout_ranks={rollout}"]
    return {"colocated": [], "split_s0": [*split, "trainer.max_staleness=0"],
            "split_s1": [*split, "trainer.max_staleness=1"]}


def placement_bench(work_dir: str, model: str | None, nproc: int, steps: int, overrides: list[str]) -> str:
    """Run the three placements on the same workload and world size; one row each: median seconds per step of
    each role's work and of each wait (the roles' idle time), and completion tokens/s. In split placement a
    rollout rank's step is rollout + wait weights + rollout wait (at the step's metric reduction); a training
    rank's is wait batch + train busy + train wait."""
    model_dir, data = prepare(work_dir, model)
    rows = []
    for name, extra in placements(nproc).items():
        run = launch(work_dir, model_dir, data, nproc, steps, [*overrides, *extra, "checkpoint.save_freq=-1"],
                     run_name=name)
        b = breakdown(run)
        b["busy_train_s"] = _median_sum(run, TRAIN_BUSY)
        rows.append((name, b))
    head = f"{'placement':<12}" + "".join(f"{label:>13}" for _, label in PLACEMENT_COLS)
    lines = [f"median seconds per step over steps 3..{steps}, {nproc} ranks", head, "-" * len(head)]
    for name, b in rows:
        lines.append(f"{name:<12}" + "".join(f"{b.get(k, 0.0):>13.4f}" for k, _ in PLACEMENT_COLS))
    return "\n".join(lines)


# ----- colocated / split, synchronous / asynchronous, on a long-tail workload -----

LONG_TAIL = [
    # a response ends at EOS or at any of 3 of the tiny model's 320 tokens: the lengths are about geometric (mean
    # ~75), 3-7 % reach max_response_length. Generation dominates the step: a synchronous rollout runs until its
    # longest response ends, with the engine nearly empty for most of that time
    "data.max_response_length=256", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
    "actor.micro_batch_size=8", "rollout.stop_token_ids=[40,41,42]", "rollout.parity_check=false",
    "checkpoint.save_freq=-1",
]


def async_modes(nproc: int) -> dict[str, list[str]]:
    """The four setups `spmdrl bench --async` compares on the same world and prompts: (a) colocated synchronous,
    (b) split one step off-policy, (c) asynchronous split (rollout.partial), (d) colocated with partial rollouts.
    The partial modes' version bounds (trainer.max_staleness 4, rollout.max_version_lag 3) are ones the longest
    responses of LONG_TAIL stay within: a tighter bound aborts them (generation thrown away, and the long tail cut
    out of the trained batches, which then differ from the synchronous modes' in length)."""
    split = placements(nproc)["split_s1"][:2]
    return {"a colocated": [], "b split k=1": [*split, "trainer.max_staleness=1"],
            "c split async": [*split, "trainer.max_staleness=4", "rollout.partial=keep"],
            "d colocated partial": ["rollout.partial=keep", "rollout.max_version_lag=3"]}


ASYNC_BASELINE = ("a colocated", "b split k=1")
"""The modes `spmdrl bench --async --baseline REV` also runs with the code of REV (e.g. today's main)."""


def trained_steps(run_dir: str) -> list[dict[str, float]]:
    """Per logged step of a run: its seconds, trained tokens, busy fractions, mean version lag of the trained tokens,
    mean response length and the share of responses that reached max tokens."""
    from spmdrl.metrics import read_jsonl

    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"), last_per_step=True) if "timing/step_s" in r]
    out = []
    for r in rows:
        lag = r.get("rollout/version_lag_mean", r.get("train/weight_version_lag", 0.0))
        out.append({"step": r["step"], "s": r["timing/step_s"], "tokens": r["perf/trained_tokens_per_s"] * r["timing/step_s"],
                    "rollout_busy": r.get("perf/rollout_busy", 0.0), "train_busy": r.get("perf/train_busy", 0.0),
                    "lag": lag, "length": r.get("train/response_length_mean", 0.0),
                    "clip": r.get("train/response_clip_ratio", 0.0),
                    "aborted": r.get("rollout/requests_aborted_stale", 0.0)})
    return out


def measured(steps: list[dict[str, float]], warmup: int, tail: int) -> list[dict[str, float]]:
    """The steps a mode is measured over: after `warmup` steps (engine warm-up; partial modes' carried-over requests
    reaching their steady state) and before the last `tail` (a split run's rollout ranks have nothing left to
    generate for the last steps)."""
    return steps[warmup:len(steps) - tail]


def window(steps: list[dict[str, float]], budget: float) -> dict[str, float]:
    """The measured steps from the first on, until their trained tokens reach `budget`; the step that crosses it
    counts by the fraction of its tokens needed, so every mode is measured over exactly `budget` trained tokens.
    Trained tokens/s = budget / the window's seconds; busy fractions are time-weighted, the version lag
    token-weighted, response length and the at-max share weighted by samples (the same number every step)."""
    total = sum(r["tokens"] for r in steps)
    if budget > total * (1 + 1e-9) or budget <= 0:
        raise SpmdrlError(f"a trained-token window of {budget:.0f} tokens: the measured steps trained {total:.0f}; "
                          "pass a smaller --tokens or more --steps")
    weights, left = [], budget
    for r in steps:
        w = 1.0 if r["tokens"] <= left else left / r["tokens"]
        weights.append(w)
        left -= w * r["tokens"]
        if left <= budget * 1e-12:
            break
    rows = steps[:len(weights)]
    secs = sum(w * r["s"] for w, r in zip(weights, rows))
    n = sum(weights)

    def by(key: str, weight) -> float:
        ws = [w * weight(r) for w, r in zip(weights, rows)]
        return sum(x * r[key] for x, r in zip(ws, rows)) / sum(ws)

    return {"tokens": budget, "seconds": secs, "tokens_per_s": budget / secs, "steps": n,
            "last_step": rows[-1]["step"], "rollout_busy": 100 * by("rollout_busy", lambda r: r["s"]),
            "train_busy": 100 * by("train_busy", lambda r: r["s"]), "lag": by("lag", lambda r: r["tokens"]),
            "length": by("length", lambda r: 1.0), "clip": 100 * by("clip", lambda r: 1.0),
            "aborted": by("aborted", lambda r: 1.0)}


def async_table(runs: dict[str, list[dict[str, float]]], warmup: int, tail: int, tokens: float | None = None) -> str:
    """One row per mode over the same number of trained tokens (`tokens`, default the fewest any mode trained in its
    measured steps), and the issue's targets: (c) / (b) trained tokens/s >= 1.3 with rollout busy >= 90 %,
    (d) / (a) >= 1.2; with baseline rows ("... (base)"), each mode against its baseline."""
    kept = {name: measured(steps, warmup, tail) for name, steps in runs.items()}
    budget = tokens or min(sum(r["tokens"] for r in steps) for steps in kept.values())
    rows = {name: window(steps, budget) for name, steps in kept.items()}
    cols = (("tokens_per_s", "trained tok/s", "{:>14.1f}"), ("rollout_busy", "rollout busy %", "{:>15.1f}"),
            ("train_busy", "trainer busy %", "{:>15.1f}"), ("lag", "mean lag", "{:>9.2f}"),
            ("length", "mean len", "{:>9.1f}"), ("clip", "at max %", "{:>9.1f}"), ("aborted", "aborted", "{:>8.1f}"),
            ("steps", "steps", "{:>7.1f}"),
            ("seconds", "seconds", "{:>8.1f}"))
    head = f"{'mode':<24}" + "".join(f"{label:>{len(fmt.format(0.0))}}" for _, label, fmt in cols)
    lines = [f"each mode over {budget:.0f} trained tokens, from step {warmup + 1} on (steps: the window's steps, the "
             "last counted by the fraction of its tokens needed; aborted: requests aborted as too stale per step)",
             head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(f"{name:<24}" + "".join(fmt.format(r[k]) for k, _, fmt in cols))

    def ratio(a: str, b: str) -> str:
        return f"{rows[a]['tokens_per_s'] / rows[b]['tokens_per_s']:.2f}x" if a in rows and b in rows else "-"

    lines.append("")
    if "c split async" in rows:
        lines.append(f"c / b: {ratio('c split async', 'b split k=1')} (target >= 1.3x), c rollout busy "
                     f"{rows['c split async']['rollout_busy']:.1f} % (target >= 90 %)")
    lines.append(f"d / a: {ratio('d colocated partial', 'a colocated')} (target >= 1.2x)")
    for name in rows:
        if name.endswith(" (base)"):
            mode = name[:-len(" (base)")]
            lines.append(f"{mode} / its baseline: {ratio(mode, name)}")
    return "\n".join(lines)


def export_code(rev: str, dest: str) -> str:
    """The spmdrl package at git revision `rev` of this checkout, exported to dest (for A/B runs)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    try:
        archive = subprocess.run(["git", "-C", repo, "archive", rev, "spmdrl"], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", b"") or b""
        raise SpmdrlError(f"--baseline {rev}: cannot export it from the git checkout {repo} "
                          f"({err.decode().strip() or e}); pass a revision of that checkout") from None
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def async_bench(work_dir: str, model: str | None, nproc: int, steps: int, overrides: list[str],
                tokens: float | None = None, warmup: int | None = None, baseline: str | None = None) -> str:
    """Run the four setups of `async_modes` on the long-tail workload (LONG_TAIL, then the overrides) from the same
    model, prompts and seed, and with a baseline revision (`baseline`, e.g. "main") also (a) and (b) with its code;
    one row each over the same number of trained tokens (async_table). warmup: steps not measured (default a
    quarter of the steps, at least 2); the last 2 steps are not measured either."""
    model_dir, data = prepare(work_dir, model)
    warmup = max(2, steps // 4) if warmup is None else warmup
    modes = [(name, extra, None) for name, extra in async_modes(nproc).items()]
    if baseline:
        code = export_code(baseline, os.path.join(work_dir, "baseline_code"))
        base = [(f"{name} (base)", async_modes(nproc)[name], code) for name in ASYNC_BASELINE]
        modes = modes[:2] + base + modes[2:]
    runs = {}
    for name, extra, code in modes:
        run = launch(work_dir, model_dir, data, nproc, steps, [*LONG_TAIL, *overrides, *extra], code_dir=code,
                     run_name=name.split()[0] + ("_base" if code else "") + "_" + name.split()[1])
        runs[name] = trained_steps(run)
    value = dict(o.split("=", 1) for o in [*LONG_TAIL, *overrides])
    head = (f"{nproc} ranks, {steps} steps per mode, {value['data.train_batch_size']} prompts x {value['rollout.n']} "
            f"samples per step, max {value['data.max_response_length']} tokens"
            + (f"; (base): the code of {baseline}" if baseline else ""))
    return head + "\n" + async_table(runs, warmup, 2, tokens)


def learning_table(runs: dict[str, str], key: str = "val/accuracy") -> str:
    """A markdown table of `key` at each validation step of each run (one column per run, name -> run directory),
    and each run's last value minus the first run's (the reference)."""
    from spmdrl.metrics import read_jsonl

    curves = {name: {r["step"]: r[key] for r in read_jsonl(os.path.join(d, "metrics.jsonl"), last_per_step=True)
                     if key in r} for name, d in runs.items()}
    for name, c in curves.items():
        if not c:
            raise SpmdrlError(f"run {name} ({runs[name]}): no {key} in its metrics.jsonl; set trainer.test_freq and "
                              "data.val_files")
    names = list(curves)
    steps = sorted({s for c in curves.values() for s in c})
    lines = ["| step | " + " | ".join(names) + " |", "| ---: |" + " ---: |" * len(names)]
    for s in steps:
        lines.append(f"| {s} | " + " | ".join(f"{curves[n][s]:.3f}" if s in curves[n] else "-" for n in names) + " |")
    ref = curves[names[0]][max(curves[names[0]])]
    last = {n: c[max(c)] for n, c in curves.items()}
    lines.append("| last - " + names[0] + " | " + " | ".join(f"{last[n] - ref:+.3f}" for n in names) + " |")
    return "\n".join(lines)


LORA_COLS = (
    ("timing/step_s", "step"), ("timing/rollout_s", "rollout"), ("timing/weight_sync_s", "sync"),
    ("weight_sync/bytes_recv_max", "sync bytes"), ("completion_tokens_per_s", "compl tok/s"),
)


def lora_syncs(overrides: list[str]) -> dict[str, list[str]]:
    """The two LoRA weight syncs `spmdrl bench --lora` compares on the same workload: the adapter alone into
    vLLM's LoRA layers, and the adapter merged into the base through the planned full-weight resharding. A LoRA
    actor needs [lora]: lora.enable and rank 8 unless the overrides set a lora key."""
    lora = ["lora.enable=true"] + ([] if any(o.startswith("lora.rank") for o in overrides) else ["lora.rank=8"])
    return {"adapter": [*lora, "rollout.lora_sync=adapter"], "merge": [*lora, "rollout.lora_sync=merge"]}


def lora_bench(work_dir: str, model: str | None, nproc: int, steps: int, overrides: list[str]) -> str:
    """Run the LoRA actor with each weight sync on the same workload and world; one row each: median seconds per
    step, rollout (vLLM's LoRA kernels against merged weights) and weight sync, the bytes a rollout rank
    received per sync, completion tokens/s."""
    model_dir, data = prepare(work_dir, model)
    rows = []
    for name, extra in lora_syncs(overrides).items():
        run = launch(work_dir, model_dir, data, nproc, steps, [*overrides, *extra, "checkpoint.save_freq=-1"],
                     run_name=f"lora_{name}")
        b = breakdown(run)
        b["weight_sync/bytes_recv_max"] = _median_sum(run, ("weight_sync/bytes_recv_max",))
        rows.append((name, b))
    head = f"{'lora sync':<12}" + "".join(f"{label:>13}" for _, label in LORA_COLS)
    lines = [f"median per step over steps 3..{steps}, {nproc} ranks (seconds; sync bytes per rollout rank)", head,
             "-" * len(head)]
    for name, b in rows:
        lines.append(f"{name:<12}" + "".join(
            f"{b.get(k, 0.0):>13.0f}" if k.startswith("weight_sync/") else f"{b.get(k, 0.0):>13.4f}" for k, _ in LORA_COLS))
    return "\n".join(lines)


# ----- the multi-turn turn loop on the calculator task -----

TOOL_SFT_DIR = "tools_sft_model"


def prepare_tools(work_dir: str, model: str | None, nproc: int) -> tuple[str, dict[str, str]]:
    """The calculator task's data (as the tool quickstart writes it) and a policy that calls the tool: `model`,
    else the warm start of the tool quickstart (configs/quickstart/sft_tools.toml) trained once into
    work_dir/tools_sft_model and reused after."""
    from spmdrl.data.tool_sums import make_tool_sums
    from spmdrl.tiny import build_tiny

    data = make_tool_sums(os.path.join(work_dir, "tool_data"), seed=0)
    if model is not None:
        return model, data
    model = os.path.join(work_dir, TOOL_SFT_DIR)
    if os.path.isfile(os.path.join(model, "config.json")):
        return model, data
    tiny = build_tiny(os.path.join(work_dir, "model"), seed=0)
    args = ["--config", _quickstart_config("sft_tools.toml"), f"model.path={tiny}",
            f'sft.train_files=["{data["sft"]}"]', f"sft.save_dir={model}",
            f"trainer.output_dir={os.path.join(work_dir, 'tools_sft')}", "logging.tensorboard=false",
            "logging.progress=false"]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
           if nproc > 1 else [sys.executable]) + ["-m", "spmdrl.sft", *args]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return model, data


TURN_KEYS = {"generation": "timing/turn_generate_s", "tools": "timing/turn_tools_s",
             "loop_other": "timing/turn_other_s", "idle": "timing/turn_idle_s"}
"""The turn loop's time split per step, each a mean over the rollout ranks; idle is a rank's wait for the rollout
rank whose loop took longest, so the four add up to the slowest rank's loop time."""


def tool_breakdown(run_dir: str, skip: int = 2) -> dict[str, float]:
    """Medians per step (after `skip` warm-up steps) of the turn loop's time split: generation, tool calls, the
    loop's own work (parsing calls, rendering the template glue, the group's agreement check) and idle (waiting
    for the slowest rollout rank), in seconds and as fractions of the loop's wall time (their sum); turns (loop
    iterations per step, turns per trajectory), tool calls, and model tokens per second (tokens the policy
    sampled; tool results and template glue not counted)."""
    from spmdrl.metrics import read_jsonl

    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"), last_per_step=True) if "timing/step_s" in r]
    rows = rows[skip:] or rows
    samples = _samples_per_step(run_dir)

    def med(fn):
        return statistics.median(fn(r) for r in rows)

    wall = [sum(r.get(k, 0.0) for k in TURN_KEYS.values()) for r in rows]
    timed = [(r, w) for r, w in zip(rows, wall) if w > 0]
    out = {}
    for name, key in TURN_KEYS.items():
        out[name] = med(lambda r, k=key: r.get(k, 0.0))
        out[f"{name}_frac"] = statistics.median(r.get(key, 0.0) / w for r, w in timed) if timed else 0.0
    out["loop_wall"] = statistics.median(wall)
    out["step"] = med(lambda r: r["timing/step_s"])
    out["loop_turns"] = med(lambda r: r.get("multi_turn/loop_turns", 0.0))
    out["turns_mean"] = med(lambda r: r.get("multi_turn/turns_mean", 0.0))
    out["turns_max"] = max(r.get("multi_turn/turns_max", 0.0) for r in rows)
    out["tool_calls"] = med(lambda r: r.get("tools/calls", 0.0))
    out["model_tokens_mean"] = med(lambda r: r.get("multi_turn/model_tokens_mean", 0.0))
    out["tool_tokens_mean"] = med(lambda r: r.get("multi_turn/tool_tokens_mean", 0.0))
    # the ranks generate their shares at the same time: the step's model tokens over the loop's wall time
    out["model_tokens_per_s"] = statistics.median(
        r.get("multi_turn/model_tokens_mean", 0.0) * samples / w for r, w in timed) if timed else 0.0
    out["model_tokens_per_step_s"] = med(lambda r: r.get("multi_turn/model_tokens_mean", 0.0) * samples / r["timing/step_s"])
    out["samples"] = float(samples)
    out["steps_measured"] = float(len(rows))
    return out


def format_tool_breakdown(b: dict[str, float], nproc: int) -> str:
    lines = [
        f"turn loop on the calculator task: median per step over {int(b['steps_measured'])} steps, {nproc} ranks, "
        f"{int(b['samples'])} trajectories per step",
        "turn loop                          median s   % of loop wall",
        "-" * 60,
    ]
    for name, label in (("generation", "generation"), ("tools", "tools"), ("loop_other", "loop (parse, glue, checks)"),
                        ("idle", "idle (wait for slowest rank)")):
        lines.append(f"{label:<32} {b[name]:>10.4f}   {100 * b[name + '_frac']:>8.1f}")
    lines += [
        "-" * 60,
        f"{'loop wall (slowest rank)':<32} {b['loop_wall']:>10.4f}   (step {b['step']:.4f} s)",
        f"turns: {b['loop_turns']:.0f} loop turns per step, {b['turns_mean']:.2f} per trajectory (max "
        f"{b['turns_max']:.0f}), {b['tool_calls']:.0f} tool calls per step",
        f"tokens per trajectory: {b['model_tokens_mean']:.1f} model, {b['tool_tokens_mean']:.1f} tool results and glue",
        f"model tokens/s: {b['model_tokens_per_s']:.0f} over the loop's wall time, {b['model_tokens_per_step_s']:.0f} "
        "over the whole step",
    ]
    return "\n".join(lines)


def tool_bench(work_dir: str, model: str | None, nproc: int, steps: int, overrides: list[str]) -> str:
    """GRPO with multi-turn rollouts on the calculator task (configs/quickstart/grpo_tools.toml, no validation,
    no checkpoints) and the turn loop's time split."""
    model_dir, data = prepare_tools(work_dir, model, nproc)
    run = launch(work_dir, model_dir, data, nproc, steps, ["checkpoint.save_freq=-1", *overrides], run_name="tools",
                 config="grpo_tools.toml")
    return format_tool_breakdown(tool_breakdown(run), nproc)


def _median_sum(run_dir: str, keys, skip: int = 2) -> float:
    from spmdrl.metrics import read_jsonl

    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"), last_per_step=True) if "timing/step_s" in r]
    return statistics.median(sum(r.get(k, 0.0) for k in keys) for r in (rows[skip:] or rows))


def update_bench(model: str, samples: int, prompt_len: tuple[int, int], response_len: tuple[int, int],
                 overrides: list[str], reps: int = 5, seed: int = 0) -> dict[str, float]:
    """Time one actor update (forward + backward + AdamW over `samples` sequences, one mini-batch) and one
    forward-only log-prob pass on this process alone (a 1-rank gloo world, the real FSDPEngine and
    run_updates), with prompt and response lengths drawn uniformly from the given ranges. Median wall seconds
    and median CPU seconds of this process (the better figure on a machine shared with other jobs)."""
    import time

    import torch
    import torch.distributed as dist

    from spmdrl.algos import POLICY_LOSSES
    from spmdrl.batch import Batch
    from spmdrl.config import load_config
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine
    from spmdrl.config.derived import micro_batch_limits
    from spmdrl.loop.update import ActorObjective, forward_all, run_updates

    if not dist.is_initialized():
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    repo_cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart", "grpo.toml")
    cfg = load_config(repo_cfg, [f"model.path={model}", *overrides])
    a = cfg.actor
    mesh = RoleMeshes(plan_layout(cfg.placement, 1), 0, "cpu")["actor"]
    torch.manual_seed(seed)
    eng = build_train_engine("fsdp", model, mesh, torch.device("cpu"), trainable=True, optim=dict(lr=1e-6), total_steps=10**6,
                             attn_implementation=cfg.model.attn_implementation)
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(prompt_len[0], prompt_len[1] + 1, (samples,), generator=g)
    rlen = torch.randint(response_len[0], response_len[1] + 1, (samples,), generator=g)
    P, R = int(plen.max()), int(rlen.max())
    vocab = eng.hf_config().vocab_size
    mask = (torch.arange(R)[None] < rlen[:, None]).float()
    batch = Batch({
        "prompts": torch.randint(3, vocab, (samples, P), generator=g), "prompt_len": plen,
        "responses": torch.randint(3, vocab, (samples, R), generator=g), "response_len": rlen,
        "response_mask": mask, "advantages": torch.randn(samples, R, generator=g) * mask,
        "rollout_log_probs": torch.zeros(samples, R),
    })
    body = ActorObjective(cfg, POLICY_LOSSES.get(a.policy_loss), 1.0)
    group = mesh.group("dp")

    longest = P + R
    size, budget = micro_batch_limits(cfg, "actor", longest)
    fsize, fbudget = micro_batch_limits(cfg, "actor", longest, forward=True)

    def update():
        run_updates(eng, batch, epochs=1, mini_size=samples, micro_size=size, pad_id=0,
                    dp_size=1, dp_group=group, objective=body, prefix="actor",
                    max_tokens=budget, packed=a.use_packing)

    def forward():
        forward_all(eng, batch, fsize, 0, "logprobs", max_tokens=fbudget, packed=a.use_packing)

    out = {"tokens": float((plen + rlen).sum()), "response_tokens": float(rlen.sum())}
    for name, fn in (("update_s", update), ("forward_s", forward)):
        fn()  # warm-up
        times, cpu = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out[name] = statistics.median(times)
        out[name.replace("_s", "_cpu_s")] = statistics.median(cpu)  # robust to other jobs on a shared machine
    return out


def cpu_bench(work_dir: str, code_dir: str, nproc: int, overrides: list[str], short: int = 4, long: int = 12) -> dict:
    """CPU seconds per step, robust to other jobs on a shared machine: the CPU time of the whole run (all ranks)
    with `long` steps minus that with `short` steps, over long - short; completion tokens of those steps
    (from metrics.jsonl) per CPU second. `code_dir` is the checkout the trainer runs (e.g. today's main)."""
    import resource

    model, data = prepare(work_dir, None)
    cpu = {}
    for steps in (short, long):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        run = launch(work_dir, model, data, nproc, steps, overrides + ["checkpoint.save_freq=-1"], code_dir, f"run{steps}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu[steps] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    from spmdrl.metrics import read_jsonl

    rows = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl"), last_per_step=True) if "timing/step_s" in r]
    samples = _samples_per_step(run)
    completion = sum(r.get("train/response_length_mean", 0.0) * samples for r in rows[short:])
    per_step = (cpu[long] - cpu[short]) / (long - short)
    b = breakdown(run, skip=short)
    return {"cpu_s_per_step": per_step, "completion_tokens_per_cpu_s": completion / (cpu[long] - cpu[short]),
            "wall_step_s": b["timing/step_s"], "wall_completion_tokens_per_s": b["completion_tokens_per_s"]}


def rollout_bench(model: str, prompts: int, n: int = 8, max_tokens: int = 32, reps: int = 4) -> dict[str, float]:
    """Median seconds of one vLLM generate (prompts x n samples x max_tokens) on this process, with one
    request per prompt (n samples) and with one seeded request per sample, alternating the two modes."""
    import time

    from spmdrl.rollout import SamplingSpec, build_engine

    eng = build_engine("vllm", model_path=model, tp_size=1, max_model_len=128, seed=0, kv_cache_gb=0.25)
    ids = [eng.tokenizer.encode(f"{i}+{i * 7}=") for i in range(prompts)]
    spec = SamplingSpec(n=n, temperature=1.0, max_tokens=max_tokens)
    eng.generate(ids, spec, list(range(prompts)))  # warm-up
    times: dict[str, list[float]] = {"n_batched_s": [], "per_request_seed_s": []}
    for rep in range(reps):
        for key, per_request in (("n_batched_s", False), ("per_request_seed_s", True)):
            eng.per_request_seed = per_request
            t0 = time.perf_counter()
            eng.generate(ids, spec, list(range(rep, rep + prompts)))
            times[key].append(time.perf_counter() - t0)
    eng.close()
    return {k: statistics.median(v) for k, v in times.items()}


if __name__ == "__main__":
    # python -m spmdrl.bench RUN_DIR [RUN_DIR ...]                      compare bench runs
    # python -m spmdrl.bench update MODEL SAMPLES RMIN RMAX [overrides]  time one actor update alone
    # python -m spmdrl.bench cpu WORK_DIR CODE_DIR NPROC [overrides]    CPU seconds per step of a checkout
    # python -m spmdrl.bench learning NAME=RUN_DIR [NAME=RUN_DIR ...]   val/accuracy per validation step, side by side
    if sys.argv[1:2] == ["learning"]:
        print(learning_table(dict(a.split("=", 1) for a in sys.argv[2:])))
    elif sys.argv[1:2] == ["cpu"]:
        work, code, nproc, *extra = sys.argv[2:]
        res = cpu_bench(work, code, int(nproc), extra)
        print(" ".join(f"{k}={v:.4f}" for k, v in res.items()), "|", code, " ".join(extra))
    elif sys.argv[1:2] == ["rollout"]:  # python -m spmdrl.bench rollout MODEL PROMPTS
        res = rollout_bench(sys.argv[2], int(sys.argv[3]))
        print(" ".join(f"{k}={v:.4f}" for k, v in res.items()))
    elif sys.argv[1:2] == ["update"]:
        model_dir, n, rmin, rmax, *extra = sys.argv[2:]
        res = update_bench(model_dir, int(n), (10, 20), (int(rmin), int(rmax)), extra)
        print(" ".join(f"{k}={v:.4f}" for k, v in res.items()), "|", " ".join(extra))
    else:
        print(compare(sys.argv[1:]))
