"""Supervised warm start on the RL training engine: `torchrun ... -m spmdrl.sft --config sft.toml`.

Trains the policy on prompt/response parquet (loss on response tokens only) or on whole conversations (a
`messages` column; loss on the assistant turns only, e.g. tool-call demonstrations) with the same FSDP2 engine
the RL loop uses, and saves an HF model directory that an RL config's model.path can load.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from spmdrl.config.schema import SFTConfig, SFTSection  # noqa: F401  (the SFT config lives with the others)
from spmdrl.errors import ConfigError

log = logging.getLogger("spmdrl")


def validate_sft(cfg: SFTConfig, world_size: int):
    from spmdrl.dist.layout import plan_layout
    from spmdrl.config.validate import require_model_path
    from spmdrl.trackers import check_backends

    s = cfg.sft
    check_backends(cfg.logging)
    if cfg.logging.verbosity not in ("info", "debug"):
        raise ConfigError(f"logging.verbosity = {cfg.logging.verbosity!r} is not one of info, debug")
    require_model_path(cfg)
    if not s.train_files:
        raise ConfigError("sft.train_files is empty; give parquet files with prompt and response columns (or a "
                          "messages column)")
    for key in ("max_length", "epochs", "batch_size", "micro_batch_size"):
        if getattr(s, key) <= 0:
            raise ConfigError(f"sft.{key} must be > 0, found {getattr(s, key)}")
    if s.lr <= 0:
        raise ConfigError(f"sft.lr must be > 0, found {s.lr}")
    if cfg.placement.actor_sp != 1:
        raise ConfigError(f"placement.actor_sp = {cfg.placement.actor_sp}: spmdrl sft trains without sequence "
                          "parallelism; set placement.actor_sp = 1")
    if s.freeze_vision_tower and os.path.isdir(cfg.model.path):
        from spmdrl.config.validate import no_vision_tower
        from spmdrl.models.model import load_hf_config
        from spmdrl.models.vision import is_vision_language

        hf_config = load_hf_config(cfg.model.path, cfg.model.trust_remote_code)
        if not is_vision_language(hf_config):
            raise ConfigError(no_vision_tower("sft.freeze_vision_tower", f"model.path = {cfg.model.path!r}",
                                              getattr(hf_config, "model_type", None)))
    layout = plan_layout(cfg.placement, world_size)
    dp = layout["actor"].dp
    if s.batch_size % dp or (s.batch_size // dp) % s.micro_batch_size:
        raise ConfigError(
            f"sft.batch_size = {s.batch_size} must split into {dp} data-parallel ranks of whole micro-batches "
            f"of sft.micro_batch_size = {s.micro_batch_size}"
        )
    return layout


def run_sft(cfg: SFTConfig, layout, rank: int, device: torch.device) -> str:
    from transformers import AutoTokenizer

    from spmdrl.data.images import VisionPrompts
    from spmdrl.data.sampler import DistributedPromptSampler
    from spmdrl.data.sft import SFTDataset
    from spmdrl.dist.collectives import reduce_sum
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine, pack_sequences
    from spmdrl.metrics import logger_for
    from spmdrl.models.model import load_hf_config
    from spmdrl.models.vision import is_vision_language
    from spmdrl.rng import seed_everything

    s = cfg.sft
    seed_everything(cfg.trainer.seed)
    mesh = RoleMeshes(layout, rank, device.type)["actor"]
    tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    hf_config = load_hf_config(cfg.model.path, cfg.model.trust_remote_code)
    vision = VisionPrompts(cfg.model.path, tok, hf_config) if is_vision_language(hf_config) else None
    ds = SFTDataset(s.train_files, tok, s.max_length, s.prompt_key, s.response_key, s.truncation,
                    messages_key=s.messages_key, tools_key=s.tools_key, vision=vision, image_key=s.image_key)
    sampler = DistributedPromptSampler(len(ds), dp_rank=mesh.dp_rank, dp_size=mesh.dp_size, batch_size=s.batch_size, seed=cfg.trainer.seed)
    total = s.max_steps or s.epochs * sampler.steps_per_epoch
    engine = build_train_engine(
        "fsdp", cfg.model.path, mesh, device, trainable=True, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code,
        gradient_checkpointing=cfg.model.gradient_checkpointing, total_steps=total, attn_implementation=cfg.model.attn_implementation,
        optim=dict(lr=s.lr, weight_decay=s.weight_decay, warmup_steps=s.warmup_steps, lr_scheduler=s.lr_scheduler, grad_clip=s.grad_clip),
        **({"freeze_vision_tower": True} if s.freeze_vision_tower else {}),
    )
    logger = logger_for(cfg, rank, resume=False, progress_total=total)
    dp_group = mesh.group("dp")
    for step in range(1, total + 1):
        t0 = time.perf_counter()
        rows = next(sampler)
        items = [ds[i] for i in rows]
        # everything from the first trained token on is the "response" of the engine's batch; the loss mask
        # within it is 1 on trained tokens only (a conversation's user and tool turns in between stay 0)
        first = [x["loss_mask"].index(1) for x in items]
        prompts = [torch.tensor(x["input_ids"][:f]) for x, f in zip(items, first)]
        resps = [torch.tensor(x["input_ids"][f:]) for x, f in zip(items, first)]
        masks = [torch.tensor(x["loss_mask"][f:]) for x, f in zip(items, first)]
        n_tokens = float(reduce_sum(torch.tensor([float(sum(int(m.sum()) for m in masks))]), group=dp_group)[0])
        vision = [x["vision"] for x in items] if vision is not None else None  # a prompt's images, or None
        micro = []
        for i in range(0, len(items), s.micro_batch_size):
            tb = pack_sequences(prompts[i: i + s.micro_batch_size], resps[i: i + s.micro_batch_size], ds.pad_id,
                                vision=vision[i: i + s.micro_batch_size] if vision is not None else None)
            for b, m in enumerate(masks[i: i + s.micro_batch_size]):
                tb.resp_mask[b, : len(m)] = m
            micro.append(tb)

        def loss_fn(tb, eng):
            logp, _ = eng.logprobs(tb)
            mask = tb.resp_mask.to(logp.device)
            nll = -(logp * mask).sum()
            return nll / n_tokens * mesh.dp_size, {"sft/loss": nll.detach() / n_tokens}

        out = engine.train_step(micro, loss_fn)
        # per-token NLL of the whole step: the micro-batches' shares summed over micro-batches and ranks
        m = {"sft/loss": float(reduce_sum(torch.tensor([out["sft/loss"] * len(micro)]), group=dp_group)[0]),
             "sft/grad_norm": out["grad_norm"], "sft/lr": out["lr"], "timing/step_s": time.perf_counter() - t0}
        logger.log(step, m)
    save_dir = s.save_dir or os.path.join(cfg.trainer.output_dir, "hf_model")
    engine.export_hf(save_dir, tokenizer=tok)
    logger.close()
    if rank == 0:
        log.info("saved the SFT model to %s", save_dir)
    return save_dir


def main(argv=None) -> int:
    from spmdrl.hub import localise_models
    from spmdrl.train import run_entry

    def run(cfg, layout, env, device):  # hub ids -> node-local snapshot directories, one download per node
        run_sft(localise_models(cfg), layout, env.rank, device)

    return run_entry(argv, prog="spmdrl.sft", description=__doc__.split("\n\n")[0], root_cls=SFTConfig,
                     validate_fn=validate_sft, run_fn=run)


if __name__ == "__main__":
    from spmdrl.process.launcher import run_as_process

    run_as_process(main)
