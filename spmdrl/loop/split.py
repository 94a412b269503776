"""Split placement: the rollout ranks' side of a step, and the stream of batches between the roles.

The rollout ranks and the training ranks run the same program but different stages: per step s the rollout
ranks (`produce`) load the weights the training ranks sent at the end of step s-1, generate the batches up to
step s + k (k = trainer.max_staleness) and post them to the training ranks without waiting; the training
ranks (`receive`) take batch s, train on it and post the new weights. Both meet once per step, at the metric
reduction. With k = 0 batch s is generated with the weights after step s-1 (on-policy, as colocated); with
k = 1 batch s+1 is generated (with the weights after step s-1) while the training ranks update on batch s.

Weight versions: version v is the actor after the update of step v (0: the initial weights); with critic
warmup a step without an actor update keeps the version. Batch s carries, per sample, the version that
generated it (`weight_version`): s-1-k in steady state; the training ranks log the lag
(`train/weight_version_lag` = actor version before the update - batch version; k in steady state).

In flight across a checkpoint: at a checkpoint after step s the training ranks take in every batch the
rollout ranks already posted (steps s+1 .. s+k) and save them with the checkpoint (per rank, safetensors);
a resumed run trains on those and the rollout ranks go on from batch s+k+1, so resume is exact.
"""
from __future__ import annotations

import collections

import torch

from spmdrl.batch import Batch
from spmdrl.data.sampler import DistributedPromptSampler
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.dist.transfer import PendingSends, post_batch, recv_batch
from spmdrl.errors import SpmdrlError
from spmdrl.loop.generate import Generator
from spmdrl.reshard.sync import WeightSync

# every tensor of a rollout batch as it travels (dtype, 2-D?): the receiving ranks build an empty batch of it
ROLLOUT_KEYS = {
    "prompts": (torch.long, True), "prompt_len": (torch.long, False), "responses": (torch.long, True),
    "response_len": (torch.long, False), "response_mask": (torch.float32, True),
    "rollout_log_probs": (torch.float32, True), "index": (torch.long, False), "truncated": (torch.float32, False),
    "uid": (torch.long, False), "weight_version": (torch.long, False),
}


def empty_rollout_batch() -> Batch:
    return Batch({k: torch.zeros((0, 1) if two_d else (0,), dtype=dt) for k, (dt, two_d) in ROLLOUT_KEYS.items()})


