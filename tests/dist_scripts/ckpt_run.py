"""Run the real Trainer the way `python -m spmdrl.train` does, with two test probes.

--dump: after fit, rank 0 writes the final actor's log-probs of a few fixed sequences to <out>/actor_logprobs.json.
--expect F --resume-from CKPT: build the Trainer (from model.path, with checkpoint.resume=off), record how far
  vLLM's and the actor's log-probs of F's sequences are from F's; load CKPT (Trainer.resume) and record
  it again; then fit. Writes <out>/expect_rank{r}.json.
"""
import argparse
import json
import os
import sys

import torch


def logprobs(trainer, prompts, responses):
    from spmdrl.engines import pack_sequences

    tb = pack_sequences([torch.tensor(x) for x in prompts], [torch.tensor(r) for r in responses], trainer.pad_id)
    with torch.no_grad():
        trainer.actor.module.eval()
        logp, _ = trainer.actor.logprobs(tb, temperature=1.0)
    return [logp[i, : len(r)].tolist() for i, r in enumerate(responses)]


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dump", action="store_true")
    p.add_argument("--expect")
    p.add_argument("--resume-from")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    from spmdrl.config import load_config, validate
    from spmdrl.dist.init import detect_env, init_distributed
    from spmdrl.errors import SpmdrlError
    from spmdrl.train import setup_logging
    from spmdrl.loop.trainer import Trainer

    cfg = load_config(None, args.overrides)
    env = detect_env()
    setup_logging(env.rank)
    layout = validate(cfg, env.world_size)
    env, device = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    try:
        trainer = Trainer(cfg, layout, env.rank, env.world_size, device)
        if args.expect:
            want = json.load(open(args.expect))
            P, R = want["prompts"], want["responses"]
            trainer.rollout.wake_up()
            res = {"export_vllm": max_diff(trainer.rollout.compute_logprobs(P, R), want["logprobs"]),
                   "export_actor": max_diff(logprobs(trainer, P, R), want["logprobs"])}
            trainer.resume(args.resume_from)
            trainer.resumed_from = args.resume_from
            trainer.rollout.wake_up()
            res.update(resumed_vllm=max_diff(trainer.rollout.compute_logprobs(P, R), want["logprobs"]),
                       resumed_actor=max_diff(logprobs(trainer, P, R), want["logprobs"]), step=trainer.global_step)
            trainer.rollout.sleep()
            with open(os.path.join(args.out, f"expect_rank{env.rank}.json"), "w") as f:
                json.dump(res, f)
        trainer.fit()
    except SpmdrlError as e:
        print(f"error (rank {env.rank}): {e}", file=sys.stderr, flush=True)
        return 2
    if args.dump:
        prompts = [trainer.train_ds.prompt_ids(i) for i in range(4)]
        responses = [trainer.tokenizer.encode(t, add_special_tokens=False) for t in ("46", "1+1=2", "x", "99 is it")]
        lp = logprobs(trainer, prompts, responses)
        if env.rank == 0:
            with open(os.path.join(args.out, "actor_logprobs.json"), "w") as f:
                json.dump({"prompts": prompts, "responses": responses, "logprobs": lp}, f)
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
