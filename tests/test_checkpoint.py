"""CheckpointManager in one process (no process group): exact round trip, atomic commit, retention, crashes and
a full disk during a save, damaged and mismatched checkpoints, and loading without unpickling arbitrary objects."""
import errno
import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

from spmdrl import checkpoint as ck
from spmdrl.checkpoint import files as ck_files, manager as ck_manager
from spmdrl.checkpoint import CheckpointManager, config_differences, latest_checkpoint, list_checkpoints, resolve_resume
from module_engine import ModuleEngine
from spmdrl.config import Config, load_config, to_toml
from spmdrl.errors import CheckpointError
from spmdrl.rng import rng_state, seed_everything, set_rng_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = to_toml(load_config(None, ["actor.lr=0.01"]))


def make_engine(seed=0, hidden=4):
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return ModuleEngine(module=module, optimizer=opt, scheduler=sched)


def train(engine, steps, seed=123):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        engine.module(torch.randn(5, 3, generator=g)).pow(2).sum().backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        engine.scheduler.step()


def save(root, step, engine=None, keep_last=2, config=CONFIG, manager=None, **kw):
    engine = engine or make_engine()
    return (manager or CheckpointManager(str(root), keep_last=keep_last)).save(
        step, engines={"actor": engine}, trainer_state={"sampler": {"epoch": 0, "step_in_epoch": step}},
        config_toml=config, rng=rng_state(), **kw)


def load(path, engine=None, config=CONFIG):
    return CheckpointManager(os.path.dirname(path)).load(path, engines={"actor": engine or make_engine(9)}, config_toml=config)


@pytest.fixture()
def saved(tmp_path):
    eng = make_engine()
    train(eng, 3)
    return tmp_path / "ckpt", save(tmp_path / "ckpt", 3, eng), eng


@pytest.mark.quick
def test_round_trip_is_exact_and_training_continues_identically(saved):
    _, path, eng = saved
    fresh = make_engine(seed=5)
    state = load(path, fresh)
    assert state["step"] == 3 and state["sampler"]["step_in_epoch"] == 3
    for (name, a), b in zip(eng.module.state_dict().items(), fresh.module.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.scheduler.state_dict() == eng.scheduler.state_dict()
    sa, sb = eng.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)
    train(eng, 2, seed=5)
    train(fresh, 2, seed=5)
    for a, b in zip(eng.module.parameters(), fresh.module.parameters()):
        assert torch.equal(a, b)


@pytest.mark.quick
def test_rng_state_survives_json():
    import random

    import numpy as np

    seed_everything(3)
    torch.rand(3), random.random(), np.random.rand()
    back = ck.rng_from_json(json.loads(json.dumps(ck.rng_to_json(rng_state()))))
    expected = (torch.rand(4).tolist(), random.random(), np.random.rand(), random.gauss(0, 1))
    set_rng_state(back)
    assert (torch.rand(4).tolist(), random.random(), np.random.rand(), random.gauss(0, 1)) == expected