class BatchStream:
    """Per step: the rollout ranks produce, the training ranks receive. One object on every rank.

    generator: the rollout ranks' Generator (None on the training ranks); sampler: the prompt sampler (the
    training ranks count the rollout ranks' draws, so a checkpoint saves the rollout's sampler state);
    weight_sync: the actor -> rollout WeightSync (the rollout ranks load what the training ranks posted)."""

    def __init__(self, cfg, meshes: RoleMeshes, generator: Generator | None, sampler: DistributedPromptSampler,
                 weight_sync: WeightSync):
        t = cfg.trainer
        self.k, self.total_steps, self.critic_warmup = t.max_staleness, t.total_steps, t.critic_warmup
        self.samples_per_step = cfg.data.train_batch_size * cfg.rollout.n
        self.meshes, self.generator, self.sampler, self.weight_sync = meshes, generator, sampler, weight_sync
        self.rollout_mesh, self.actor_mesh = meshes["rollout"], meshes["actor"]
        self.next_batch = 1  # rollout ranks: the next step whose batch is generated
        self.version = 0  # rollout ranks: the weight version vLLM holds
        self.weights_due: int | None = None  # rollout ranks: the version the training ranks posted, not yet loaded
        self.sent: collections.deque[tuple[int, PendingSends]] = collections.deque()  # rollout ranks: (step, sends)
        self.inbox: dict[int, tuple[Batch, int]] = {}  # training ranks: batches taken in early (checkpoint) or restored, bytes
        self.batch_bytes = 0  # training ranks: bytes received this step

    # ---- rollout ranks ---------------------------------------------------------------------------------
    def produce(self, step: int, timer) -> dict[str, float]:
        """Load due weights, then generate and post every batch up to step + k (the last step at most)."""
        m = self.load_due_weights(timer)
        last = min(step + self.k, self.total_steps)
        while self.next_batch <= last:
            s = self.next_batch
            with timer("rollout"):
                batch = self.generator.generate(next(self.sampler), s, 0)
            batch["weight_version"] = torch.full((len(batch),), self.version, dtype=torch.long)
            if set(batch.tensors) != set(ROLLOUT_KEYS):  # the training ranks unpack by this list
                raise SpmdrlError(f"a rollout batch has tensors {sorted(batch.tensors)} but spmdrl.loop.split.ROLLOUT_KEYS "
                                  f"lists {sorted(ROLLOUT_KEYS)}: add new rollout tensors there")
            with timer("post_batch"):
                self.sent.append((s, post_batch(batch, self.rollout_mesh, self.actor_mesh, self.meshes.batch_group, tag=s)))
            self.next_batch += 1
        return m

    def load_due_weights(self, timer) -> dict[str, float]:
        """Receive the weights the training ranks posted (if any): before a rollout, validation or a checkpoint."""
        if self.weights_due is None:
            return {}
        with timer("wait_weights"):
            m = self.weight_sync()
        self.version, self.weights_due = self.weights_due, None
        return {"weight_sync/bytes_recv": m["weight_sync/bytes_recv"], "timing/weight_sync_transport_s": m["timing/weight_sync_transport_s"]}

    def after_step(self, step: int, trained: bool) -> None:
        """At the step's meeting point: the training ranks have posted version `step` if they trained, and have
        taken in every batch up to `step` (so those sends are complete)."""
        if not self.rollout_mesh.active:
            return
        if trained:
            self.weights_due = step
        while self.sent and self.sent[0][0] <= step:
            self.sent.popleft()[1].wait()

    # ---- training ranks --------------------------------------------------------------------------------
    def receive(self, step: int) -> Batch:
        """Batch `step` on this training rank: from the inbox, else from the rollout ranks."""
        if step in self.inbox:
            batch, nbytes = self.inbox.pop(step)
        else:
            batch, nbytes = self.fetch(step)
        self.batch_bytes += nbytes
        return batch

    def fetch(self, step: int) -> tuple[Batch, int]:
        """Receive batch `step` from the rollout ranks: (this rank's share, bytes received)."""
        per_src = self.rollout_mesh.dp_share(self.samples_per_step, "rollout samples")
        next(self.sampler)  # count the draw the rollout ranks made for it: the sampler state a checkpoint saves
        return recv_batch(empty_rollout_batch(), self.rollout_mesh, self.actor_mesh, per_src,
                          self.meshes.batch_group, tag=step)

    def in_flight(self, step: int) -> dict[str, torch.Tensor]:
        """Training ranks, at a checkpoint after `step`: take in the batches already posted (steps step+1 ..
        step+k) and return them as flat tensors to save."""
        out = {}
        last = min(step + self.k, self.total_steps)
        for s in range(step + 1, last + 1):
            if s not in self.inbox:
                self.inbox[s] = self.fetch(s)  # its bytes count in the step that trains on it
            out.update({f"{s}/{k}": v.contiguous() for k, v in self.inbox[s][0].tensors.items()})
        return out

    def restore(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """After a resume at `step`: training ranks get their saved in-flight batches back; rollout ranks go on
        after them (they hold the checkpoint's weights, version `step`)."""
        by_step: dict[int, dict[str, torch.Tensor]] = {}
        for name, v in tensors.items():
            s, key = name.split("/", 1)
            by_step.setdefault(int(s), {})[key] = v
        self.inbox = {s: (Batch(d), _wire_bytes(Batch(d))) for s, d in by_step.items()}
        self.next_batch = min(step + self.k, self.total_steps) + 1
        self.version = step if step > self.critic_warmup else 0

    def take_bytes(self) -> int:
        """Batch bytes this training rank received for the current step's batch (float64 rows, as sent)."""
        n, self.batch_bytes = self.batch_bytes, 0
        return n


def _wire_bytes(batch: Batch) -> int:
    """The bytes a batch takes on the wire: every tensor a float64 column block of its width."""
    return 8 * len(batch) * sum(t.shape[1] if t.dim() == 2 else 1 for t in batch.tensors.values())
