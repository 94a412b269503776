"""spmdrl.bench's reading of a run: completion tokens/s from the response length and the config's batch shape."""
import json

import pytest

from spmdrl.bench import breakdown, compare

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def test_breakdown_counts_completion_tokens(tmp_path):
    (tmp_path / "config.toml").write_text("[data]\ntrain_batch_size = 4\n[rollout]\nn = 8\n")
    steps = [(2.0, 30.0), (2.0, 30.0), (1.0, 20.0), (2.0, 32.0), (4.0, 16.0)]  # (step_s, response_length_mean)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i, (s, r) in enumerate(steps, 1):
            f.write(json.dumps({"step": i, "timing/step_s": s, "timing/rollout_s": s / 4, "timing/update_actor_s": s / 2,
                                "train/response_length_mean": r, "perf/tokens_per_s": 1.0}) + "\n")
    b = breakdown(str(tmp_path), skip=2)
    per_step = sorted(r * 32 / s for s, r in steps[2:])  # 32 samples per step
    assert b["completion_tokens_per_s"] == per_step[1]
    assert b["best_completion_tokens_per_s"] == per_step[-1] and b["min_step_s"] == 1.0
    assert abs(b["overhead_s"] - 0.5) < 1e-12  # median of step - rollout - update: 0.25, 0.5, 1.0
    table = compare([str(tmp_path)], skip=2)
    assert "compl tok/s" in table and f"{per_step[1]:.4f}" in table


