"""The last mile of reliability (docs/reliability.md, "Cases and what they do now"): each case a user or an
adversary hit, reproduced, with the behaviour it has now: one line naming the file, key, row or rank, exit code
2 for user errors (not for external kills), and nothing lost."""
import json
import os
import pickle
import shutil

import pytest
import torch

from module_engine import ModuleEngine
from spmdrl.checkpoint import CheckpointManager
from spmdrl.checkpoint import files as ck_files
from spmdrl.config import Config, load_config, to_toml, validate
from spmdrl.errors import CheckpointError, ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))


def cli(*args):
    from typer.testing import CliRunner

    from spmdrl.cli import app

    return CliRunner().invoke(app, list(args))


def one_line_error(result, *needles):
    out = result.output
    assert result.exit_code == 2, out
    assert out.startswith("error: ") and out.count("\n") == 1, out
    for n in needles:
        assert n in out, out
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from spmdrl.tiny import build_tiny

    return build_tiny(str(tmp_path_factory.mktemp("tiny") / "model"), seed=0)


@pytest.fixture(scope="module")
def exportable(tiny, tmp_path_factory):
    """A checkpoint of the tiny HF model (hf/ included), as `spmdrl export` reads it; and the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # differs from the model at `tiny`: the export must carry it
    eng = ModuleEngine(module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))

    def hf_files(d):
        os.makedirs(d)
        for f in os.listdir(tiny):
            if not f.endswith(".safetensors"):
                shutil.copy(os.path.join(tiny, f), d)

    root = tmp_path_factory.mktemp("ckpt")
    path = CheckpointManager(str(root)).save(1, engines={"actor": eng}, trainer_state={},
                                             config_toml=to_toml(load_config(None, [])), hf_files=hf_files)
    return path, model


def copy_of(path, tmp_path):
    dst = str(tmp_path / "ckpt" / os.path.basename(path))
    shutil.copytree(path, dst)
    return dst


def rehash(path, rel):
    """Rewrite the manifest's size and checksum of `rel`: an edit that the checksums do not catch."""
    m = json.load(open(os.path.join(path, "manifest.json")))
    p = os.path.join(path, rel)
    m["files"][rel] = {"size": os.path.getsize(p), "sha256": ck_files.sha256(p)}
    json.dump(m, open(os.path.join(path, "manifest.json"), "w"))


# ---- export ----------------------------------------------------------------------------------------------

def test_export_refuses_a_non_empty_target_and_writes_atomically(exportable, tmp_path):
    """An older model.safetensors in --out once stayed beside the new shards and from_pretrained loaded it."""
    from safetensors.torch import load_file, save_file

    path, model = exportable
    out = tmp_path / "exported"
    out.mkdir()
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(out / "model.safetensors"))
    before = (out / "model.safetensors").read_bytes()
    one_line_error(cli("export", "--checkpoint", path, "--out", str(out)),
                   f"export --out {out}: the directory is not empty (it holds model.safetensors)")
    assert (out / "model.safetensors").read_bytes() == before and sorted(os.listdir(out)) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["exported"]  # no staging directory left behind

    (out / "model.safetensors").unlink()  # an empty directory is fine: it is replaced by the finished export
    assert cli("export", "--checkpoint", path, "--out", str(out)).exit_code == 0
    assert sorted(os.listdir(tmp_path)) == ["exported"]
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    torch.testing.assert_close(back.lm_head.weight, model.lm_head.weight, atol=0, rtol=0)
    shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert shards and all(set(load_file(str(out / f))) for f in shards)


def test_export_to_an_existing_file_is_one_line(exportable, tmp_path):
    target = tmp_path / "model.bin"
    target.write_text("x")
    one_line_error(cli("export", "--checkpoint", exportable[0], "--out", str(target)),
                   f"export --out {target}: it is a file, not a directory")
    assert target.read_text() == "x"


def _hf_garbage(p):
    open(f"{p}/hf/config.json", "w").write("{not json")
    rehash(p, "hf/config.json")


def _hf_unknown_type(p):
    c = json.load(open(f"{p}/hf/config.json"))
    c["model_type"] = "no_such_model"
    json.dump(c, open(f"{p}/hf/config.json", "w"))
    rehash(p, "hf/config.json")


def _hf_bad_field(p):
    c = json.load(open(f"{p}/hf/config.json"))
    c["hidden_size"] = "wide"
    json.dump(c, open(f"{p}/hf/config.json", "w"))
    rehash(p, "hf/config.json")


def _metadata_not_dcp(p):
    open(f"{p}/state/actor/.metadata", "wb").write(pickle.dumps({"a": 1}))
    rehash(p, "state/actor/.metadata")


def _manifest(edit):
    def damage(p):
        m = json.load(open(f"{p}/manifest.json"))
        edit(m)
        json.dump(m, open(f"{p}/manifest.json", "w"))
    return damage


EDITS = {
    "hf_config_not_json": (_hf_garbage, "hf/config.json does not load as a model config (OSError"),
    "hf_config_unknown_model_type": (_hf_unknown_type, "hf/config.json does not load as a model config (ValueError"),
    "hf_config_bad_field": (_hf_bad_field, "hf/config.json does not load as a model config"),
    "dcp_metadata_not_metadata": (_metadata_not_dcp, "DCP metadata is corrupted (it holds a dict, not DCP's Metadata)"),
    "manifest_params_not_a_list": (_manifest(lambda m: m["engines"]["actor"].update(params="x")),
                                   "manifest.json is malformed (engines['actor'] needs a 'params' list)"),
    "manifest_param_entry": (_manifest(lambda m: m["engines"]["actor"]["params"].__setitem__(0, [1])),
                             "manifest.json is malformed (engines['actor'].params holds [1], not [name, shape, dtype])"),
    "manifest_file_entry": (_manifest(lambda m: m["files"].__setitem__("trainer.json", "x")),
                            "manifest.json is malformed (files['trainer.json'] needs an integer 'size'"),
    "manifest_engine_not_a_dict": (_manifest(lambda m: m["engines"].__setitem__("actor", 5)),
                                   "manifest.json is malformed (engines['actor'] needs a 'params' list)"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_edited_checkpoint_with_rewritten_checksums_is_one_line(exportable, tmp_path, name):
    """Once raw tracebacks (ValueError, AttributeError, TypeError ...) from export and resume."""
    damage, message = EDITS[name]
    path = copy_of(exportable[0], tmp_path)
    damage(path)
    one_line_error(cli("export", "--checkpoint", path, "--out", str(tmp_path / "out")), f"checkpoint {path}", message)
    assert not (tmp_path / "out").exists()
    if not name.startswith("hf_"):  # resume reads the same files (hf/ is only for export)
        model = exportable[1]
        eng = ModuleEngine(module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")) as e:
            CheckpointManager(os.path.dirname(path)).load(path, engines={"actor": eng})
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("how", ["appended", "truncated"])
def test_a_shard_that_grew_or_shrank_fails_the_intact_check(exportable, tmp_path, how):
    from spmdrl.checkpoint.verify import intact

    path = copy_of(exportable[0], tmp_path)
    shard = os.path.join(path, "state", "actor", "__0_0.distcp")
    size = os.path.getsize(shard)
    if how == "appended":
        with open(shard, "ab") as f:
            f.write(b"\0\0")
    else:
        os.truncate(shard, size - 2)
    why = intact(path)
    want = "grown: bytes were appended" if how == "appended" else "truncated"
    assert why and f"state/actor/__0_0.distcp has {size + (2 if how == 'appended' else -2)} bytes, the manifest says {size} ({want}" in why


# ---- rollout correction --------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, shown", [
    ({"rollout_rs": "token", "rollout_rs_threshold": 0.5}, "[1 / 0.5, 0.5] = [2, 0.5]"),
    ({"rollout_rs": "sequence", "rollout_rs_threshold": 0.5, "rollout_rs_threshold_lower": 0.1}, "[0.1, 0.5]"),
    ({"rollout_rs": "geometric", "rollout_rs_threshold": 3.0, "rollout_rs_threshold_lower": 1.5}, "[1.5, 3]"),
])
def test_a_rejection_window_without_ratio_1_is_refused(overrides, shown):
    cfg = Config()
    cfg.model.path, cfg.data.train_files = "m", ["t.parquet"]
    for k, v in overrides.items():
        setattr(cfg.rollout_correction, k, v)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1)
    assert str(e.value).startswith(f"rollout_correction: the rejection window {shown} ") and "\n" not in str(e.value)
    assert "does not contain ratio 1" in str(e.value)


