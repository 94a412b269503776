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


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="spmdrl.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", default=None, help="TOML config file")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from spmdrl.dist.init import detect_env

    env = detect_env()
    setup_logging(env.rank)
    log = logging.getLogger("spmdrl")
    try:
        from spmdrl.config import load_config, validate

        cfg = load_config(args.config, args.overrides)
        layout = validate(cfg, env.world_size)
    except SpmdrlError as e:
        if env.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2

    from spmdrl.dist.init import destroy_distributed, init_distributed
    from spmdrl.trainer import Trainer

    env, device = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    log.info("spmdrl: %d rank(s) via %s on %s; output %s", env.world_size, env.launcher, device.type, cfg.trainer.output_dir)
    try:
        trainer = Trainer(cfg, layout, env.rank, env.world_size, device)
        trainer.fit()
    except SpmdrlError as e:
        print(f"error (rank {env.rank}): {e}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
