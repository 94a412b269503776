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
    assert m["memory/host_rss_gb"] > 0
    mem.for_rollout()
    assert set(mem.step_metrics()) == {"memory/sync_allocated_gb", "memory/sync_reserved_gb", "memory/rollout_allocated_gb",
                                       "memory/rollout_reserved_gb", "memory/host_rss_gb"}  # reset per step


class EngineRecorder:
    """A training engine stand-in: records offload / onload calls into a shared event list."""

    def __init__(self, role, events):
        self.role, self.events = role, events

    def offload(self, kinds):
        self.events.append(("offload", self.role, tuple(kinds)))

    def onload(self, kinds):
        self.events.append(("onload", self.role, tuple(kinds)))


def test_each_engine_is_parked_as_soon_as_it_is_built():
    """build: an engine's configured kinds go to host memory before the next engine is built (the build peak is
    one engine's full state), then settle() before vLLM; a role without configured kinds is left alone."""
    events = []
    mem = MemoryLifecycle(torch.device("cpu"), {}, {"actor": ["params", "optimizer"], "ref": [], "critic": ["grads"]})
    mem.begin_build()
    for role in ("actor", "ref", "critic"):
        events.append(("built", role))
        mem.adopt(role, EngineRecorder(role, events))
    mem.settle()
    assert events == [("built", "actor"), ("offload", "actor", ("params", "optimizer")), ("built", "ref"),
                      ("built", "critic"), ("offload", "critic", ("grads",)),
                      ("offload", "actor", ("params", "optimizer")), ("offload", "critic", ("grads",))]
    assert {"memory/build_allocated_gb", "memory/load_allocated_gb"} <= set(mem.step_metrics())


def test_checkpoint_phases_put_vllm_to_sleep_and_park_every_role():
    events, rollout = [], Recorder()
    mem = MemoryLifecycle(torch.device("cpu"), {"actor": EngineRecorder("actor", events)}, {"actor": ["optimizer"]},
                          rollout=rollout)
    mem.for_checkpoint("checkpoint_save", keep_rollout_weights=True)  # the synced weights stay (on the host)
    mem.for_checkpoint("resume", keep_rollout_weights=False)  # a weight sync follows the load
    assert rollout.calls == [("sleep", 1), ("sleep", 2)]
    assert events == [("offload", "actor", ("optimizer",))] * 2
    assert {"memory/checkpoint_save_allocated_gb", "memory/resume_allocated_gb"} <= set(mem.step_metrics())
    split_rollout = Recorder()  # split placement's rollout ranks: vLLM has the device to itself, it stays awake
    MemoryLifecycle(torch.device("cpu"), {}, {}, rollout=split_rollout).for_checkpoint("checkpoint_save", True)
    assert split_rollout.calls == []


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


def test_component_figures_are_the_engines_tensor_bytes_and_match_the_plan(tmp_path):
    """memory.report_components: each phase reports what each engine holds (params / grads / optimizer), as real
    tensor bytes on CPU too. Against two references: the HF model's own parameter count (4 bytes each in float32;
    AdamW's two moments per parameter after a step), and `spmdrl plan`'s components for the same config."""
    from launching import world_of_one
    from transformers import AutoModelForCausalLM

    from spmdrl.config import load_config
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines.fsdp import FSDPEngine
    from spmdrl.engines.token_batch import pack_sequences
    from spmdrl.plan import build_plan
    from spmdrl.tiny import build_tiny

    model = build_tiny(str(tmp_path / "m"), num_layers=2)
    cfg = load_config(None, [f"model.path={model}", "trainer.device=cpu", "memory.report_components=true"])
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
    with world_of_one():
        mesh = RoleMeshes(plan_layout(cfg.placement, 1), 0, "cpu")["actor"]
        eng = FSDPEngine(model, mesh, torch.device("cpu"), trainable=True)
        mem = MemoryLifecycle(torch.device("cpu"), {}, {"actor": ["optimizer"]}, components=True)
        mem.begin_build()
        mem.adopt("actor", eng)
        assert eng.resident_bytes() == {"params": 4 * n, "grads": 0, "optimizer": 0}
        mem.for_training("actor")
        tb = pack_sequences([torch.tensor([5, 6, 7])], [torch.tensor([8, 9])], 0)
        eng.train_step([tb], lambda mb, e: (-(e.logprobs(mb)[0] * mb.resp_mask).sum(), {}))
        m = mem.step_metrics()
    gib = 2**30
    assert m["memory/train_actor/actor_params_gb"] * gib == 4 * n
    assert m["memory/train_actor/actor_optimizer_gb"] * gib == 2 * 4 * n
    assert m["memory/train_actor/actor_grads_gb"] == 0  # FSDP2 frees gradients at the end of train_step
    assert "memory/train_actor/transient_gb" not in m  # CPU: no allocator peak to take it from
    planned = build_plan(cfg, world_size=1)["memory"]["train_actor"]["gpu_bytes"]
    assert planned["actor_params"] == 4 * n and planned["actor_optimizer"] == 2 * 4 * n