def test_a_step_whose_tokens_are_all_rejected_is_a_bad_step(caplog):
    """A window that holds 1 can still reject everything (a large mismatch): the step trains nothing, so it is
    warned about, counted as a bad step (not checkpointed) and max_bad_steps of them in a row stop the run."""
    from spmdrl.batch import Batch
    from spmdrl.errors import SpmdrlError
    from spmdrl.loop.correction import correct_rollout
    from spmdrl.loop.run_state import BadSteps

    cfg = Config()
    cfg.rollout_correction.rollout_rs, cfg.rollout_correction.rollout_rs_threshold = "token", 1.5
    mask = torch.ones(2, 3)
    roll = torch.full((2, 3), -1.0)
    batch = Batch({"old_log_probs": torch.full((2, 3), -3.0), "rollout_log_probs": roll, "response_mask": mask}, {})
    ident = lambda t: t  # noqa: E731
    with caplog.at_level("WARNING", logger="spmdrl"):
        out, metrics = correct_rollout(cfg, None, batch, None, ident, ident)
    assert out["response_mask"].sum() == 0 and metrics["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert "rollout_correction rejected every response token of this step" in caplog.text
    bad = BadSteps(2, "/nonexistent")
    assert bad.count(dict(metrics)) and bad.count(dict(metrics))
    with pytest.raises(SpmdrlError, match=r"2 consecutive steps \(up to step 4\) trained nothing .*every token "
                                          r"rejected by \[rollout_correction\]"):
        bad.check(4)
    half = dict(metrics, **{"rollout_corr/rollout_rs_masked_fraction": 0.5})
    assert not bad.count(half)


# ---- launch-only flags ---------------------------------------------------------------------------------

def test_overwrite_is_not_part_of_what_a_checkpoint_pins():
    """A run started with trainer.overwrite=true once could not be resumed without repeating the flag."""
    from spmdrl.checkpoint import config_differences
    import tomllib

    first = tomllib.loads(to_toml(load_config(None, ["trainer.overwrite=true"])))
    again = tomllib.loads(to_toml(load_config(None, [])))
    assert config_differences(first, again) == []
    assert config_differences(first, tomllib.loads(to_toml(load_config(None, ["actor.lr=0.5"]))))


# ---- bad model and data files, before launch -------------------------------------------------------------

GRPO = os.path.join(os.path.dirname(HERE), "configs", "grpo.toml")


def dry(model, out, *overrides, nproc=2):
    return cli("train", "--config", GRPO, "--dry-run", "--nproc", str(nproc), f"model.path={model}",
               f"trainer.output_dir={out}", "data.max_prompt_length=256", "data.max_response_length=256", *overrides)


def model_copy(tiny, tmp_path, skip=()):
    d = tmp_path / "model"
    shutil.copytree(tiny, d, ignore=shutil.ignore_patterns(*skip))
    return d


def test_a_truncated_safetensors_file_is_named_before_launch(tiny, tmp_path):
    """Once a raw safetensors traceback from every rank that never named the file."""
    from spmdrl.models.checkpoint import safetensors_problem

    d = model_copy(tiny, tmp_path)
    size = os.path.getsize(d / "model.safetensors")
    assert safetensors_problem(str(d / "model.safetensors")) is None
    os.truncate(d / "model.safetensors", size - 1000)
    one_line_error(dry(d, tmp_path / "run"), f"model.path = '{d}': weights file model.safetensors is {size - 1000} bytes, "
                   f"its header says {size} (truncated); download or copy the model again")
    with open(d / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 8)  # a header length past the end of the file
    one_line_error(dry(d, tmp_path / "run"), "weights file model.safetensors is", "too short for its header")


def test_a_model_directory_without_tokenizer_files_is_named_as_such(tiny, tmp_path):
    """Once blamed on a missing chat template (transformers loads a one-token tokenizer from config.json)."""
    d = model_copy(tiny, tmp_path, skip=("tokenizer*", "chat_template*", "vocab*", "merges*"))
    one_line_error(dry(d, tmp_path / "run"), f"model.path = '{d}' has no tokenizer files (none of tokenizer.json",
                   "set model.tokenizer_path")
    assert dry(d, tmp_path / "run", f"model.tokenizer_path={tiny}").exit_code == 0


def test_invalid_utf8_in_a_jsonl_prompt_file_names_the_file_and_row(tiny, tmp_path):
    """Once a UnicodeDecodeError traceback from every rank, without the file."""
    from transformers import AutoTokenizer

    from spmdrl.data.prompts import PromptDataset
    from spmdrl.errors import DataError

    rows = [json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "arith",
                        "reward_model": {"ground_truth": "1"}}).encode() for i in range(5)]
    rows[3] = rows[3].replace(b"q3", b"q\xff3")
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    with pytest.raises(DataError) as e:
        PromptDataset([str(path)], AutoTokenizer.from_pretrained(tiny), max_prompt_length=64)
    offset = sum(len(r) + 1 for r in rows[:3]) + rows[3].index(b"\xff")
    assert str(e.value) == (f"file {path}: row 4 (byte {offset}) is not valid UTF-8 (invalid start byte: b'\\xff'); "
                            "fix or re-encode the file as UTF-8")