def test_retention_and_auto_resume_skip_incomplete(tmp_path):
    root = tmp_path / "out" / "checkpoints"
    run = CheckpointManager(str(root), keep_last=2)
    for step in (1, 2, 3, 4):
        save(root, step, manager=run)
    assert [s for s, _ in list_checkpoints(str(root))] == [3, 4]
    os.makedirs(root / "step_00000009" / "state")  # written by hand or half-copied: no marker
    os.makedirs(root / ".tmp-step_00000010")  # a crashed save
    assert latest_checkpoint(str(root)).endswith("step_00000004")
    cfg = Config()
    cfg.trainer.output_dir = str(tmp_path / "out")
    assert resolve_resume(cfg).endswith("step_00000004")
    cfg.checkpoint.resume = "off"
    assert resolve_resume(cfg) is None
    cfg.checkpoint.resume = str(root / "step_00000009")
    with pytest.raises(CheckpointError, match="incomplete"):
        resolve_resume(cfg)
    cfg.checkpoint.resume = str(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_resume(cfg)
    cfg.checkpoint.resume = str(tmp_path / "out")  # a run directory: its latest
    assert resolve_resume(cfg).endswith("step_00000004")
    save(root, 5, manager=run)  # the next save clears the crashed one's leftovers
    assert not os.path.exists(root / ".tmp-step_00000010")


@pytest.mark.quick
def test_retention_deletes_only_this_runs_checkpoints(tmp_path):
    """An older run left steps 7 and 8; this run's saves at 1..3 keep its own newest two and all of the other's
    (retention once sorted by step and deleted this run's just-saved checkpoints)."""
    root = tmp_path / "checkpoints"
    older = CheckpointManager(str(root), keep_last=2)
    for step in (7, 8):
        save(root, step, manager=older)
    run = CheckpointManager(str(root), keep_last=2)
    for step in (1, 2, 3):
        save(root, step, manager=run)
    assert [s for s, _ in list_checkpoints(str(root))] == [2, 3, 7, 8]
    resumed = CheckpointManager(str(root), keep_last=2)
    load(str(root / "step_00000003"))
    resumed.load(str(root / "step_00000003"), engines={"actor": make_engine()}, config_toml=CONFIG)
    save(root, 4, manager=resumed)  # a resumed run is the same run: its step 2 goes
    assert [s for s, _ in list_checkpoints(str(root))] == [3, 4, 7, 8]


def test_failure_inside_save_keeps_the_previous_checkpoint(saved, monkeypatch):
    root, prev, _ = saved
    real = ck_manager.write_json

    def failing(path, obj):
        if path.endswith("trainer.json"):  # after DCP and the RNG files are written
            raise OSError(errno.EIO, "Input/output error")
        real(path, obj)

    monkeypatch.setattr(ck_manager, "write_json", failing)
    with pytest.raises(CheckpointError, match="Input/output error.*previous checkpoint .*step_00000003 is intact"):
        save(root, 6)
    assert latest_checkpoint(str(root)) == prev
    assert sorted(os.listdir(root)) == ["step_00000003"]  # the partial one is gone
    load(prev)


def test_disk_full_during_the_sharded_write(saved, monkeypatch):
    """ENOSPC simulated by monkeypatching DCP's file writer (no size-limited tmpfs needed)."""
    import torch.distributed.checkpoint.filesystem as fs

    root, prev, _ = saved

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", full)
    with pytest.raises(CheckpointError) as info:
        save(root, 6)
    msg = str(info.value)
    assert "no space left on device" in msg and "step_00000003 is intact" in msg and "\n" not in msg
    assert latest_checkpoint(str(root)) == prev
    load(prev)


def test_a_killed_save_is_never_resumed_from(tmp_path):
    """A process that dies between writing every file and the commit (os._exit: no cleanup runs)."""
    root = tmp_path / "ckpt"
    code = f"""
import os, sys
sys.path.insert(0, {os.path.join(REPO, 'tests')!r})
from test_checkpoint import save
from spmdrl.checkpoint import manager
save({str(root)!r}, 1)
manager.commit = lambda tmp, final, marker: os._exit(17)
save({str(root)!r}, 2)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 17, proc.stderr[-2000:]
    tmp = root / ".tmp-step_00000002"
    assert (tmp / "manifest.json").exists() and (tmp / "state" / "actor" / ".metadata").exists()  # fully written, not committed
    assert latest_checkpoint(str(root)).endswith("step_00000001")
    with pytest.raises(CheckpointError, match="incomplete|no complete checkpoint"):
        ck.find_checkpoint(str(tmp))


def _rewrite_manifest(path, rel):
    m = json.load(open(os.path.join(path, "manifest.json")))
    p = os.path.join(path, rel)
    m["files"][rel] = {"size": os.path.getsize(p), "sha256": ck_files.sha256(p)}
    json.dump(m, open(os.path.join(path, "manifest.json"), "w"))


def _distcp(path):
    return "state/actor/" + next(n for n in os.listdir(os.path.join(path, "state", "actor")) if n.endswith(".distcp"))


@pytest.mark.parametrize("damage, message", [
    ("remove_shard", r"file state/actor/__0_0\.distcp is missing"),
    ("truncate_shard", r"state/actor/__0_0\.distcp has \d+ bytes, the manifest says \d+"),
    ("flip_byte", r"state/actor/__0_0\.distcp failed the checksum"),
    ("manifest_garbage", r"manifest\.json is corrupted"),
    ("no_marker", r"incomplete \(no COMPLETE marker\)"),
    ("rng_garbage_rehashed", r"RNG state is malformed"),
    ("metadata_garbage_rehashed", r"DCP metadata is corrupted"),
])
@pytest.mark.quick
def test_damaged_checkpoint_is_a_one_line_error(saved, damage, message):
    _, path, _ = saved
    shard = os.path.join(path, _distcp(path))
    if damage == "remove_shard":
        os.remove(shard)
    elif damage == "truncate_shard":
        os.truncate(shard, os.path.getsize(shard) // 2)
    elif damage == "flip_byte":
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    elif damage == "manifest_garbage":
        open(os.path.join(path, "manifest.json"), "w").write("{not json")
    elif damage == "no_marker":
        os.remove(os.path.join(path, "COMPLETE"))
    elif damage == "rng_garbage_rehashed":
        open(os.path.join(path, "rng", "rank_0.json"), "w").write('{"python": 1}')
        _rewrite_manifest(path, "rng/rank_0.json")
    elif damage == "metadata_garbage_rehashed":
        open(os.path.join(path, "state", "actor", ".metadata"), "wb").write(b"\x80\x04garbage")
        _rewrite_manifest(path, "state/actor/.metadata")
    with pytest.raises(CheckpointError, match=message) as info:
        load(path)
    assert "\n" not in str(info.value)


def test_other_model_engines_or_config_are_refused_naming_the_difference(saved):
    _, path, _ = saved
    with pytest.raises(CheckpointError, match=r"different actor model .*0\.weight: \[4, 3\] float32 in the checkpoint, \[8, 3\]"):
        load(path, make_engine(hidden=8))
    with pytest.raises(CheckpointError, match=r"holds engines \['actor'\], this run has \['actor', 'critic'\]"):
        CheckpointManager(os.path.dirname(path)).load(path, engines={"actor": make_engine(), "critic": make_engine()},
                                                      config_toml=CONFIG)
    other = to_toml(load_config(None, ["actor.lr=0.02", "data.train_batch_size=16"]))
    with pytest.raises(CheckpointError, match=r"different config: data\.train_batch_size = 8 in the checkpoint, 16 here; "
                                              r"actor\.lr = 0\.01 in the checkpoint, 0\.02 here"):
        load(path, config=other)
    longer = to_toml(load_config(None, ["actor.lr=0.01", "trainer.total_steps=50", "placement.rollout_tp=2",
                                        "checkpoint.save_freq=5", "model.path=/moved/model"]))
    load(path, config=longer)  # run length, layout, checkpointing and where the model lives may change


def test_config_differences_lists_only_what_may_not_change():
    a = {"actor": {"lr": 1.0, "micro_batch_size": 2}, "trainer": {"total_steps": 3, "seed": 0}, "logging": {"jsonl": True}}
    b = {"actor": {"lr": 1.0, "micro_batch_size": 4}, "trainer": {"total_steps": 9, "seed": 1}, "logging": {"jsonl": False},
         "new_section": {"x": 1}}
    assert config_differences(a, b) == ["trainer.seed = 0 in the checkpoint, 1 here"]


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.quick
def test_loading_never_unpickles_arbitrary_objects(saved, tmp_path, monkeypatch):
    _, path, _ = saved
    calls = []
    real_load = torch.load

    def watched(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", watched)
    load(path)
    assert calls and all(w is True for w in calls)  # tensors only through weights_only=True
    # a tampered checkpoint whose manifest was rewritten to match: DCP's .metadata carries a payload
    open(os.path.join(path, "state", "actor", ".metadata"), "wb").write(pickle.dumps(_Payload()))
    _rewrite_manifest(path, "state/actor/.metadata")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"refers to posix\.system.*refusing to unpickle"):
        load(path)
    assert not (tmp_path / "PWNED").exists()


def _ops(*parts):
    """A raw pickle from opcodes and (text) arguments: the payloads an attacker would write by hand."""
    out = b""
    for part in parts:
        if isinstance(part, str):  # SHORT_BINUNICODE
            raw = part.encode()
            out += b"\x8c" + bytes([len(raw)]) + raw
        else:
            out += part
    return out


_M = "torch.distributed.checkpoint.metadata"
_CMD = "touch PWNED"
PAYLOADS = {  # name: (pickle bytes, what the refusal names)
    # the reported hole: an allowed module, a dotted name walking to os.system (protocol 4)
    "dotted_stack_global": (_ops(b"\x80\x04", _M, "os.system", b"\x93", _CMD, b"\x85R."), r"refers to torch\.distributed\.checkpoint\.metadata\.os\.system"),
    "dotted_text_global": (b"\x80\x04c" + _M.encode() + b"\nos.system\n" + _ops(_CMD, b"\x85R."), r"metadata\.os\.system"),
    "module_attribute": (_ops(b"\x80\x04", _M, "os", b"\x93."), r"refers to torch\.distributed\.checkpoint\.metadata\.os,"),
    "allowed_module_other_name": (_ops(b"\x80\x04", "torch", "load", b"\x93", "x", b"\x85R."), r"refers to torch\.load"),
    "dotted_dtype": (_ops(b"\x80\x04", "torch", "float32.__class__", b"\x93."), r"refers to torch\.float32\.__class__"),
    "nested_reduce": (_ops(b"\x80\x04", "builtins", "getattr", b"\x93", _M, "os", b"\x86R", _CMD, b"\x85R."), r"refers to builtins\.getattr"),
    "inside_allowed_reduce": (_ops(b"\x80\x04", "torch", "Size", b"\x93", "posix", "system", b"\x93", _CMD, b"\x85R\x85R."), r"refers to posix\.system"),
    "old_style_inst": (b"(S'touch PWNED'\nios\nsystem\n.", r"opcode INST"),
    "extension_registry": (b"\x80\x02\x82\x01.", r"opcode EXT1"),
    "persistent_id": (b"\x80\x02X\x01\x00\x00\x00xQ.", r"opcode BINPERSID"),
    "build_on_an_allowed_class": (_ops(b"\x80\x04", _M, "Metadata", b"\x93N}", "__eq__", "x", b"s\x86b."), r"sets attributes of the class Metadata"),
}


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_crafted_metadata_is_refused_on_resume_and_export(saved, tmp_path, monkeypatch, name):
    from typer.testing import CliRunner

    from spmdrl.cli import app

    data, message = PAYLOADS[name]
    _, path, _ = saved
    open(os.path.join(path, "state", "actor", ".metadata"), "wb").write(data)
    _rewrite_manifest(path, "state/actor/.metadata")  # whoever can write the file can update size and sha256
    os.makedirs(os.path.join(path, "hf"), exist_ok=True)
    open(os.path.join(path, "hf", "config.json"), "w").write("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=message):  # resume
        load(path)
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(path), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert re.search(message, result.output) and "refusing to unpickle" in result.output, result.output
    assert not (tmp_path / "PWNED").exists()


def test_the_payloads_do_run_code_under_the_standard_unpickler(tmp_path, monkeypatch):
    """The reference: plain pickle runs these payloads' command, so refusing them closes a real hole."""
    monkeypatch.chdir(tmp_path)
    for name in ("dotted_stack_global", "dotted_text_global", "inside_allowed_reduce", "old_style_inst"):
        try:
            pickle.loads(PAYLOADS[name][0])
        except TypeError:  # torch.Size(0) after the command ran
            pass
        assert (tmp_path / "PWNED").exists(), name
        os.remove(tmp_path / "PWNED")


def test_export_of_bad_input_is_a_one_line_cli_error(saved, tmp_path):
    from typer.testing import CliRunner

    from spmdrl.cli import app

    _, path, _ = saved
    for target, message in ((tmp_path / "empty", "no complete checkpoint there"),
                            (path, "hf/config.json is missing; it cannot be exported")):
        os.makedirs(target, exist_ok=True)
        result = CliRunner().invoke(app, ["export", "--checkpoint", str(target), "--out", str(tmp_path / "x")])
        assert result.exit_code == 2 and message in result.output, result.output
        assert result.output.startswith("error: checkpoint") and result.output.count("\n") == 1


def test_auto_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, caplog):
    import logging

    root = tmp_path / "out" / "checkpoints"
    run = CheckpointManager(str(root), keep_last=0)
    for step in (1, 2, 3):
        save(root, step, manager=run)
    step3, step2 = root / "step_00000003", root / "step_00000002"
    os.truncate(os.path.join(step3, _distcp(step3)), 10)  # the newest is truncated
    cfg = Config()
    cfg.trainer.output_dir = str(tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="spmdrl"):
        assert resolve_resume(cfg) == str(step2)
    assert f"skipping damaged checkpoint {step3}" in caplog.text and "has 10 bytes" in caplog.text
    shard = os.path.join(step2, _distcp(step2))  # the next one is corrupted in place: only its checksum tells
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    state = CheckpointManager(str(root), fallback=True).load(str(step2), engines={"actor": make_engine(9)},
                                                             config_toml=CONFIG)
    assert state["step"] == 1 and state["path"] == str(root / "step_00000001")
    assert "failed the checksum" in caplog.text and "resuming from" in caplog.text
    with pytest.raises(CheckpointError, match=r"step_00000002: state/actor/__0_0\.distcp failed the checksum"):
        load(str(step2))  # an explicit path: no fallback


