"""Memory per phase of a short GRPO run on one GPU against `spmdrl plan` for the same config: launch/gpu_check.sh
(a random-init model of Qwen2.5-0.5B's shape, the transformers rollout engine standing in for vLLM, FSDP2 in
bf16, 2 steps), then each phase's peak allocated memory (`memory/<phase>_allocated_gb`) next to the plan's GPU
figure less its CUDA context (which torch's allocator does not see). The phase that decides whether a config
fits, train_actor, must be within 25% of the plan; every phase's pair is recorded.

GPU-only: on CPU every allocated figure is 0, and the same script's CPU form (`bash launch/gpu_check.sh OUT cpu
tiny ...`, about a minute on 2 cores) is too slow for the suite; tests/test_plan.py and test_memory.py cover
the plan's arithmetic and the phase metrics on CPU.
"""
import json
import os
import subprocess

from devices import gpu_only

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = ["data.max_response_length=64", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
       "actor.micro_batch_size=32", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false"]


def measured_vs_planned(plan: dict, rows: list[dict]) -> dict:
    """{phase: (measured GiB, planned GiB)}: the largest `memory/<phase>_allocated_gb` over the run's rows, and
    the plan's gpu_gb for that phase less its cuda_context (None where the plan has no such phase)."""
    out = {}
    for row in rows:
        for k, v in row.items():
            if k.startswith("memory/") and k.endswith("_allocated_gb"):
                phase = k[len("memory/"): -len("_allocated_gb")]
                p = plan["memory"].get(phase)
                want = None if p is None else p["gpu_gb"] - p["gpu"].get("cuda_context", 0.0)
                out[phase] = (max(v, out.get(phase, (0.0,))[0]), want)
    return out


@gpu_only
def test_phase_memory_of_a_short_grpo_run_against_the_plan(tmp_path, record_property):
    proc = subprocess.run(["bash", "launch/gpu_check.sh", str(tmp_path), "cuda", "0.5b", *RUN], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(tmp_path / "plan.json") as f:
        plan = json.load(f)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    phases = measured_vs_planned(plan, rows)
    record_property("measured_vs_planned_gib", {k: [round(m, 2), None if p is None else round(p, 2)]
                                                for k, (m, p) in sorted(phases.items())})
    got, want = phases["train_actor"]
    assert 0.75 * want <= got <= 1.25 * want, (got, want)


def test_the_comparison_reads_what_the_plan_writes(tmp_path):
    """CPU: the plan of the GPU test's own config (its phase names and fields, built in-process as `spmdrl
    plan` builds it) read by measured_vs_planned next to a metrics row of the names the trainer logs."""
    from spmdrl.config import load_config
    from spmdrl.plan import build_plan
    from spmdrl.tiny import build_tiny

    model = build_tiny(str(tmp_path / "m"))
    cfg = load_config(os.path.join(REPO, "configs/quickstart/grpo.toml"),
                      [f"model.path={model}", "trainer.device=cuda", "rollout.engine=hf", *RUN])
    plan = json.loads(json.dumps(build_plan(cfg, world_size=1)))
    rows = [{"memory/train_actor_allocated_gb": 2.0, "memory/sync_allocated_gb": 1.0},
            {"memory/train_actor_allocated_gb": 3.0}]
    got = measured_vs_planned(plan, rows)
    p = plan["memory"]["train_actor"]
    assert got["train_actor"] == (3.0, p["gpu_gb"] - p["gpu"]["cuda_context"]) and p["gpu"]["cuda_context"] > 0
    assert got["sync"][0] == 1.0 and got["sync"][1] is not None
