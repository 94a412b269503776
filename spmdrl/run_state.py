"""The Trainer's checkpoint and fault glue (docs/reliability.md): save, resume, bad steps, test faults."""
from __future__ import annotations

import copy
import logging
import os

import torch

from spmdrl.checkpoint import latest_checkpoint
from spmdrl.config import to_toml
from spmdrl.dist.collectives import reduce_sum
from spmdrl.errors import SpmdrlError
from spmdrl.faults import FAULT_ENV, inject_fault, injected_fault, is_bad_step
from spmdrl.metrics import StageTimer
from spmdrl.rewards.custom import GuardedReward
from spmdrl.rng import rng_state, seed_everything, set_rng_state

log = logging.getLogger("spmdrl")


class RunState:
    def engines(self) -> dict:
        """The trainable engines a checkpoint holds (none on a split layout's rollout ranks)."""
        if self.actor is None:
            return {}
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def save_checkpoint(self) -> str:
        in_flight = None
        if self.split:  # split placement: batches already generated for the next steps go into the checkpoint
            # (taken in first: the training ranks' sampler counts their draws, and the writer saves its state)
            if self.trains:
                in_flight = self.stream.in_flight(self.global_step)
            else:
                self.stream.load_due_weights(StageTimer())
        state = {
            "sampler": self.sampler.state_dict(), "bad_steps": self.bad_steps, "bad_steps_total": self.bad_steps_total,
            "kl_ctrl": self.kl_ctrl.state_dict(),
        }

        def hf_files(out_dir: str) -> None:  # what `spmdrl export` needs besides the weights
            config = copy.deepcopy(self.actor.hf_config())
            config.use_cache = True  # the engine turns the KV cache off for training; an exported model wants it
            config.save_pretrained(out_dir)
            self.tokenizer.save_pretrained(out_dir)

        return self.checkpoints.save(self.global_step, engines=self.engines(), trainer_state=state,
                                     config_toml=to_toml(self.cfg), rng=rng_state(), hf_files=hf_files,
                                     rank_tensors=in_flight)

    def load_checkpoint(self, path: str) -> None:
        """Restore everything a step depends on, so the run continues exactly as if it had not stopped."""
        state = self.checkpoints.load(path, engines=self.engines(), config_toml=to_toml(self.cfg))
        self.sampler.load_state_dict(state["sampler"])
        self.global_step = int(state["step"])
        self.bad_steps, self.bad_steps_total = int(state.get("bad_steps", 0)), int(state.get("bad_steps_total", 0))
        if state.get("kl_ctrl") is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.weight_sync()
        if self.split:
            if self.trains and self.cfg.trainer.max_staleness and "rank_tensors" not in state:
                raise SpmdrlError(f"checkpoint {state.get('path', path)} has no in-flight batches for rank {self.rank}: "
                                  "a split run with trainer.max_staleness > 0 resumes on the same world size only")
            self.stream.restore(self.global_step, state.get("rank_tensors", {}))
        if self.trains and self.global_step > self.cfg.trainer.critic_warmup:
            self.actor_version = self.global_step
        if "rng" in state:
            set_rng_state(state["rng"])
        else:  # another world size: per-rank RNG streams cannot carry over
            seed_everything(self.cfg.trainer.seed + self.global_step)
            log.warning("resumed on a different world size: RNG states reseeded, not restored")
        log.info("resumed from %s at step %d", state.get("path", path), self.global_step)

    def inject_test_fault(self, step: int) -> None:
        """Test-only: the fault env SPMDRL_FAULT_INJECT asks of this rank at this step (spmdrl.faults)."""
        if FAULT_ENV in os.environ:
            inject_fault(injected_fault(self.rank, step), self.rank, step, self.actor)

    def reward_error_metrics(self) -> dict[str, float]:
        """reward/errors and reward/timeouts of this step, summed over ranks (reward.on_error = zero). Every
        sample is scored on exactly one rank (tp groups split the scoring), so every rank's count adds."""
        if not isinstance(self.reward_fn, GuardedReward) or self.reward_fn.on_error != "zero":
            return {}
        errors, timeouts = self.reward_fn.take_counts()
        t = reduce_sum(torch.tensor([float(errors), float(timeouts)]))
        return {"reward/errors": float(t[0]), "reward/timeouts": float(t[1])}

    def count_bad_step(self, metrics: dict[str, float]) -> bool:
        """A step with a non-finite loss or grad norm was skipped by the engine; count it (metrics agree on
        every rank, so every rank counts the same)."""
        bad = is_bad_step(metrics)
        self.bad_steps = self.bad_steps + 1 if bad else 0
        self.bad_steps_total += int(bad)
        metrics["train/bad_steps"] = float(self.bad_steps_total)
        return bad

    def check_bad_steps(self) -> None:
        limit = self.cfg.trainer.max_bad_steps
        if self.bad_steps >= limit:
            last = latest_checkpoint(self.checkpoints.root)
            raise SpmdrlError(
                f"{self.bad_steps} consecutive steps (up to step {self.global_step}) had a non-finite loss or grad "
                f"norm and were skipped (trainer.max_bad_steps = {limit}); the last good checkpoint is "
                f"{last or 'none (none was saved)'}; lower actor.lr or check the data and reward of those steps"
            )
