"""Run the real Trainer like `python -m spmdrl.train`, then (rank 0) dump the final actor's log-probs of a few
fixed sequences to <out>/actor_logprobs.json, for the export test to compare against."""
import argparse
import json
import os
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    from spmdrl.config import load_config, validate
    from spmdrl.dist.init import detect_env, init_distributed
    from spmdrl.engines.fsdp import pack_sequences
    from spmdrl.errors import SpmdrlError
    from spmdrl.train import setup_logging
    from spmdrl.trainer import Trainer

    cfg = load_config(None, args.overrides)
    env = detect_env()
    setup_logging(env.rank)
    layout = validate(cfg, env.world_size)
    env, device = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    try:
        trainer = Trainer(cfg, layout, env.rank, env.world_size, device)
        trainer.fit()
    except SpmdrlError as e:
        print(f"error (rank {env.rank}): {e}", file=sys.stderr, flush=True)
        return 2
    prompts = [trainer.train_ds.prompt_ids(i) for i in range(4)]
    responses = [trainer.tokenizer.encode(t, add_special_tokens=False) for t in ("46", "1+1=2", "x", "99 is it")]
    tb = pack_sequences([torch.tensor(x) for x in prompts], [torch.tensor(r) for r in responses], trainer.pad_id)
    with torch.no_grad():
        trainer.actor.module.eval()
        logp, _ = trainer.actor.logprobs(tb, temperature=1.0)
    if env.rank == 0:
        with open(os.path.join(args.out, "actor_logprobs.json"), "w") as f:
            json.dump({"prompts": prompts, "responses": responses,
                       "logprobs": [logp[i, : len(r)].tolist() for i, r in enumerate(responses)]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
