"""Run a short GRPO job through the real Trainer, then check weight sync: vLLM's logprobs on sampled
sequences must equal the actor's own (fp32) after the last sync. Writes <out>/check_rank{r}.json. With --runs,
several such jobs one after another in one process and process group (one interpreter start)."""
import argparse
import json
import os

import torch
from run_env import run_env


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", help="one run: its check files go here")
    p.add_argument("--runs", help="several runs, one after another in this process and process group: a JSON file "
                                  "of [{\"out\": ..., \"overrides\": [...], \"env\": {...}}]")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    from spmdrl.config import load_config, validate
    from spmdrl.dist.init import detect_env, init_distributed

    runs = json.load(open(args.runs)) if args.runs else [{"out": args.out, "overrides": args.overrides}]
    device = None
    for spec in runs:
        with run_env(spec.get("env", {})):
            cfg = load_config(None, spec["overrides"])
            layout = validate(cfg, detect_env().world_size)
            if device is None:
                env, device = init_distributed(cfg.trainer.device)
            trainer = one_run(cfg, layout, env, device, spec["out"])
            if len(runs) > 1:
                trainer.rollout.close()  # the next run builds its own engine
    return 0


def one_run(cfg, layout, env, device, out_dir):
    from spmdrl.engines import pack_sequences
    from spmdrl.loop.trainer import Trainer
    from spmdrl.rollout import SamplingSpec

    trainer = Trainer(cfg, layout, env.rank, env.world_size, device)
    before = {k: v.clone() for k, v in trainer.actor.full_state_dict().items()}
    trainer.fit()
    after = trainer.actor.full_state_dict()
    changed = max(float((after[k] - before[k]).abs().max()) for k in after)

    # weight sync: sample with the synced engine, score the same tokens with the actor
    prompts = [trainer.train_ds.prompt_ids(i) for i in range(4)]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=8, stop_token_ids=[trainer.tokenizer.eos_token_id])
    out = trainer.rollout.generate(prompts, spec, [11, 12, 13, 14])
    tb = pack_sequences([torch.tensor(prompts[i // 2]) for i in range(8)],
                        [torch.tensor(r) for r in out.response_ids], trainer.pad_id)
    with torch.no_grad():
        logp, _ = trainer.actor.logprobs(tb, temperature=1.0)
    diff = 0.0
    for i, lps in enumerate(out.logprobs):
        diff = max(diff, float((logp[i, : len(lps)] - torch.tensor(lps)).abs().max()) if lps else 0.0)
    res = {"weight_sync_max_diff": diff, "param_change": changed, "responses": out.response_ids,
           "n_tokens": sum(len(r) for r in out.response_ids)}
    with open(os.path.join(out_dir, f"check_rank{env.rank}.json"), "w") as f:
        json.dump(res, f)
    return trainer


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
