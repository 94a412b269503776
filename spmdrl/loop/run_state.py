"""What a run carries from step to step besides the models (docs/reliability.md): its checkpoints (save and
exact resume) and its count of bad steps."""
from __future__ import annotations

import copy
import logging
import signal
import time

from spmdrl.checkpoint import CheckpointManager, latest_checkpoint
from spmdrl.config import to_toml
from spmdrl.data.sampler import DistributedPromptSampler
from spmdrl.errors import SpmdrlError, Stopped
from spmdrl.faults import at_step_boundary, is_bad_step
from spmdrl.loop.memory import MemoryLifecycle
from spmdrl.loop.partial import PartialRollouts
from spmdrl.loop.split import BatchStream
from spmdrl.models.vision import copy_image_processor
from spmdrl.reshard.sync import WeightSync
from spmdrl.rng import rng_state, seed_everything, set_rng_state

log = logging.getLogger("spmdrl")


class BadSteps:
    """Steps with a non-finite loss or grad norm (the engine skipped their update): consecutive and total
    counts; trainer.max_bad_steps in a row stop the run."""

    def __init__(self, limit: int, checkpoint_root: str):
        self.limit, self.checkpoint_root = limit, checkpoint_root
        self.consecutive = self.total = 0

    def count(self, metrics: dict[str, float]) -> bool:
        """Count the step whose metrics these are (they agree on every rank, so every rank counts the same);
        adds train/bad_steps. True when the step was bad."""
        bad = is_bad_step(metrics)
        self.consecutive = self.consecutive + 1 if bad else 0
        self.total += int(bad)
        metrics["train/bad_steps"] = float(self.total)
        return bad

    def check(self, step: int) -> None:
        """Raise once trainer.max_bad_steps steps in a row were bad, naming the last good checkpoint."""
        if self.consecutive >= self.limit:
            last = latest_checkpoint(self.checkpoint_root)
            raise SpmdrlError(
                f"{self.consecutive} consecutive steps (up to step {step}) trained nothing (a non-finite loss or "
                f"grad norm, no finite reward, or every token rejected by [rollout_correction]; see the warnings "
                f"above) (trainer.max_bad_steps = {self.limit}); the last good checkpoint is "
                f"{last or 'none (none was saved)'}; lower actor.lr or check the data, reward and rollout_correction"
            )

    def state_dict(self) -> dict[str, int]:
        return {"bad_steps": self.consecutive, "bad_steps_total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive, self.total = int(state.get("bad_steps", 0)), int(state.get("bad_steps_total", 0))


class RunCheckpointer:
    """Saves everything a step depends on and restores it, so a resumed run continues exactly as if it had not
    stopped: the trainable engines (through `manager`), the sampler, the KL controller, the bad-step counts, the
    RNG states, in split placement the batches in flight (`stream`, on the training ranks) and with rollout.partial
    the requests in flight (`partial`, on every rank that holds a rollout engine: each saves its own, suspended
    first; loop/partial.py). engines: {"actor": ..., "critic": ...} (empty on a split layout's rollout ranks)."""

    def __init__(self, cfg, manager: CheckpointManager, engines: dict, tokenizer, sampler: DistributedPromptSampler,
                 kl_ctrl, bad_steps: BadSteps, weight_sync: WeightSync, stream: BatchStream | None, rank: int,
                 config_toml: str | None = None, memory: MemoryLifecycle | None = None,
                 partial: PartialRollouts | None = None):
        self.cfg, self.manager, self.engines, self.tokenizer, self.sampler = cfg, manager, engines, tokenizer, sampler
        self.config_toml = to_toml(cfg) if config_toml is None else config_toml  # what checkpoints record and compare
        self.kl_ctrl, self.bad_steps, self.weight_sync, self.stream, self.rank = kl_ctrl, bad_steps, weight_sync, stream, rank
        self.memory, self.partial = memory, partial
        # every rank saves and loads the same engine names, whichever of them it holds (split placement)
        self.roles = ["actor", "critic"] if cfg.critic.enable else ["actor"]
        self.last_save = time.monotonic()  # checkpoint.save_every_min counts from the start, then from each save

    def since_save(self) -> float:
        """Seconds since the last save (or the start) on this rank's clock."""
        return time.monotonic() - self.last_save

    def due(self, step: int, done: bool, since_save_s: float) -> bool:
        """Whether to save after `step`: checkpoint.save_freq's steps and the end, or checkpoint.save_every_min
        minutes since the last save. since_save_s: `since_save()` as the step's metric reduction agreed on it (the
        ranks' mean, the same number on every rank), so every rank decides alike without a collective of its own."""
        ck = self.cfg.checkpoint
        if ck.save_freq < 0:
            return False
        if done or (ck.save_freq > 0 and step % ck.save_freq == 0):
            return True
        return ck.save_every_min > 0 and since_save_s >= 60 * ck.save_every_min

    def grace_s(self) -> float:
        """How long a stop signal waits for the step to end and be saved (0: it stops at once); never saving
        (checkpoint.save_freq = -1) means stopping at once."""
        ck = self.cfg.checkpoint
        return 0.0 if ck.save_freq < 0 else ck.grace_s

    def stop_agreed(self) -> int:
        """At the step boundary: the stop signal any rank got (one all-reduce of two numbers), else 0."""
        return self.manager.agree_stop(at_step_boundary())

    def stopped(self, signum: int, step: int, saved: str | None) -> Stopped:
        """The one line of a run stopped at the boundary after `step`: the checkpoint saved, and how to resume."""
        name = signal.Signals(signum).name
        if saved:
            return Stopped(f"stopped by {name} after step {step}: saved checkpoint {saved}; relaunch the same command "
                           "to resume from it", signum)
        from spmdrl.checkpoint import resume_advice

        return Stopped(f"stopped by {name} after step {step}, which trained nothing (a bad step) and was not saved; "
                       f"{resume_advice(self.cfg.trainer.output_dir)}", signum)

    def save(self, step: int) -> str:
        """The checkpoint after `step`; its path."""
        in_flight = {}
        if self.partial is not None:  # rollout.partial: this rank's requests in flight, taken out of the engine to go
            # on as continuations in the next rollout, here and in a run resumed from this checkpoint alike
            self.partial.suspend()
            in_flight.update(self.partial.state_tensors())
        if self.stream is not None and self.engines:  # split placement: batches already generated for the next
            # steps go into the checkpoint (the training ranks took them in during the step: their sampler counted
            # those draws, and the writer saves its state)
            in_flight.update(self.stream.in_flight(step))
        state = {"sampler": self.sampler.state_dict(), **self.bad_steps.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict()}

        def hf_files(out_dir: str) -> None:  # what `spmdrl export` needs besides the weights
            config = copy.deepcopy(self.engines["actor"].hf_config())
            config.use_cache = True  # the engine turns the KV cache off for training; an exported model wants it
            config.save_pretrained(out_dir)
            self.tokenizer.save_pretrained(out_dir)
            copy_image_processor(self.cfg.model.path, out_dir)  # a vision-language model's, for spmdrl export

        if self.memory is not None:  # vLLM asleep (weights kept), configured state parked: spmdrl/loop/memory.py
            self.memory.for_checkpoint("checkpoint_save", keep_rollout_weights=True)
        self.last_save = time.monotonic()
        return self.manager.save(step, engines=self.engines, trainer_state=state, config_toml=self.config_toml,
                                 rng=rng_state(), hf_files=hf_files, rank_tensors=in_flight or None, roles=self.roles)

    def load(self, path: str) -> int:
        """Restore the run from checkpoint `path` and sync its actor weights to the rollout engine; the step it
        was saved after."""
        if self.memory is not None:  # vLLM asleep (its weights are about to be replaced), configured state parked
            self.memory.for_checkpoint("resume", keep_rollout_weights=False)
        state = self.manager.load(path, engines=self.engines, config_toml=self.config_toml)
        self.sampler.load_state_dict(state["sampler"])
        step = int(state["step"])
        self.bad_steps.load_state_dict(state)
        if state.get("kl_ctrl") is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.memory is not None:
            self.memory.for_sync()
        self.weight_sync()
        tensors = state.get("rank_tensors", {})
        if self.partial is not None:  # after the sampler: this rank's own sampler state comes with its requests
            if any(k.startswith("partial/") for k in tensors):
                self.partial.load_state_tensors(tensors, f"checkpoint {state.get('path', path)} (rank {self.rank})")
            else:
                log.warning("checkpoint %s does not hold the requests in flight of this rank (%d) (another world "
                            "size, or saved without them): the partial rollouts start with an empty engine, so this "
                            "resume is not exact", state.get("path", path), self.rank)
        if self.stream is not None:
            if self.engines and self.cfg.trainer.max_staleness and "rank_tensors" not in state:
                raise SpmdrlError(f"checkpoint {state.get('path', path)} has no in-flight batches for rank {self.rank}: "
                                  "a split run with trainer.max_staleness > 0 resumes on the same world size only")
            self.stream.restore(step, {k: v for k, v in tensors.items() if not k.startswith("partial/")})
        if "rng" in state:
            set_rng_state(state["rng"])
        else:  # another world size: per-rank RNG streams cannot carry over
            seed_everything(self.cfg.trainer.seed + step)
            log.warning("resumed on a different world size: RNG states reseeded, not restored")
        log.info("resumed from %s at step %d", state.get("path", path), step)
        return step