# ---- config values ---------------------------------------------------------------------------------------

def test_a_quoted_string_for_a_list_key_is_one_item_without_quotes():
    """`data.train_files="x.parquet"` once became the list ['"x.parquet"'] (quotes inside)."""
    assert load_config(None, ['data.train_files="x.parquet"']).data.train_files == ["x.parquet"]
    assert load_config(None, ["data.train_files=x.parquet"]).data.train_files == ["x.parquet"]
    assert load_config(None, ["rollout.stop=0"]).rollout.stop == ["0"]


def test_a_string_for_a_list_key_in_a_file_says_how_to_write_it(tmp_path):
    (tmp_path / "c.toml").write_text('[data]\ntrain_files = "a.parquet"\n')
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "c.toml"), [])
    assert str(e.value) == (f"{tmp_path / 'c.toml'}: key 'data.train_files' expects list[str], found 'a.parquet' (str); "
                            'write a list, e.g. data.train_files = ["a.parquet"]')


def test_offload_kinds_the_reference_model_does_not_have_are_refused():
    cfg = load_config(None, ["model.path=m", 'data.train_files=["t.parquet"]', 'memory.ref_offload=["params", "optimizer"]'])
    with pytest.raises(ConfigError, match=r"^memory\.ref_offload has \['optimizer'\]: the ref model has no "
                                          r"gradients or optimizer state, only 'params' applies"):
        validate(cfg, world_size=1)


# ---- resume, refused before launch ----------------------------------------------------------------------

def run_config(tiny, out, *overrides):
    return load_config(GRPO, [f"model.path={tiny}", f"trainer.output_dir={out}", "data.max_prompt_length=256",
                              "data.max_response_length=256", "trainer.total_steps=10", *overrides])


