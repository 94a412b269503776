"""The `spmdrl` command, through typer's CliRunner (and once as `python -m spmdrl`)."""
import json
import os
import subprocess
import sys

import click
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner
from module_engine import ModuleEngine

from spmdrl import cli
from spmdrl.cli import app
from spmdrl.config import config_reference, load_config
from spmdrl.errors import SpmdrlError

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO = os.path.join(REPO, "configs", "grpo.toml")
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, *needles):
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    err = result.stderr
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_help_lists_subcommands():
    result = run("--help")
    assert result.exit_code == 0
    for name in ("train", "sft", "config", "data", "model"):
        assert name in result.stdout
    for group, names in (("config", ("show", "docs")), ("data", ("gsm8k", "synthetic")), ("model", ("tiny",))):
        out = run(group, "--help").stdout
        assert all(n in out for n in names), out


def test_every_command_and_option_has_help():
    def walk(cmd, path):
        assert cmd.help, f"{path} has no help text"
        for p in cmd.params:
            if isinstance(p, click.Option) and p.name != "help" or isinstance(p, click.Argument):
                assert getattr(p, "help", None), f"{path} {p.name} has no help text"
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "spmdrl")


def test_config_show_is_toml_that_loads_back(tmp_path):
    overrides = ["actor.lr=2e-6", "--rollout.n=8", 'rollout.stop=["\\n\\n"]']
    result = run("config", "show", "--config", GRPO, *overrides)
    assert result.exit_code == 0, result.output
    path = tmp_path / "resolved.toml"
    path.write_text(result.stdout)
    expected = load_config(GRPO, overrides)
    assert load_config(str(path)) == expected
    assert expected.actor.lr == 2e-6 and expected.rollout.n == 8 and expected.rollout.stop == ["\n\n"]


def test_config_show_with_comments_and_defaults(tmp_path):
    result = run("config", "show", "--comments")
    assert result.exit_code == 0
    assert "# AdamW learning rate." in result.stdout
    path = tmp_path / "defaults.toml"
    path.write_text(result.stdout)
    assert load_config(str(path)) == load_config(None)


def test_config_show_refuses_invalid_values():
    """`config show` printed a misspelt estimator and a mini-batch that does not divide the batch with exit 0."""
    assert_user_error(run("config", "show", "--config", GRPO, "algorithm.adv_estimator=grpoo"),
                      "algorithm.adv_estimator = 'grpoo' is not registered")
    assert_user_error(run("config", "show", "--config", GRPO, "data.train_batch_size=8", "actor.ppo_mini_batch_size=3"),
                      "data.train_batch_size = 8 is not divisible by actor.ppo_mini_batch_size = 3")
    assert run("config", "show", "--config", GRPO, "logging.backends=[\"wandb\"]").exit_code == 0  # no tracker check


def test_config_show_validates_for_world_size():
    result = run("config", "show", "--config", GRPO, "--world-size", 8)
    assert result.exit_code == 0, result.output
    assert "rollout: 8 ranks, dp=4 pp=1 tp=2" in result.stderr
    assert_user_error(run("config", "show", "--config", GRPO, "--world-size", 3), "world size 3")


def test_bad_key_is_one_line_error(tmp_path):
    assert_user_error(run("config", "show", "--config", GRPO, "actor.lrr=1e-6"), "'actor.lrr'", "did you mean 'actor.lr'")
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout]\ntemprature = 0.7\n")
    assert_user_error(run("config", "show", "--config", bad), "bad.toml", "'rollout.temprature'")
    assert_user_error(run("config", "show", "--config", tmp_path / "missing.toml"), "not found")
    assert_user_error(run("train", "--config", bad, "--dry-run"), "'rollout.temprature'")


