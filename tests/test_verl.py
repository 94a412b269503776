"""Coming from verl: `spmdrl config from-verl` (a verl command line and a YAML into a TOML config that loads),
verl keys on spmdrl's command line answered with their spmdrl names, and docs/verl.md's key table."""
import os

import pytest
from typer.testing import CliRunner

from spmdrl.cli import app
from spmdrl.config import load_config
from spmdrl.config.verl import KEY_MAP, key_table

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
runner = CliRunner()


def test_from_verl_converts_a_command_line_and_a_yaml_into_a_config_that_loads(tmp_path):
    (tmp_path / "ppo.yaml").write_text(
        "data:\n  train_files: ~/data/train.parquet\n  max_prompt_length: 512\n  tokenizer: null\n"
        "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-06\n    ppo_micro_batch_size_per_gpu: 4\n"
        "  rollout:\n    n: 5\n    val_kwargs:\n      temperature: 0\ntrainer:\n  total_epochs: 3\n  critic_warmup: 2\n"
        "  resume_mode: disable\nalgorithm:\n  adv_estimator: gae\n")
    out = tmp_path / "run.toml"
    r = runner.invoke(app, ["config", "from-verl", "--yaml", str(tmp_path / "ppo.yaml"), "-o", str(out), "python3",
                            "-m", "verl.trainer.main_ppo", "actor_rollout_ref.actor.optim.lr=3e-6",
                            "actor_rollout_ref.actor.fsdp_config.param_offload=True", "actor_rollout_ref.model.lora_rank=32",
                            "trainer.logger=[console,wandb]", "+trainer.val_only=True", "trainer.nnodes=2",
                            "custom_reward_function.path=my_reward.py", "x.y=1"])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    cfg = load_config(str(out))
    assert cfg.data.train_files == ["~/data/train.parquet"] and cfg.data.max_prompt_length == 512
    assert cfg.actor.lr == 3e-6 and cfg.actor.micro_batch_size == 4  # the command line wins over the YAML
    assert cfg.rollout.n == 5 and cfg.rollout.val_temperature == 0.0
    assert cfg.trainer.total_epochs == 3 and cfg.trainer.critic_warmup == 2 and cfg.checkpoint.resume == "off"
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable  # gae needs the critic
    assert cfg.memory.actor_offload == ["params"]
    assert cfg.lora.enable and cfg.lora.rank == 32
    assert cfg.logging.backends == ["tensorboard", "jsonl", "wandb"]
    assert cfg.reward.custom_fn == "my_reward.py:compute_score"
    assert "# not converted: trainer.val_only = True: run `spmdrl eval --config F` instead" in text
    assert "# not converted: trainer.nnodes = 2: launch on each node" in text
    assert "# not converted: x.y = 1 (no spmdrl key known" in text
    assert "# 1 other keys of the YAML have no spmdrl name" in text  # data.tokenizer


def test_a_verl_key_on_the_command_line_gets_its_spmdrl_name():
    r = runner.invoke(app, ["config", "show", "--config", os.path.join(REPO, "configs", "grpo.toml"),
                            "actor_rollout_ref.actor.optim.lr=1e-6"])
    assert r.exit_code == 2
    assert r.stderr == ("error: override 'actor_rollout_ref.actor.optim.lr=1e-6': that is verl's key; spmdrl's is "
                        "actor.lr (docs/verl.md; `spmdrl config from-verl` converts a whole verl command line)\n")
    r = runner.invoke(app, ["config", "show", "+trainer.val_only=True"])
    assert "that is verl's key; run `spmdrl eval --config F` instead" in r.stderr
    r = runner.invoke(app, ["config", "show", "a.b.c=1"])
    assert "coming from verl, see docs/verl.md or `spmdrl config from-verl`" in r.stderr


def test_docs_verl_md_has_every_key_of_the_map():
    doc = open(os.path.join(REPO, "docs", "verl.md"), encoding="utf-8").read()
    assert key_table() in doc
    for key in ("trainer.critic_warmup", "trainer.total_epochs", "trainer.val_only", "trainer.log_val_generations",
                "trainer.rollout_data_dir"):
        assert key in KEY_MAP