def save_run(exportable, cfg, steps=(1,), world_size=None):
    """Checkpoints of `cfg`'s run under its output_dir (the tiny model's weights; its config recorded)."""
    _, model = exportable
    eng = ModuleEngine(module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    man = CheckpointManager(os.path.join(cfg.trainer.output_dir, "checkpoints"), keep_last=0)
    paths = []
    for step in steps:
        paths.append(man.save(step, engines={"actor": eng}, trainer_state={}, config_toml=to_toml(cfg),
                              hf_files=lambda d: model.config.save_pretrained(d)))
        if world_size:
            m = json.load(open(os.path.join(paths[-1], "manifest.json")))
            m["world_size"] = world_size
            json.dump(m, open(os.path.join(paths[-1], "manifest.json"), "w"))
    return paths


def test_a_manifest_edited_to_a_later_step_is_not_nothing_to_train(tiny, exportable, tmp_path, caplog):
    """Once: the run exited 0 with 'nothing to train'. Now the step is cross-checked against the directory name
    and trainer.json: auto falls back to the previous checkpoint, an explicit path is one line."""
    from spmdrl.preflight import preflight

    cfg = run_config(tiny, tmp_path / "run")
    one, two = save_run(exportable, cfg, steps=(1, 2))
    m = json.load(open(os.path.join(two, "manifest.json")))
    m["step"] = 99
    json.dump(m, open(os.path.join(two, "manifest.json"), "w"))
    with caplog.at_level("WARNING", logger="spmdrl"):
        plan = preflight(cfg, to_toml(cfg), world_size=1)
    assert (plan.resume, plan.resume_step) == (one, 1)
    assert f"skipping damaged checkpoint {two}" in caplog.text and "step 99 in a directory named for step 2" in caplog.text
    one_line_error(dry(tiny, tmp_path / "run", "trainer.total_steps=10", f"checkpoint.resume={two}"),
                   f"checkpoint.resume = '{two}': checkpoint {two}: manifest.json is malformed (step 99 in a directory "
                   "named for step 2)")
    m["step"] = 2  # the directory renamed instead: trainer.json disagrees
    json.dump(m, open(os.path.join(two, "manifest.json"), "w"))
    os.rename(two, two.replace("step_00000002", "step_00000003"))
    m["step"] = 3
    json.dump(m, open(os.path.join(two.replace("step_00000002", "step_00000003"), "manifest.json"), "w"))
    with caplog.at_level("WARNING", logger="spmdrl"):
        assert preflight(cfg, to_toml(cfg), world_size=1).resume == one
    assert "trainer.json is at step 2, manifest.json says step 3" in caplog.text


def test_crafted_metadata_on_resume_is_one_line_and_auto_falls_back(tiny, exportable, tmp_path, caplog):
    """Once the refusal arrived wrapped in DCP's 'metadata is None' assertion and auto did not fall back."""
    from spmdrl.preflight import preflight

    cfg = run_config(tiny, tmp_path / "run")
    one, two = save_run(exportable, cfg, steps=(1, 2))
    payload = b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94\x8c\x04true\x94\x85\x94R\x94."
    open(os.path.join(two, "state", "actor", ".metadata"), "wb").write(payload)
    rehash(two, "state/actor/.metadata")
    with caplog.at_level("WARNING", logger="spmdrl"):
        assert preflight(cfg, to_toml(cfg), world_size=1).resume == one
    assert "refers to os.system" in caplog.text and f"skipping damaged checkpoint {two}" in caplog.text
    one_line_error(dry(tiny, tmp_path / "run", "trainer.total_steps=10", f"checkpoint.resume={two}"),
                   f"checkpoint.resume = '{two}'", "DCP metadata refers to os.system", "refusing to unpickle it")


def test_resuming_another_model_is_refused_before_launch(tiny, exportable, tmp_path):
    cfg = run_config(tiny, tmp_path / "run")
    save_run(exportable, cfg)
    other = model_copy(tiny, tmp_path)
    c = json.load(open(other / "config.json"))
    c["intermediate_size"] *= 2
    json.dump(c, open(other / "config.json", "w"))
    one_line_error(dry(other, tmp_path / "run", "trainer.total_steps=10"),
                   f"checkpoint {tmp_path / 'run' / 'checkpoints' / 'step_00000001'} is for a different model "
                   f"(intermediate_size = {c['intermediate_size'] // 2} in the checkpoint, {c['intermediate_size']} in "
                   "model.path); check model.path")


def test_a_split_run_with_batches_in_flight_resumes_on_its_world_size_only(tiny, exportable, tmp_path):
    split = ["placement.mode=split", "placement.rollout_ranks=[0]", "placement.rollout_tp=1", "trainer.max_staleness=1",
             "trainer.total_steps=10"]
    cfg = run_config(tiny, tmp_path / "run", *split)
    save_run(exportable, cfg, world_size=2)
    assert dry(tiny, tmp_path / "run", *split).exit_code == 0  # the same world size: resumes
    one_line_error(dry(tiny, tmp_path / "run", *split, nproc=3),
                   f"checkpoint {tmp_path / 'run' / 'checkpoints' / 'step_00000001'} was written by 2 ranks with batches "
                   "in flight (trainer.max_staleness = 1, split placement), and this run has 3", "resume it on 2 ranks")


# ---- reward functions in a worker process ---------------------------------------------------------------

REWARD_FILE = '''
import hashlib, os, time

def score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "c-loop":
        return float(sum(range(10**11)))  # C code: no bytecode boundary for a signal handler for minutes
    if solution_str == "pbkdf2":
        return float(len(hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 10**9)))
    if solution_str == "boom":
        raise ValueError("cannot parse " + ground_truth)
    if solution_str == "die":
        os._exit(3)
    if solution_str == "pid":
        return float(os.getpid())
    if solution_str == "spawn":  # a new-session child that would sleep a minute
        import subprocess
        return float(subprocess.Popen(["sleep", "63"], start_new_session=True).pid)
    print("scored", solution_str)  # prints must not disturb the protocol
    return float(len(solution_str))
'''


def reward_cfg(tmp_path, **kw):
    from spmdrl.config.schema import RewardConfig

    (tmp_path / "rw.py").write_text(REWARD_FILE)
    return RewardConfig(custom_fn=f"{tmp_path / 'rw.py'}:score", **kw)


def call(fn, text, gt="1"):
    return fn(data_source="d", solution_str=text, ground_truth=gt, extra_info=None)


def test_a_reward_busy_in_c_code_is_stopped_by_the_timeout(tmp_path):
    """sum(range(10**11)) and a long pbkdf2_hmac once ignored reward.timeout_s for minutes (SIGALRM waits for
    the C call to return). In a worker process the call is killed at the limit and counted as a failed reward;
    the next call gets a new worker."""
    import time

    from spmdrl.rewards.custom import build_reward_fn

    fn = build_reward_fn(reward_cfg(tmp_path, timeout_s=1.0, on_error="zero"))
    assert call(fn, "abc") == 3.0
    first = call(fn, "pid")
    for text in ("c-loop", "pbkdf2"):
        t0 = time.monotonic()
        assert call(fn, text) == 0.0
        assert time.monotonic() - t0 < 5
    assert fn.take_counts() == (2, 2)
    assert not os.path.exists(f"/proc/{int(first)}") or open(f"/proc/{int(first)}/stat").read().split()[2] == "Z"
    assert call(fn, "pid") != first and call(fn, "abcd") == 4.0  # a new worker
    assert call(fn, "boom") == 0.0 and call(fn, "die") == 0.0 and call(fn, "ab") == 2.0
    assert fn.take_counts() == (2, 0)
    fn.fn.close()


def test_nothing_a_reward_function_starts_outlives_its_call(tmp_path):
    import time

    from spmdrl.rewards.custom import build_reward_fn

    fn = build_reward_fn(reward_cfg(tmp_path, timeout_s=5.0))
    child = int(call(fn, "spawn"))
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    assert call(fn, "ab") == 2.0
    fn.fn.close()


def test_a_reward_failure_in_the_worker_names_the_sample_and_the_original_error(tmp_path):
    from spmdrl.errors import RewardError
    from spmdrl.rewards.custom import RewardTimeout, build_reward_fn, compute_rewards

    fn = build_reward_fn(reward_cfg(tmp_path, timeout_s=1.0))
    with pytest.raises(RewardError, match=r"raised on sample 1 \(data_source 'd'\): ValueError: cannot parse 7$"):
        compute_rewards(fn, ["d", "d"], ["ok", "boom"], ["7", "7"])
    with pytest.raises(RewardError, match=r"raised on sample 0 .*RewardTimeout: took longer than reward.timeout_s=1s "
                                          r"\(its worker process was killed and is replaced\)"):
        compute_rewards(fn, ["d"], ["c-loop"], ["1"])
    with pytest.raises(RewardError, match=r"raised on sample 0 .*RewardWorkerError: its worker process died \(exit code 3\)"):
        compute_rewards(fn, ["d"], ["die"], ["1"])
    with pytest.raises(RewardTimeout):
        call(fn, "c-loop")
    fn.fn.close()
    in_process = build_reward_fn(reward_cfg(tmp_path, timeout_s=1.0, in_process=True))
    assert call(in_process, "pid") == float(os.getpid())  # opted in: the rank's own process


def test_a_rank_scoring_a_stuck_reward_stops_on_sigterm(tmp_path):
    """The rank waits for its worker in select(), where SIGTERM is handled at once (in-process, a C call held
    the signal until it returned)."""
    import signal
    import subprocess
    import sys
    import time

    reward_cfg(tmp_path)
    script = tmp_path / "rank.py"
    script.write_text(f'''
import sys
from spmdrl.config.schema import RewardConfig
from spmdrl.faults import stop_signals, Terminated
from spmdrl.rewards.custom import build_reward_fn
fn = build_reward_fn(RewardConfig(custom_fn={str(tmp_path / "rw.py")!r} + ":score", timeout_s=600))
fn(data_source="d", solution_str="x", ground_truth="1", extra_info=None)
print("ready", flush=True)
with stop_signals():
    try:
        fn(data_source="d", solution_str="c-loop", ground_truth="1", extra_info=None)
    except Terminated as e:
        print("stopped by", e, flush=True)
        sys.exit(143)
''')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and "stopped by SIGTERM" in out and time.monotonic() - t0 < 5, err


# ---- ranks killed, stopped or stuck -----------------------------------------------------------------------

def _failure(tmp_path, rank, exitcode, line=None):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / "attempt_0" / str(rank) / "error.json"  # torchrun's layout
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    if line is not None:
        path.write_text(json.dumps({"message": f"error (rank {rank}): {line}", "timestamp": 0}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_launcher_names_a_rank_killed_from_outside_and_exits_1(tmp_path, capsys):
    """kill -9 of a rank during a save was reported as 'stopped by SIGTERM ... the first failing rank's line has
    the cause' with exit 2 (a user error), though the killed rank printed nothing."""
    from spmdrl.process.launcher import summarise_failures

    (tmp_path / "attempt_0").mkdir()
    (tmp_path / "attempt_0" / "spmdrl_first_error").touch()  # a rank printed its line
    survivor = "step 2, stage 'checkpoint': saving checkpoint step 2 under /x failed while writing on rank 0: ..."
    code = summarise_failures({1: _failure(tmp_path, 1, -9), 0: _failure(tmp_path, 0, 2, survivor)})
    err = capsys.readouterr().err
    assert code == 1 and err.splitlines() == [
        "error: rank 1 (pid 1001) was killed by SIGKILL (from outside spmdrl: kill -9, the OOM killer, a scheduler) "
        "and the launcher stopped the other ranks; its output above may have the cause; relaunch the same command to "
        "resume from the last complete checkpoint, if one was saved"]
    assert summarise_failures({0: _failure(tmp_path, 0, 2, "model.path = 'x': no such directory")}) == 2
    assert summarise_failures({0: _failure(tmp_path, 0, 143, "step 3: stopped by SIGTERM (...)"),
                               1: _failure(tmp_path, 1, 143, "step 3: stopped by SIGTERM (...)")}) == 143
    assert capsys.readouterr().err == ""  # the ranks printed their line; the launcher adds none
    assert summarise_failures({3: _failure(tmp_path, 3, 1)}) == 1  # no error file: a crash before reporting
    assert capsys.readouterr().err == "error: rank 3 (pid 1003) exited with code 1; its output above has the cause\n"


def _bug(tmp_path, rank, exitcode, exc: BaseException):
    """A rank that raised `exc` (not a user error): its error file as spmdrl.process.launcher.record_bug writes it."""
    from spmdrl.process.launcher import record_bug

    path = tmp_path / "attempt_0" / str(rank) / "error.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
    try:
        record_bug(exc)
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    return _process_failure(rank, exitcode, path)


def _process_failure(rank, exitcode, path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def _raised(exc: BaseException, note: str) -> BaseException:
    try:
        raise exc
    except BaseException as e:
        e.add_note(note)
        return e


def test_a_ranks_exception_is_named_not_torchruns_stop_of_it(tmp_path, capsys):
    """Both ranks raised an ordinary exception in step 1, stage 'old_logprob'; torchrun stopped rank 0 (SIGTERM)
    while it was exiting. The launcher's line read `rank 0 ... was killed by SIGTERM (from outside spmdrl ...)`:
    it names the exception now, with its stage, and exits 1."""
    from spmdrl.process.launcher import summarise_failures

    note = "spmdrl: raised in step 1, stage 'old_logprob'"
    failures = {0: _bug(tmp_path, 0, -15, _raised(IndexError("index 70000 is out of bounds for dimension 0"), note)),
                1: _bug(tmp_path, 1, 1, _raised(IndexError("index 70000 is out of bounds for dimension 0"), note))}
    assert summarise_failures(failures) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: rank 0 (pid 1000) raised IndexError: index 70000 is out of bounds for dimension 0 (raised in step 1, "
        "stage 'old_logprob'); its traceback is above"]
    # one rank raised; the other, stopped by torchrun before it could say anything, is not a kill from outside
    failures = {0: _process_failure(0, -15, tmp_path / "none0.json"),
                1: _bug(tmp_path, 1, 1, _raised(TypeError("bad operand"), note))}
    assert summarise_failures(failures) == 1
    assert capsys.readouterr().err == ("error: rank 1 (pid 1001) raised TypeError: bad operand (raised in step 1, "
                                       "stage 'old_logprob'); its traceback is above\n")


def test_a_signal_is_from_outside_only_when_no_rank_reported_and_the_launcher_did_not_send_it(tmp_path, capsys):
    """kill -9 of rank 1 after the last checkpoint; torchrun then stopped rank 0 with SIGTERM before it said
    anything: only the kill is named (the SIGTERM was the launcher's). A SIGTERM nobody reported and that no
    failure of another rank explains is from outside."""
    from spmdrl.process.launcher import summarise_failures

    none = tmp_path / "none.json"
    assert summarise_failures({0: _process_failure(0, -15, none), 1: _process_failure(1, -9, none)}) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: rank 1 (pid 1001) was killed by SIGKILL (from outside spmdrl: kill -9, the OOM killer, a scheduler) "
        "and the launcher stopped the other ranks; its output above may have the cause; relaunch the same command to "
        "resume from the last complete checkpoint, if one was saved"]
    # a crash with an exit code (no report) and torchrun's stop of the other rank
    assert summarise_failures({0: _process_failure(0, -15, none), 1: _process_failure(1, 3, none)}) == 1
    assert capsys.readouterr().err == "error: rank 1 (pid 1001) exited with code 3; its output above has the cause\n"
    # nobody failed otherwise: the SIGTERM came from outside
    assert summarise_failures({1: _process_failure(1, -15, none)}) == 1
    assert capsys.readouterr().err.startswith(
        "error: rank 1 (pid 1001) was killed by SIGTERM from outside spmdrl (no rank reported an error and the "
        "launcher did not send it")
    # a collective that failed because the killed rank was gone is a consequence, not the cause
    failures = {0: _bug(tmp_path, 0, 1, RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")),
                1: _process_failure(1, -9, none)}
    assert summarise_failures(failures) == 1
    assert "rank 1 (pid 1001) was killed by SIGKILL" in capsys.readouterr().err


def test_a_recorded_error_wins_over_the_launchers_own_stop(tmp_path, capsys):
    """A config error on rank 1 while rank 0 was stopped by the launcher (SIGTERM) before it could print: the
    launcher said rank 0 'was killed by SIGTERM (from outside spmdrl ...)' and exited 1, hiding the typo."""
    from spmdrl.process.launcher import summarise_failures

    typo = "command-line override: unknown key 'actor.lrr'; did you mean 'actor.lr'?"
    for rank0 in (_failure(tmp_path, 0, -15), _failure(tmp_path, 0, 143, "stopped by SIGTERM before start-up; ...")):
        assert summarise_failures({1: _failure(tmp_path, 1, 2, typo), 0: rank0}) == 2
        assert capsys.readouterr().err == f"error (rank 1): {typo}\n"  # no rank printed it (no marker): here
    (tmp_path / "attempt_0" / "spmdrl_first_error").touch()
    assert summarise_failures({1: _failure(tmp_path, 1, 2, typo), 0: _failure(tmp_path, 0, -15)}) == 2
    assert capsys.readouterr().err == ""  # printed once by the rank
    # a SIGKILL without a word is still the root cause
    assert summarise_failures({1: _failure(tmp_path, 1, 2, typo), 0: _failure(tmp_path, 0, -9)}) == 1
    assert "rank 0 (pid 1000) was killed by SIGKILL (from outside spmdrl" in capsys.readouterr().err


def test_a_stop_is_not_a_user_error():
    """A rank stopped by a signal exits 128 + signal (the launcher's exit code then says so), not 2."""
    import signal
    import time

    from spmdrl.faults import Stopped, named_failures
    from spmdrl.metrics import StageTimer

    with pytest.raises(Stopped) as e:
        with named_failures(lambda: 3, 30):
            with StageTimer()("checkpoint"):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
    assert e.value.signum == signal.SIGTERM
    assert str(e.value).startswith("step 3, stage 'checkpoint': stopped by SIGTERM (a kill of the launcher, a "
                                   "scheduler, or the launcher stopping every rank after one failed: the launcher's "
                                   "summary names that rank)")
    assert "Ctrl-C" not in str(e.value)  # that is SIGINT's line


def test_a_rank_blocked_in_cpp_leaves_soon_after_sigterm(tmp_path):
    """kill -9 of rank 0 during start-up left its peer waiting in C++ (a store wait for the dead rank, where no
    Python signal handler runs) until the launcher's SIGKILL 30 s later. The rank now leaves STOP_GRACE_S after
    the signal, with one line and exit 143."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "rank.py"
    script.write_text('''
import datetime, sys
from torch.distributed import TCPStore
from spmdrl.faults import stop_signals, watch_stop_signals
watch_stop_signals(lambda s: print(f"error (rank 1): stopped by signal {s} while blocked", file=sys.stderr, flush=True),
                   grace_s=2.0)
store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=120))
with stop_signals():
    print("waiting", flush=True)
    store.wait(["a key the dead rank would have set"])
''')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "waiting"
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 143 and 1.5 < took < 10, (proc.returncode, took, err)
    assert err.strip().splitlines() == [f"error (rank 1): stopped by signal {int(signal.SIGTERM)} while blocked"], err


def test_leave_does_what_an_exit_does_but_the_teardown(tmp_path):
    """spmdrl.process.launcher.leave (how every spmdrl process ends): the exit status, buffered output, the other
    non-daemon threads run to their end, an idle thread pool's workers let go (as torch inductor's compile pool
    is kept for the life of a process that compiled), the atexit handlers, and a message as sys.exit prints it;
    the interpreter's teardown (its garbage collections, which would finalise the cycle below) is skipped."""
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text('''
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from spmdrl.process.launcher import leave
pool = ThreadPoolExecutor(1)  # kept, never shut down: its idle worker is a non-daemon thread
pool.submit(int).result()
class Cycle:
    def __del__(self):
        print("finalised at teardown", flush=True)
c = Cycle(); c.me = c; del c
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
print("buffered")  # stdout is a pipe: block-buffered, so only a flush writes it
leave(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
''')
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    for arg, code, err in (("3", 3, ""), ("a message", 1, "a message\n")):
        proc = subprocess.run([sys.executable, str(script), arg], capture_output=True, text=True, env=env, timeout=20)
        assert (proc.returncode, proc.stdout.splitlines(), proc.stderr) == (
            code, ["buffered", "thread done", "atexit ran"], err), proc


def test_the_heap_is_frozen_only_in_a_process_an_entry_point_owns(tmp_path):
    """settle_heap (after start-up's imports) freezes the heap under run_as_process only, never in a caller's
    process (this one); a bug's exception thaws it before the interpreter's own exit."""
    import gc
    import subprocess
    import sys

    from spmdrl.process.launcher import settle_heap

    frozen = gc.get_freeze_count()
    settle_heap()
    assert gc.get_freeze_count() == frozen
    script = tmp_path / "entry.py"
    script.write_text('''
import atexit, gc, sys
from spmdrl.process.launcher import run_as_process, settle_heap
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))
def main():
    settle_heap()
    print("frozen in main:", gc.get_freeze_count() > 0)
    if sys.argv[1] == "bug":
        raise ZeroDivisionError("a bug")
    return 4
run_as_process(main)
''')
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    for arg, code, lines in (("ok", 4, ["frozen in main: True", "frozen at exit: True"]),
                             ("bug", 1, ["frozen in main: True", "frozen at exit: False"])):
        proc = subprocess.run([sys.executable, str(script), arg], capture_output=True, text=True, env=env, timeout=20)
        assert (proc.returncode, proc.stdout.splitlines()) == (code, lines), proc
        assert ("ZeroDivisionError: a bug" in proc.stderr) == (arg == "bug"), proc.stderr


def test_output_dir_is_absolute_from_the_start(tmp_path, monkeypatch):
    """A tool calling os.chdir split a checkpoint across two directories: trainer.output_dir was relative."""
    from spmdrl.config import Config
    from spmdrl.errors import ConfigError
    from spmdrl.train import run_entry

    seen = {}

    def validate_fn(cfg, world_size):
        seen["out"] = cfg.trainer.output_dir
        raise ConfigError("stop here")

    monkeypatch.chdir(tmp_path)
    code = run_entry(["trainer.output_dir=runs/a"], prog="t", description="", root_cls=Config,
                     validate_fn=validate_fn, run_fn=None)
    assert code == 2 and seen["out"] == str(tmp_path / "runs" / "a")
    check_no_watcher_left()


def check_no_watcher_left():
    """The entry point returned, in a process that goes on: its stop-signal watcher left the process's signal wakeup
    fd set and its thread running, so the test process's next SIGTERM (an in-process signal test, handled) ended the
    whole test run 5 s later with os._exit(143)."""
    import signal
    import threading

    left = [t.name for t in threading.enumerate() if t.name in ("spmdrl-stop-watch", "spmdrl-parent-watch")]
    assert not left, left
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    assert fd == -1, "run_entry left a signal wakeup fd set"


def test_a_tool_file_that_exits_or_interrupts_at_import_is_one_line(tmp_path):
    """sys.exit() or KeyboardInterrupt at the top of a tool file ended the run with no message at all."""
    from spmdrl.errors import ConfigError
    from spmdrl.tools.registry import load_tools

    for body, kind in (("import sys\nsys.exit(0)\n", "SystemExit"), ("raise KeyboardInterrupt\n", "KeyboardInterrupt")):
        path = tmp_path / f"tools_{kind}.py"
        path.write_text(body)
        with pytest.raises(ConfigError) as e:
            load_tools([f"{path}:f"])
        msg = str(e.value)
        assert "\n" not in msg and f"raised {kind}" in msg and str(path) in msg, msg


def test_a_config_directory_is_named_as_such(tmp_path):
    """`--config DIR` said 'config file not found'."""
    from spmdrl.config import load_config
    from spmdrl.errors import ConfigError

    (tmp_path / "grpo.toml").write_text("")
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path), [])
    assert str(e.value) == (f"config {tmp_path} is a directory (it holds grpo.toml); give a TOML file, e.g. "
                            f"--config {tmp_path}/grpo.toml")


def test_an_import_that_hangs_says_so(tmp_path, monkeypatch, capsys):
    """A tool file that blocked at import gave no message at all."""
    from spmdrl.process import usercode
    from spmdrl.tools.registry import load_tools

    monkeypatch.setattr(usercode, "SLOW_IMPORT_S", 0.3)
    path = tmp_path / "slow_tools.py"
    path.write_text('import time\ntime.sleep(1.0)\n\ndef f(x: int) -> str:\n    """F.\n\n    Args:\n        x: x\n    """\n'
                    '    return str(x)\n')
    assert load_tools([f"{path}:f"])[0].name == "f"
    err = capsys.readouterr().err
    assert f"tool '{path}:f': importing {path} has taken over 0.3s and goes on" in err, err


def test_a_stop_says_whether_a_relaunch_resumes_or_starts_over(tmp_path):
    """Ctrl-C of a default run (checkpoint.save_freq = 0) before any save printed "relaunch the same command to
    resume from the last complete checkpoint" though there was none: the line now says what a relaunch does."""
    import signal
    import time

    from spmdrl.checkpoint import MARKER, resume_advice
    from spmdrl.faults import Stopped, named_failures

    def stop():
        with pytest.raises(Stopped) as e:
            with named_failures(lambda: 3, 30, lambda: resume_advice(str(tmp_path))):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        return str(e.value)

    assert stop().endswith("no checkpoint was saved yet, so relaunching the same command starts over at step 0 (it "
                           "moves this attempt's metrics to output_dir/previous/); set checkpoint.save_freq (steps) "
                           "or checkpoint.save_every_min to save during a run")
    step = tmp_path / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / MARKER).write_text("{}")
    assert stop().endswith(f"relaunch the same command to resume from {step}")