def test_placement_setups_are_valid_on_the_same_world():
    import os

    from spmdrl.bench import placements
    from spmdrl.config import load_config, validate

    repo_cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart", "grpo.toml")
    for nproc in (2, 4):
        setups = placements(nproc)
        assert list(setups) == ["colocated", "split_s0", "split_s1"]
        for name, extra in setups.items():
            layout = validate(load_config(repo_cfg, ["actor.micro_batch_size=32", *extra]), nproc)
            rollout, actor = set(layout["rollout"].ranks), set(layout["actor"].ranks)
            assert (rollout == actor == set(range(nproc))) if name == "colocated" else (
                rollout == set(range(nproc // 2)) and actor == set(range(nproc // 2, nproc)))


def test_lora_sync_setups():
    from spmdrl.bench import lora_syncs

    assert lora_syncs([]) == {"adapter": ["lora.enable=true", "lora.rank=8", "rollout.lora_sync=adapter"],
                              "merge": ["lora.enable=true", "lora.rank=8", "rollout.lora_sync=merge"]}
    assert lora_syncs(["lora.rank=16"])["merge"] == ["lora.enable=true", "rollout.lora_sync=merge"]


def test_tool_breakdown_reads_the_turn_loop_split(tmp_path):
    from spmdrl.bench import format_tool_breakdown, tool_breakdown

    (tmp_path / "config.toml").write_text("[data]\ntrain_batch_size = 2\n[rollout]\nn = 4\n")
    # (generation, tools, loop other, idle, model tokens per trajectory); step 1 is warm-up
    steps = [(9.0, 9.0, 9.0, 9.0, 50.0), (1.0, 0.2, 0.3, 0.5, 100.0), (2.0, 0.4, 0.6, 1.0, 120.0),
             (3.0, 0.3, 0.7, 0.0, 90.0)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i, (g, t, o, idle, tok) in enumerate(steps, 1):
            f.write(json.dumps({"step": i, "timing/step_s": 10.0, "timing/rollout_s": 7.0,
                                "timing/turn_generate_s": g, "timing/turn_tools_s": t, "timing/turn_other_s": o,
                                "timing/turn_idle_s": idle, "multi_turn/loop_turns": 2.0,
                                "multi_turn/turns_mean": 1.5 + i / 10, "multi_turn/turns_max": 2.0,
                                "multi_turn/model_tokens_mean": tok, "multi_turn/tool_tokens_mean": 20.0,
                                "tools/calls": 7.0, "tools/calls/calculator": 6.0}) + "\n")
    b = tool_breakdown(str(tmp_path), skip=1)
    assert (b["generation"], b["tools"], b["idle"]) == (2.0, 0.3, 0.5)
    # the loop's wall time per step is the sum of its parts (2, 4, 4); fractions per step, then the median
    assert b["loop_wall"] == 4.0
    assert abs(b["idle_frac"] - 0.25) < 1e-12 and abs(b["generation_frac"] - 0.5) < 1e-12  # idle .25 .25 0
    assert b["turns_mean"] == 1.8 and b["tool_calls"] == 7.0 and b["samples"] == 8.0
    # model tokens over the loop's wall time: 100*8/2, 120*8/4, 90*8/4 -> median 240
    assert abs(b["model_tokens_per_s"] - 240.0) < 1e-9
    text = format_tool_breakdown(b, 2)
    assert "generation" in text and "idle" in text and "model tokens/s: 240" in text


def _async_run(path, steps):
    """A run directory with a handmade metrics.jsonl: steps = [(step_s, trained tokens, rollout busy, train busy,
    version lag, response length mean, at-max share)]."""
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for i, (s, tok, rb, tb, lag, length, clip) in enumerate(steps, 1):
            f.write(json.dumps({"step": i, "timing/step_s": s, "perf/trained_tokens_per_s": tok / s,
                                "perf/rollout_busy": rb, "perf/train_busy": tb, "rollout/version_lag_mean": lag,
                                "train/response_length_mean": length, "train/response_clip_ratio": clip}) + "\n")
    return str(path)


def test_async_window_measures_every_mode_over_the_same_trained_tokens(tmp_path):
    from spmdrl.bench import async_table, measured, trained_steps, window
    from spmdrl.errors import SpmdrlError

    warm = (50.0, 10.0, 0.5, 0.5, 0.0, 1.0, 0.0)  # warm-up and drain steps: never measured
    # mode x: 100 tokens a step in 2 s; mode y: 300 tokens in 3 s, then 200 in 4 s
    x = trained_steps(_async_run(tmp_path / "x", [warm, *[(2.0, 100.0, 0.5, 1.0, 1.0, 25.0, 0.0)] * 4, warm]))
    y = trained_steps(_async_run(tmp_path / "y", [warm, (3.0, 300.0, 1.0, 0.5, 2.0, 30.0, 0.1),
                                                  (4.0, 200.0, 0.5, 0.5, 0.0, 20.0, 0.3), warm]))
    assert abs(x[1]["tokens"] - 100.0) < 1e-9 and [r["step"] for r in measured(x, 1, 1)] == [2, 3, 4, 5]
    mx, my = measured(x, 1, 1), measured(y, 1, 1)
    # the budget, 400 tokens (x's total, the smaller): x over its 4 steps (8 s); y over its first step and half
    # its second (100 of its 200 tokens): 3 + 2 = 5 s
    wx, wy = window(mx, 400.0), window(my, 400.0)
    assert abs(wx["seconds"] - 8.0) < 1e-9 and abs(wx["tokens_per_s"] - 50.0) < 1e-9 and wx["steps"] == 4.0
    assert abs(wy["seconds"] - 5.0) < 1e-9 and abs(wy["tokens_per_s"] - 80.0) < 1e-9 and abs(wy["steps"] - 1.5) < 1e-9
    # time-weighted busy: (3 * 1.0 + 2 * 0.5) / 5; token-weighted lag: (300 * 2 + 100 * 0) / 400; per-sample
    # length and at-max share: (1 * 30 + 0.5 * 20) / 1.5 and (1 * 0.1 + 0.5 * 0.3) / 1.5
    assert abs(wy["rollout_busy"] - 80.0) < 1e-9 and abs(wy["train_busy"] - 50.0) < 1e-9
    assert abs(wy["lag"] - 1.5) < 1e-9
    assert abs(wy["length"] - 40.0 / 1.5) < 1e-9 and abs(wy["clip"] - 100 * 0.25 / 1.5) < 1e-9
    # a budget inside the first step: a fraction of it
    w = window(my, 150.0)
    assert abs(w["seconds"] - 1.5) < 1e-9 and abs(w["steps"] - 0.5) < 1e-9
    with pytest.raises(SpmdrlError, match="more --steps"):
        window(mx, 401.0)
    table = async_table({"a colocated": x, "d colocated partial": y}, warmup=1, tail=1)
    assert "each mode over 400 trained tokens" in table and "d / a: 1.60x (target >= 1.2x)" in table
    assert "c / b" not in table  # a mode not run has no ratio line
    table = async_table({"b split k=1": x, "b split k=1 (base)": y}, warmup=1, tail=1, tokens=300.0)
    assert "each mode over 300 trained tokens" in table and "b split k=1 / its baseline: 0.50x" in table


def test_learning_table_lines_up_validation_steps(tmp_path):
    from spmdrl.bench import learning_table
    from spmdrl.errors import SpmdrlError

    for name, vals in (("sync", {0: 0.5, 10: 0.7, 20: 0.8}), ("async", {0: 0.5, 10: 0.65, 20: 0.78})):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for step in range(21):
                f.write(json.dumps({"step": step, "train/reward_mean": 0.1,
                                    **({"val/accuracy": vals[step]} if step in vals else {})}) + "\n")
    table = learning_table({"sync": str(tmp_path / "sync"), "async": str(tmp_path / "async")})
    assert table.splitlines()[0] == "| step | sync | async |"
    assert "| 10 | 0.700 | 0.650 |" in table and table.splitlines()[-1] == "| last - sync | +0.000 | -0.020 |"
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(SpmdrlError, match="test_freq"):
        learning_table({"none": str(tmp_path / "none")})


def test_async_setups_are_valid_on_the_long_tail_workload():
    import os

    from spmdrl.bench import LONG_TAIL, async_modes
    from spmdrl.config import load_config, validate

    repo_cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart", "grpo.toml")
    for nproc in (2, 4):
        for name, extra in async_modes(nproc).items():
            validate(load_config(repo_cfg, [*LONG_TAIL, *extra]), nproc)