def test_engines_are_saved_and_loaded_one_at_a_time(tmp_path):
    """Each engine's state is read (saved) and filled (loaded) inside its own checkpoint_access, never while
    another engine's is open: what lets a GPU run bring back one engine's parked state at a time."""
    import contextlib

    open_now, seen = [], []

    def tracked(name, seed):
        e = make_engine(seed)

        @contextlib.contextmanager
        def access():
            assert not open_now, f"{name} opened while {open_now} is open"
            open_now.append(name)
            try:
                yield
            finally:
                open_now.remove(name)

        def state():
            assert open_now == [name]
            seen.append(name)
            return ModuleEngine.checkpoint_state(e)

        e.checkpoint_access, e.checkpoint_state = access, state
        return e

    engines = {"actor": tracked("actor", 1), "critic": tracked("critic", 2)}
    path = CheckpointManager(str(tmp_path)).save(1, engines=engines, trainer_state={}, config_toml=CONFIG)
    assert seen == ["actor", "critic"] and sorted(os.listdir(os.path.join(path, "state"))) == ["actor", "critic"]
    fresh = {"actor": tracked("actor", 8), "critic": tracked("critic", 9)}
    seen.clear()
    CheckpointManager(str(tmp_path)).load(path, engines=fresh, config_toml=CONFIG)
    assert seen == ["actor", "critic"]
    for n in engines:
        for a, b in zip(engines[n].module.parameters(), fresh[n].module.parameters()):
            assert torch.equal(a, b)


def test_a_checkpoint_with_one_dcp_directory_for_all_engines_still_loads(saved):
    """Checkpoints written before each engine had its own DCP directory (state/ holds every engine) load."""
    _, path, engine = saved
    actor = os.path.join(path, "state", "actor")
    for name in os.listdir(actor):
        os.rename(os.path.join(actor, name), os.path.join(path, "state", name))
    os.rmdir(actor)
    m = json.load(open(os.path.join(path, "manifest.json")))
    m["files"] = {k.replace("state/actor/", "state/"): v for k, v in m["files"].items()}
    json.dump(m, open(os.path.join(path, "manifest.json"), "w"))
    fresh = make_engine(9)
    load(path, engine=fresh)
    for a, b in zip(engine.module.parameters(), fresh.module.parameters()):
        assert torch.equal(a, b)
