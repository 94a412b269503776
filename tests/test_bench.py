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
