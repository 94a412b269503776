"""Entry point: `torchrun --nproc-per-node N -m spmdrl.train --config F.toml [section.key=value ...]`.

Also runs as plain `python -m spmdrl.train ...` (a world of one) and under `srun` without torchrun.
Config errors are raised on every rank before any process group, model or engine exists.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from spmdrl.errors import SpmdrlError


def setup_logging(rank: int) -> None:
    # vLLM logs every engine call at INFO; keep its warnings and errors only unless the user asks for more
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
    )
    for noisy in ("vllm", "transformers", "torch.distributed", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_entry(argv, *, prog: str, description: str, root_cls, validate_fn, run_fn) -> int:
    """The shared shape of an entry point: parse, load + validate the config (before any process group;
    only rank 0 prints the error), init dist, run_fn(cfg, layout, env, device), tear down. Exit 2 on a
    user error."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", "-c", default=None, help="TOML config file")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = p.parse_args(argv)
    from spmdrl.config.loader import load_config
    from spmdrl.dist.init import destroy_distributed, detect_env, init_distributed

    env = detect_env()
    setup_logging(env.rank)
    try:
        cfg = load_config(args.config, args.overrides, root_cls=root_cls)
        layout = validate_fn(cfg, env.world_size)
    except SpmdrlError as e:
        if env.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    env, device = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    logging.getLogger("spmdrl").info(
        "%s: %d rank(s) via %s on %s; output %s", prog, env.world_size, env.launcher, device.type, cfg.trainer.output_dir
    )
    try:
        run_fn(cfg, layout, env, device)
    except SpmdrlError as e:
        print(f"error (rank {env.rank}): {e}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    return 0


def main(argv=None) -> int:
    from spmdrl.config import Config, validate

    def run(cfg, layout, env, device):
        from spmdrl.trainer import Trainer

        Trainer(cfg, layout, env.rank, env.world_size, device).fit()

    return run_entry(argv, prog="spmdrl.train", description=__doc__.split("\n\n")[0], root_cls=Config,
                     validate_fn=validate, run_fn=run)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
