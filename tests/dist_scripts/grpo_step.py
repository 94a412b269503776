"""Run a short GRPO job through the real Trainer, then check weight sync: vLLM's logprobs on sampled
sequences must equal the actor's own (fp32) after the last sync. Writes <out>/check_rank{r}.json."""
import argparse
import json
import os

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    from spmdrl.config import load_config, validate
    from spmdrl.dist.init import detect_env, init_distributed
    from spmdrl.engines import pack_sequences
    from spmdrl.rollout import SamplingSpec
    from spmdrl.loop.trainer import Trainer

    cfg = load_config(None, args.overrides)
    env = detect_env()
    layout = validate(cfg, env.world_size)
    env, device = init_distributed(cfg.trainer.device)
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
    with open(os.path.join(args.out, f"check_rank{env.rank}.json"), "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    from spmdrl.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
