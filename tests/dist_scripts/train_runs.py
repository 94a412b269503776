"""Several short training runs in one launch, one after another in this process and its process group: config,
validation, preflight, Trainer and fit as spmdrl.train does them, each run's rollout engine closed before the
next is built. The runs share one interpreter start and one process group (torch, vLLM and transformers
imported once), which is most of a tiny run's time on CPU.

    python -m torch.distributed.run ... train_runs.py RUNS.json

RUNS.json: a list of {"overrides": [...], "env": {...}} (env: variables set for that run only). Each run's exit
code goes to <its trainer.output_dir>/rc (0, 2 for a user error); a failing run does not stop the next."""
import json
import os
import sys

from run_env import run_env


def main() -> int:
    from spmdrl.config import Config, load_config, validate
    from spmdrl.dist.init import detect_env, init_distributed
    from spmdrl.errors import SpmdrlError
    from spmdrl.loop.trainer import Trainer
    from spmdrl.train import train_preflight

    rank, world_size = detect_env().rank, detect_env().world_size
    device = None
    for spec in json.load(open(sys.argv[1])):
        with run_env(spec.get("env", {})):
            cfg = load_config(None, spec["overrides"], root_cls=Config)
            cfg.trainer.output_dir = os.path.abspath(cfg.trainer.output_dir)
            rc = 0
            try:
                layout = validate(cfg, world_size)
                train_preflight(cfg, rank, world_size)
                if device is None:  # one process group for every run
                    _, device = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
                trainer = Trainer(cfg, layout, rank, world_size, device)
                try:
                    trainer.fit()
                finally:
                    if trainer.rollout is not None:  # the next run builds its own engine
                        trainer.rollout.close()
            except SpmdrlError as e:
                print(f"[rank{rank}] error: {e}", file=sys.stderr, flush=True)
                rc = 2
        if rank == 0:
            os.makedirs(cfg.trainer.output_dir, exist_ok=True)
            with open(os.path.join(cfg.trainer.output_dir, "rc"), "w") as f:
                f.write(str(rc))
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