def test_config_docs_writes_and_checks(tmp_path):
    out = tmp_path / "docs" / "config.md"
    assert run("config", "docs", "--out", out).exit_code == 0
    assert out.read_text() == config_reference()
    assert run("config", "docs", "--out", out, "--check").exit_code == 0
    out.write_text("stale")
    result = run("config", "docs", "--out", out, "--check")
    assert result.exit_code == 1 and "stale" in result.stderr
    assert run("config", "docs", "--out", "-").stdout == config_reference()


def test_train_dry_run_validates_and_builds_the_command():
    result = run("train", "--config", GRPO, "--nproc", 8, "--dry-run", "--actor.lr=3e-6", "rollout.n=8")
    assert result.exit_code == 0, result.output
    assert "-P -m spmdrl.process.launcher --standalone --nproc-per-node 8 -m spmdrl.train" in result.stderr
    assert f"--config {GRPO} actor.lr=3e-6 rollout.n=8" in result.stderr
    # 256 prompts over 4 rollout engines is fine; over 3 ranks it is not, and nothing is launched.
    assert_user_error(run("train", "--config", GRPO, "--nproc", 3, "--dry-run"), "world size 3")
    assert cli.launch_command("spmdrl.train", "c.toml", ["a.b=1"], 1) == [
        sys.executable, "-P", "-m", "spmdrl.train", "--config", "c.toml", "a.b=1"
    ]


def test_train_runs_the_module_and_returns_its_exit_code(monkeypatch):
    launched = []

    envs = []

    def fake_exec(path, cmd, env):  # the CLI becomes the launcher: exec, in safe-path mode
        launched.append(cmd)
        envs.append(env)
        assert path == cmd[0] and env["PYTHONSAFEPATH"] == "1"
        raise typer.Exit(3)

    monkeypatch.setattr(cli, "_exec", fake_exec)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    monkeypatch.delenv("SPMDRL_VERBOSITY", raising=False)
    result = run("train", "--config", GRPO, "--nproc", 2, "placement.rollout_tp=1")
    assert result.exit_code == 3
    assert launched == [cli.launch_command("spmdrl.train", GRPO, ["placement.rollout_tp=1"], 2)]
    assert envs[-1]["TORCH_CPP_LOG_LEVEL"] == "ERROR"  # torch's C++ warnings only at logging.verbosity = debug
    run("train", "--config", GRPO, "--nproc", 2, "placement.rollout_tp=1", "logging.verbosity=debug")
    assert "TORCH_CPP_LOG_LEVEL" not in envs[-1]
    sft_cfg = os.path.join(os.path.dirname(GRPO), "quickstart", "sft.toml")
    result = run("sft", "--config", sft_cfg, "--nproc", 2)
    assert result.exit_code == 3 and launched[-1][-3:] == ["spmdrl.sft", "--config", sft_cfg]
    assert_user_error(run("sft", "--config", GRPO), "unknown section")  # validated before launching
    assert_user_error(run("sft", "--config", "missing.toml"), "missing.toml")


def test_data_synthetic_writes_files(tmp_path):
    out = tmp_path / "arith"
    result = run("data", "synthetic", "--out", out, "--n-train", 40, "--n-val", 8, "--seed", 1, "--digits", 1)
    assert result.exit_code == 0, result.output
    assert pq.read_table(out / "train.parquet").num_rows == 40
    assert pq.read_table(out / "val.parquet").num_rows == 8
    assert pq.read_table(out / "sft.parquet").num_rows == 40
    assert "train:" in result.stdout and "sft:" in result.stdout
    # 1-digit '+' has only 100 problems: a user error, one line.
    assert_user_error(run("data", "synthetic", "--out", out, "--n-train", 200, "--digits", 1), "100")