def test_a_save_is_due_by_steps_at_the_end_and_by_minutes():
    """checkpoint.save_every_min bounds what a stop loses when save_freq saves only at the end (the default)."""
    import time

    from spmdrl.config import load_config
    from spmdrl.loop.run_state import RunCheckpointer

    def checkpointer(*overrides):
        return RunCheckpointer(load_config(None, list(overrides)), None, {}, None, None, None, None, None, None, 0, "")

    default = checkpointer()
    assert default.cfg.checkpoint.save_every_min == 30.0
    assert not default.due(1, False, default.since_save()) and default.due(2, True, default.since_save())
    every3 = checkpointer("checkpoint.save_freq=3")
    assert [s for s in range(1, 7) if every3.due(s, False, every3.since_save())] == [3, 6]
    timed = checkpointer("checkpoint.save_every_min=0.002")  # 0.12 s
    assert not timed.due(1, False, timed.since_save())
    time.sleep(0.15)
    assert timed.due(2, False, timed.since_save())
    assert not timed.due(2, False, 0.1)  # the ranks' agreed clock decides, not this rank's own
    timed.last_save = time.monotonic()  # what a save does
    assert not timed.due(3, False, timed.since_save())
    assert not checkpointer("checkpoint.save_freq=-1", "checkpoint.save_every_min=0.001").due(5, True, 1e9)


