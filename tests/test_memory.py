"""MemoryLifecycle on CPU (sleep/offload are no-ops there; the phases and metrics still run) and the plan CLI."""
import json

import torch
from typer.testing import CliRunner

from spmdrl.cli import app
from spmdrl.loop.memory import MemoryLifecycle


class Recorder:
    """A rollout engine stand-in that records the lifecycle's calls (the order is what is under test)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake", tuple(tags or ())))


def test_phase_order_and_metrics_on_cpu():
    rollout = Recorder()
    mem = MemoryLifecycle(torch.device("cpu"), {"actor": None}, {"actor": ["optimizer"]}, rollout=rollout)
    mem.settle()
    mem.for_rollout()
    mem.for_training("actor", update=False)
    mem.for_training("actor")
    mem.for_sync()
    m = mem.step_metrics()
    assert rollout.calls == [("wake", ("weights", "kv_cache")), ("sleep", 2), ("sleep", 2), ("wake", ("weights",))]
    for phase in ("load", "rollout", "actor_forward", "train_actor", "sync"):
        assert m[f"memory/{phase}_allocated_gb"] == 0.0 and m[f"memory/{phase}_reserved_gb"] == 0.0  # CPU: 0
    assert 0 < m["memory/host_rss_gb"] == m["memory/host_rss_gb"]
    mem.for_rollout()
    assert set(mem.step_metrics()) == {"memory/sync_allocated_gb", "memory/sync_reserved_gb", "memory/rollout_allocated_gb",
                                       "memory/rollout_reserved_gb", "memory/host_rss_gb"}  # reset per step


def test_critic_warmup_keeps_rollout_weights():
    rollout = Recorder()
    mem = MemoryLifecycle(torch.device("cpu"), {}, {}, rollout=rollout)
    mem.for_training("actor", update=False, keep_rollout_weights=True)
    assert rollout.calls == [("sleep", 1)]  # no sync follows: vLLM must keep its weights (on the host)


def test_host_rss_tracks_an_allocation():
    """In a fresh interpreter: inside pytest, freed memory of earlier tests stays resident and gets reused."""
    import subprocess
    import sys

    code = ("import torch; from spmdrl.loop.memory import host_rss_bytes; b = host_rss_bytes(); "
            "x = torch.ones(64 << 20, dtype=torch.uint8); print(host_rss_bytes() - b)")
    grew = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])
    assert grew > 48 << 20  # 64 MiB allocated and touched


def test_plan_cli_table_and_json(tmp_path):
    from spmdrl.tiny import build_tiny

    model = build_tiny(str(tmp_path / "m"), seed=0)
    args = ["plan", "--config", "configs/grpo.toml", f"model.path={model}", "--world-size", "2",
            "placement.rollout_tp=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "roles:" in r.output and "weight sync per step" in r.output and "fits: true" in r.output
    p = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)
    assert p["roles"]["actor"]["dp_groups"] == [[0, 1]] and p["roles"]["rollout"]["tp_groups"] == [[0, 1]]
    assert set(p["memory"]["train_actor"]) >= {"gpu_gb", "host_gb", "gpu"}


def test_plan_without_config_json_is_one_line_error(tmp_path):
    r = CliRunner().invoke(app, ["plan", "--config", "configs/grpo.toml", f"model.path={tmp_path}"])
    assert r.exit_code == 2 and "model.path" in r.output and "config.json" in r.output