def test_data_gsm8k_converts(tmp_path):
    src = tmp_path / "gsm8k"
    src.mkdir()
    rows = [{"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}, {"question": "1000+234?", "answer": "#### 1,234"}]
    (src / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run("data", "gsm8k", "--input", src / "train.jsonl", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert pq.read_table(tmp_path / "out" / "train.parquet").num_rows == 2
    assert_user_error(run("data", "gsm8k", "--input", tmp_path / "nothing", "--out", tmp_path / "o"), "nothing")


def test_model_tiny(tmp_path):
    result = run("model", "tiny", "--out", tmp_path / "tiny")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tiny" / "config.json").exists() and (tmp_path / "tiny" / "tokenizer.json").exists()


def test_python_dash_m_spmdrl():
    result = subprocess.run([sys.executable, "-m", "spmdrl", "config", "show", "bad.key=1"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    result = subprocess.run([sys.executable, "-m", "spmdrl", "--help"], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 0 and "train" in result.stdout


@pytest.mark.parametrize("args", [["train"], ["data", "synthetic"], ["model", "tiny"]])
def test_missing_required_options_are_usage_errors(args):
    result = run(*args)
    assert result.exit_code == 2 and "Missing option" in result.output


# ----- checks on disk before anything launches (spmdrl.preflight) -----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from spmdrl.tiny import build_tiny

    return build_tiny(str(tmp_path_factory.mktemp("tiny") / "model"), seed=0)


def dry(tiny, out, *overrides):
    return run("train", "--config", GRPO, "--dry-run", "--nproc", 8, f"model.path={tiny}", f"trainer.output_dir={out}",
               "data.max_prompt_length=256", "data.max_response_length=256", *overrides)


def test_an_architecture_vllm_does_not_load_is_refused_before_launch(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("llama", vocab_size=320, hidden_size=64, num_attention_heads=4)
    cfg.architectures = ["NoSuchForCausalLM"]
    cfg.save_pretrained(tmp_path / "m")
    result = run("train", "--config", GRPO, "--dry-run", "--nproc", 8, f"model.path={tmp_path / 'm'}",
                 "rollout.engine=vllm")
    assert_user_error(result, "vLLM does not support its architectures ['NoSuchForCausalLM']", "rollout.engine = 'hf'")


def test_model_tokenizer_and_context_are_checked_before_launch(tiny, tmp_path):
    out = tmp_path / "run"
    assert dry(tiny, out).exit_code == 0
    assert not out.exists()  # a dry run creates nothing
    assert_user_error(dry(tiny, out, f"model.path={tmp_path}/missing"), "model.path", "missing': no such directory")
    os.makedirs(tmp_path / "empty")
    assert_user_error(dry(tiny, out, f"model.path={tmp_path}/empty"), "has no config.json")
    assert_user_error(dry(tiny, out, f"model.tokenizer_path={tmp_path}/empty"), "model.tokenizer_path",
                      "has no tokenizer files")
    assert_user_error(dry(tiny, out, "data.max_prompt_length=400", "data.max_response_length=200"),
                      "400 + 200 = 600 exceeds the model's context of 512 tokens")
    open(tmp_path / "file", "w").close()
    assert_user_error(dry(tiny, tmp_path / "file" / "run"), "trainer.output_dir", "cannot be created or written")


def _used_dir(out):
    from spmdrl.checkpoint import MARKER

    step = out / "checkpoints" / "step_00000007"
    os.makedirs(step)
    (step / MARKER).write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 7}\n')


def test_a_fresh_run_into_another_runs_directory_is_refused(tiny, tmp_path):
    out = tmp_path / "run"
    _used_dir(out)
    for resume in ("off", "auto"):  # auto: the only checkpoint there is damaged (no manifest), so it starts fresh
        result = dry(tiny, out, f"checkpoint.resume={resume}")
        assert_user_error(result, f"trainer.output_dir = '{out}' holds another run", "trainer.overwrite=true",
                          "a new trainer.output_dir")
    assert "checkpoint.resume=auto to continue it" in dry(tiny, out, "checkpoint.resume=off").stderr
    assert dry(tiny, out, "checkpoint.resume=off", "trainer.overwrite=true").exit_code == 0
    assert (out / "metrics.jsonl").exists()  # the CLI only checks; rank 0 deletes when the run starts


def test_overwrite_and_restart_before_the_first_checkpoint(tiny, tmp_path):
    from spmdrl.config import to_toml
    from spmdrl.train import train_preflight

    out = tmp_path / "run"
    _used_dir(out)
    overrides = [f"model.path={tiny}", f"trainer.output_dir={out}", "data.max_prompt_length=256",
                 "data.max_response_length=256"]
    cfg = load_config(GRPO, [*overrides, "checkpoint.resume=off", "trainer.overwrite=true"])
    assert train_preflight(cfg, rank=0).resume is None  # rank 0 deletes the other run's files
    assert sorted(os.listdir(out)) == []
    # the same run relaunched (auto) after a stop before its first checkpoint starts over; its metrics are kept
    cfg = load_config(GRPO, overrides)
    (out / "config.toml").write_text(to_toml(cfg))
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert train_preflight(cfg, rank=0).resume is None and not (out / "metrics.jsonl").exists()
    assert (out / "previous" / "1" / "metrics.jsonl").read_text() == '{"step": 0}\n'
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    other = load_config(GRPO, [*overrides, "actor.lr=1e-3"])  # another config: another run
    with pytest.raises(SpmdrlError, match="holds another run"):
        train_preflight(other, rank=0)


def test_resume_target_is_checked_before_launch(tiny, tmp_path):
    out = tmp_path / "run"
    assert_user_error(dry(tiny, out, f"checkpoint.resume={tmp_path}/nowhere"), "checkpoint.resume", "no such directory")
    _used_dir(out)
    assert_user_error(dry(tiny, out, f"checkpoint.resume={out}/checkpoints/step_00000007"), "manifest.json is missing")


def test_a_run_already_at_total_steps_says_so_before_loading_anything(tiny, tmp_path, monkeypatch):

    import torch

    from spmdrl.checkpoint import CheckpointManager
    from spmdrl.config import to_toml

    out = tmp_path / "run"
    overrides = [f"model.path={tiny}", f"trainer.output_dir={out}", "data.max_prompt_length=256",
                 "data.max_response_length=256", "trainer.total_steps=4"]
    module = torch.nn.Linear(2, 2)
    CheckpointManager(str(out / "checkpoints")).save(
        4, engines={"actor": ModuleEngine(module=module, optimizer=torch.optim.AdamW(module.parameters()))},
        trainer_state={}, config_toml=to_toml(load_config(GRPO, overrides)))
    monkeypatch.setattr(cli, "_exec", lambda *a: pytest.fail("launched"))
    result = run("train", "--config", GRPO, "--nproc", 8, *overrides)  # not a dry run: nothing may launch
    assert result.exit_code == 0, result.output
    assert result.stderr == (f"{out}/checkpoints/step_00000004 is at step 4 and trainer.total_steps = 4: nothing to "
                             "train (raise trainer.total_steps to go on)\n")


def test_config_show_reads_sft_configs(tmp_path):
    """A file with an [sft] table is an SFT config: shown, validated for --world-size and read back by spmdrl.sft."""
    from spmdrl.sft import SFTConfig

    sft_toml = os.path.join(REPO, "configs", "quickstart", "sft.toml")
    result = run("config", "show", "--config", sft_toml, "sft.lr=2e-4", "--world-size", "2")
    assert result.exit_code == 0, result.output
    assert "# actor: 2 ranks, dp=2" in result.stderr and "[sft]" in result.stdout and "[rollout]" not in result.stdout
    path = tmp_path / "sft.toml"
    path.write_text(result.stdout)
    cfg = load_config(str(path), root_cls=SFTConfig)
    assert cfg.sft.lr == 2e-4 and cfg.sft.max_steps == 350
    assert run("config", "show", "--sft").stdout.startswith("[model]")  # the SFT defaults
    bad = run("config", "show", "--config", sft_toml, "sft.batch_size=63", "--world-size", "2")
    assert bad.exit_code == 2 and bad.stderr.startswith("error: sft.batch_size = 63")