def test_a_lora_export_names_the_base_model_as_the_run_gave_it(tmp_path):
    """An exported adapter named its base by the (relative, or hub-snapshot) path the engine read, so
    AutoPeftModelForCausalLM failed from another directory: a hub id given as model.path is recorded as the
    id (engines record a local base as an absolute path)."""
    from spmdrl.export import _hub_model_id

    (tmp_path / "config.toml").write_text('[model]\npath = "Qwen/Qwen2.5-0.5B-Instruct"\n')
    assert _hub_model_id(str(tmp_path)) == "Qwen/Qwen2.5-0.5B-Instruct"
    (tmp_path / "config.toml").write_text('[model]\npath = "./outputs/sft_model"\n')
    assert _hub_model_id(str(tmp_path)) is None


# ---- checked before launch, and what the command says ----------------------------------------------------

@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    from spmdrl.data.synthetic import make_arith

    return make_arith(str(tmp_path_factory.mktemp("arith")), n_train=40, n_val=8)


def _train_args(tiny, arith, out, *extra):
    return ["train", "--config", os.path.join(os.path.dirname(HERE), "configs", "grpo.toml"), "--dry-run",
            f"model.path={tiny}", f"trainer.output_dir={out}", f'data.train_files=["{arith["train"]}"]',
            f'data.val_files=["{arith["val"]}"]', "data.max_prompt_length=128", "data.max_response_length=128",
            "placement.actor_tp=1", "placement.ref_tp=1", "placement.rollout_tp=1", *extra]


