"""Evaluation only: `torchrun ... -m spmdrl.evaluate --config F.toml [section.key=value ...]` (`spmdrl eval`).

Validates the model at model.path on data.val_files with the training run's rollout engine, sampling settings
(rollout.val_*), reward and validation code: accuracy per data source, the reward's mean, and with
logging.log_generations the first samples. Builds no training engine (no actor, ref or critic; a reward model
only when reward.model_path is set). Writes trainer.output_dir/eval.json and, with logging.log_generations,
generations.jsonl there; `spmdrl eval --checkpoint` exports a checkpoint's policy first (spmdrl.export).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

import torch

from spmdrl.errors import ConfigError

log = logging.getLogger("spmdrl")

EVAL_FILE = "eval.json"


def validate_eval(cfg, world_size: int):
    """The training config's checks, with data.val_files required and data.train_files not (they are never read)."""
    from spmdrl.config import validate
    from spmdrl.config.validate import PARQUET_FILES

    if not cfg.data.val_files:
        raise ConfigError(f"data.val_files is empty: spmdrl eval validates on them; give {PARQUET_FILES} "
                          "(data.val_files='[\"val.parquet\"]')")
    checked = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_files=cfg.data.train_files
                                                                 or cfg.data.val_files))
    return validate(checked, world_size)


def run_eval(cfg, layout, rank: int, device: torch.device) -> dict[str, float]:
    """Build the rollout engine and the scorer, run the validation once (logged as step 0), write eval.json
    (rank 0)."""
    from transformers import AutoTokenizer

    from spmdrl.data.prompts import PromptDataset
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.hooks import HookRunner, StageHooks
    from spmdrl.loop.build import build_agent, build_rollout, build_tools, sampling_specs, tool_schemas
    from spmdrl.loop.generations import GenerationLog
    from spmdrl.loop.memory import MemoryLifecycle
    from spmdrl.loop.scoring import Scorer
    from spmdrl.loop.validate import Validator
    from spmdrl.metrics import MetricsLogger
    from spmdrl.rewards.custom import build_reward_fn
    from spmdrl.rng import seed_everything
    from spmdrl.trackers import selected_backends

    seed_everything(cfg.trainer.seed)
    meshes = RoleMeshes(layout, rank, device.type)
    mesh = meshes["rollout"]
    tok_path = cfg.model.tokenizer_path or cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    d = cfg.data
    tools = build_tools(cfg)
    dataset = PromptDataset(d.val_files, tokenizer, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                            filter_overlong=d.filter_overlong, prompt_key=d.prompt_key,
                            apply_chat_template=d.apply_chat_template, tools=tool_schemas(tools))
    reward_model = None
    if cfg.reward.model_path and meshes["reward"].active:
        from spmdrl.rewards.model import RewardModelScorer

        reward_model = RewardModelScorer(
            cfg.reward.model_path, meshes["reward"], device, tokenizer_path=cfg.reward.model_tokenizer_path,
            policy_tokenizer=tokenizer, micro_batch_size=cfg.reward.model_micro_batch_size,
            trust_remote_code=cfg.model.trust_remote_code, dtype=cfg.model.dtype)
    scorer = Scorer(cfg, tokenizer, build_reward_fn(cfg.reward), reward_model)
    memory = MemoryLifecycle(device, {}, {})
    rollout = memory.rollout = build_rollout(cfg, meshes, device, tok_path, "auto") if mesh.active else None
    seed_everything(cfg.trainer.seed)  # building the engine reseeds the global RNG
    agent = build_agent(cfg, tokenizer, rollout, meshes, tools) if rollout is not None else None
    out = cfg.trainer.output_dir
    os.makedirs(out, exist_ok=True)
    local = [b for b in selected_backends(cfg.logging) if b in ("tensorboard", "jsonl")]  # no tracker run
    logger = MetricsLogger(out, console=cfg.logging.console, rank=rank, append=False, backends=local)
    generations = GenerationLog(cfg.logging, out, rank, logger.log_generations)
    hooks = StageHooks(HookRunner(cfg.hooks.files), cfg, meshes, tokenizer)
    validator = Validator(cfg, mesh, dataset, rollout, memory, sampling_specs(cfg, tokenizer.eos_token_id), scorer,
                          hooks, pad_id, agent=agent, generations=generations)
    try:
        metrics = validator.run(0)
        logger.log(0, metrics)
    finally:
        logger.close()
    if rank == 0:
        with open(os.path.join(out, EVAL_FILE), "w", encoding="utf-8") as f:
            json.dump({"model": cfg.model.path, "val_files": list(d.val_files), "metrics": metrics}, f,
                      indent=1)
        print(format_eval(metrics), flush=True)
    return metrics


def format_eval(metrics: dict[str, float]) -> str:
    """The evaluation's accuracies, one line each, the mean first."""
    keys = ["val/accuracy", "val/reward_mean"] + sorted(k for k in metrics if k.startswith("val/source_accuracy/"))
    return "\n".join(f"{k:<48} {metrics[k]:.4f}" for k in keys if k in metrics)


def main(argv=None) -> int:
    from spmdrl.hub import localise_models
    from spmdrl.train import run_entry

    from spmdrl.config import Config

    def run(cfg, layout, env, device):
        run_eval(localise_models(cfg), layout, env.rank, device)

    return run_entry(argv, prog="spmdrl.evaluate", description=__doc__.split("\n\n")[0], root_cls=Config,
                     validate_fn=validate_eval, run_fn=run)


if __name__ == "__main__":
    from spmdrl.process.launcher import run_as_process

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_as_process(main)