def test_reward_functions_are_resolved_before_launch(tiny, arith, tmp_path):
    """A misspelled function in reward.custom_fns was found on the ranks, about 20 s in; a reward file that ends
    its process at import is named too (it is loaded in a throwaway process, not in the command's)."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def length(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    dies = tmp_path / "dies.py"
    dies.write_text("import os\nos._exit(4)\n")
    one_line_error(cli(*_train_args(tiny, arith, tmp_path / "a", f'reward.custom_fns=["{rewards}:length", '
                                    f'"{rewards}:lenght"]')),
                   "error: reward.custom_fns: reward function", f"{rewards}:lenght", "has no 'lenght'",
                   "callables there: length")
    one_line_error(cli(*_train_args(tiny, arith, tmp_path / "b", f"reward.custom_fn={dies}:score")),
                   f"error: reward.custom_fn: loading '{dies}:score' ended its process (exit code 4) without a word")
    assert cli(*_train_args(tiny, arith, tmp_path / "c", f'reward.custom_fns=["{rewards}:length"]')).exit_code == 0


def test_a_tool_file_that_ends_its_process_at_import_is_one_line_and_the_command_is_quiet(tiny, arith, tmp_path):
    """`os._exit(3)` at the top of a tool file ended `spmdrl train` with status 3 and no message, after vLLM's
    Triton notice (the command's checks import vLLM before it had applied logging.verbosity)."""
    import subprocess
    import sys

    dies = tmp_path / "tools_dies.py"
    dies.write_text("import os\nos._exit(3)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "SPMDRL_VERBOSITY")}
    proc = subprocess.run([sys.executable, "-m", "spmdrl", *_train_args(
        tiny, arith, tmp_path / "out", "placement.rollout_tp=2", "--nproc", "2", "multi_turn.enable=true",
        f'multi_turn.tools=["{dies}:f"]')], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr == (f"error: multi_turn.tools: loading '{dies}:f' ended its process (exit code 3) without a "
                           "word, at import or in a factory (os._exit, a crash in C code); fix the file\n")


def test_total_epochs_with_total_steps_is_refused_and_the_count_is_said(arith, tiny, tmp_path, caplog):
    """total_epochs = 2 with total_steps = 100: the epochs won without a word, and the console never showed the
    step count they came to."""
    import logging

    from spmdrl.preflight import resolve_total_epochs
    from spmdrl.train import train_preflight

    def cfg(*extra):
        return load_config(None, [f'data.train_files=["{arith["train"]}"]', "data.train_batch_size=8",
                                  "trainer.total_epochs=2", *extra])

    with pytest.raises(ConfigError) as e:
        resolve_total_epochs(cfg("trainer.total_steps=100"))
    assert str(e.value) == ("trainer.total_epochs = 2 (10 steps) and trainer.total_steps = 100 are both set; give one: "
                            "trainer.total_epochs=0 to run 100 steps, or remove trainer.total_steps (or pass "
                            "trainer.total_steps=10) to run 2 epoch(s)")
    for extra in ([], ["trainer.total_steps=10"]):  # the default, or the count itself (a run's saved config.toml)
        c = cfg(*extra)
        assert resolve_total_epochs(c) == ("trainer.total_epochs = 2: 40 rows // data.train_batch_size 8 = 5 steps "
                                           "per epoch, so trainer.total_steps = 10")
        assert c.trainer.total_steps == 10
    run = cfg(f"model.path={tiny}", f"trainer.output_dir={tmp_path / 'run'}", "data.max_prompt_length=128",
              "data.max_response_length=128")
    with caplog.at_level(logging.INFO, logger="spmdrl"):
        assert train_preflight(run, 0, 1).steps_line  # rank 0 says it at start
    assert "so trainer.total_steps = 10" in caplog.text


def test_train_on_cuda_refuses_a_config_the_plan_says_does_not_fit(tiny):
    """`spmdrl plan` printed `fits: false` and exited 0, and `spmdrl train` on a GPU never consulted it. The decision
    is tested here on CPU (the CUDA branch only reads the device's memory)."""
    from spmdrl.preflight import check_fits, refuse_unfit

    cfg = load_config(None, [f"model.path={tiny}", "data.max_prompt_length=128", "data.max_response_length=128"])
    assert refuse_unfit(cfg, 1, 80.0)["fits"]
    with pytest.raises(ConfigError) as e:
        refuse_unfit(cfg, 1, 0.01)
    msg = str(e.value)
    assert msg.startswith("does not fit: phase ") and "GiB per GPU" in msg and "\n" not in msg, msg
    assert msg.endswith("(on 1 GPU(s) of 0.01 GiB: `spmdrl plan --config F --world-size 1` shows the whole plan); "
                        "change the config, or pass --force to start anyway"), msg
    cfg.memory.gpu_memory_gb = 0.01
    check_fits(cfg, 1, device="cpu")  # CPU: no verdict
    check_fits(cfg, 1, force=True, device="cuda")  # --force: none either (and no CUDA touched)


def test_min_gpus_lists_skipped_candidates_and_varies_pp(tiny):
    """--min-gpus dropped invalid layouts without a word (a 70B config listed only 16 and 32 GPUs) and never
    tried pipeline parallelism."""
    from spmdrl.plan.search import layouts, min_gpus

    cfg = load_config(None, [f"model.path={tiny}", "data.max_prompt_length=128", "data.max_response_length=128",
                             'data.train_files=["train.parquet"]', "placement.actor_tp=2", "placement.ref_tp=2",
                             "placement.rollout_tp=2"])
    notes = []
    world, change, plan = min_gpus(cfg, 2, note=notes.append)
    assert (world, change, plan["fits"]) == (2, {}, True)
    assert notes[0].startswith("1 GPU(s) (as configured): skipped, placement") and "tp" in notes[0], notes
    assert notes[-1] == "2 GPU(s) (as configured): fits"
    fsdp = list(layouts(cfg, 8))
    assert not any("placement.actor_pp" in c for c in fsdp)  # FSDP2 has no pipeline stages
    cfg.trainer.backend = "megatron"
    mega = [c for c in layouts(cfg, 8) if "memory.actor_offload" not in c]
    assert mega[0] == {} and {"placement.actor_pp": 2, "placement.ref_pp": 2, "placement.critic_pp": 2} in mega
    assert mega.index({f"placement.{r}_tp": 4 for r in ("actor", "ref", "critic", "rollout")}) < \
        mega.index({"placement.actor_pp": 2, "placement.ref_pp": 2, "placement.critic_pp": 2,
                    **{f"placement.{r}_tp": 4 for r in ("actor", "ref", "critic", "rollout")}})


def test_eval_of_a_checkpoint_writes_under_its_run(tmp_path):
    """`spmdrl eval --checkpoint RUN` wrote under the config's trainer.output_dir/eval: a second run's checkpoint
    evaluated with a shared config overwrote the first run's results and exported model."""
    ckpt = tmp_path / "run2" / "checkpoints" / "step_00000003"
    ckpt.mkdir(parents=True)
    (ckpt / ck_files.MARKER).write_text("")
    config = os.path.join(os.path.dirname(HERE), "configs", "grpo.toml")
    for given, out in ((str(tmp_path / "run2"), tmp_path / "run2" / "eval"), (str(ckpt), tmp_path / "run2" / "eval")):
        r = cli("eval", "--config", config, "--checkpoint", given, "--dry-run", f"trainer.output_dir={tmp_path / 'run1'}")
        assert r.exit_code == 0, r.output
        assert f"trainer.output_dir={out} model.path={out / 'model'}" in r.output, r.output
    r = cli("eval", "--config", config, "--checkpoint", str(ckpt), "--dry-run", "--out", str(tmp_path / "mine"))
    assert f"trainer.output_dir={tmp_path / 'mine'} " in r.output, r.output


def test_export_verifies_params_hash_and_each_stored_shape(exportable, tmp_path):
    """A reshaped parameter passed export: neither the manifest's params_hash nor the stored shapes were checked."""
    from spmdrl.checkpoint.dcp import param_hash

    def reshape(fix_hash: bool):
        def damage(p):
            m = json.load(open(f"{p}/manifest.json"))
            params = m["engines"]["actor"]["params"]
            i = next(i for i, (_, shape, _) in enumerate(params) if len(shape) == 2 and shape[0] != shape[1])
            name, shape = params[i][0], params[i][1]
            params[i][1] = shape[::-1]
            if fix_hash:  # whoever edits the list can recompute the hash: the stored tensors still tell
                m["engines"]["actor"]["params_hash"] = param_hash(params)
            json.dump(m, open(f"{p}/manifest.json", "w"))
            return name, shape
        return damage

    path = copy_of(exportable[0], tmp_path)
    reshape(False)(path)
    one_line_error(cli("export", "--checkpoint", path, "--out", str(tmp_path / "out")),
                   f"checkpoint {path}: the actor parameter list in manifest.json does not match its params_hash")
    path = copy_of(exportable[0], tmp_path / "second")
    name, shape = reshape(True)(path)
    one_line_error(cli("export", "--checkpoint", path, "--out", str(tmp_path / "out")),
                   f"checkpoint {path}: parameter {name!r} is stored with shape {shape}, the manifest lists "
                   f"{shape[::-1]}")
    assert not (tmp_path / "out").exists()
