"""Split placement: the rollout ranks' side of a step, and the stream of batches between the roles.

The rollout ranks and the training ranks run the same program but different stages. Per step s:
  * the rollout ranks (`produce`) generate the batches up to step s + k (k = trainer.max_staleness) with the
    weights they hold and post each to the training ranks without waiting;
  * the training ranks (`receive`) take batch s, train on it, take in the batches already posted for steps
    s+1 .. s+k (`take_in`) and then send the new weights;
  * the rollout ranks receive and load those weights (`load_weights`) and wait until their batch sends are
    complete (`wait_sends`);
  * both meet at the metric reduction, with nothing posted on either side.
Each side makes its blocking transfers in the same order (batches, then weights, then the meeting), so no rank
waits for a transfer whose other end waits behind it, even where the device runs communication kernels one
after another (docs/architecture.md, "What the meeting point needs"). With k = 0 batch s is generated with the
weights after step s-1 (on-policy, as colocated); with k = 1 batch s+1 is generated (with the weights after step
s-1) while the training ranks update on batch s.

Weight versions: version v is the actor after the update of step v (0: the initial weights); with critic
warmup a step without an actor update keeps the version. Batch s carries, per sample, the version that
generated it (`weight_version`): s-1-k in steady state; the training ranks log the lag
(`train/weight_version_lag` = actor version before the update - batch version; k in steady state).

In flight across a checkpoint: at a checkpoint after step s the training ranks hold every batch the rollout
ranks already posted (steps s+1 .. s+k) and save them with the checkpoint (per rank, safetensors); a resumed
run trains on those and the rollout ranks go on from batch s+k+1, so resume is exact.

Asynchronous split (rollout.partial = keep | recompute with split placement): the rollout ranks' engines are never
drained. Each rollout rank keeps data.train_batch_size * (1 + rollout.oversample) prompt groups in flight (its
share), steps its engine, and streams batch s to the training ranks as its groups complete (`GroupStream`): after an
engine step in which groups complete, they go out in one post (each group's samples whole, rows in completion
order; dist/transfer.py post_rows), until `need` groups make the batch (loop/partial.py); the unfinished requests
stay in the engine. The training ranks take their share in as the posts come, in the order posted (recv_batch),
and train on batch s once their share of it is whole; every post of batch s+1 is out before the rollout ranks wait
for the weights of step s, and the training ranks take them all in before they send those weights, so the order
below holds. The rollout ranks run one batch ahead: in step s they
complete and post batch s+1, then load the weights of step s between two engine steps, without draining or
recomputing anything (keep; recompute prefills the requests in flight again with the new weights). The point where
version v is loaded is the engine step at which batch v+1 is complete: a function of the config and seed, never of
wall-clock time, so two runs with the same config give the same metrics. Every token records the version that
sampled it (`versions`); the training ranks' loss takes each token's behaviour log-prob as its old policy. A group
whose tokens would lag the actor that trains on them by more than trainer.max_staleness versions (>= 1) is aborted
and its prompt queued again, so a long request may go on over max_staleness - 1 weight updates. The meeting point
and its order stay as above (with k = 1: batch s+1 is taken in before the weights of step s go out). A checkpoint
keeps both: the training ranks save the posted batch (`in_flight`), and each rollout rank saves its own requests in
flight, suspended first and admitted again as continuations by its next rollout, in the run that saved and in a
resumed one alike (loop/partial.py; loop/run_state.py saves them), so a resumed asynchronous run goes on from the
same engine state.
"""
from __future__ import annotations

import torch

from spmdrl.batch import Batch
from spmdrl.config.derived import replays_routes, rolls_out_trajectories
from spmdrl.data.sampler import DistributedPromptSampler
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.dist.transfer import PendingSends, post_batch, post_rows, recv_batch
from spmdrl.errors import SpmdrlError
from spmdrl.loop.generate import Generator
from spmdrl.loop.memory import MemoryLifecycle
from spmdrl.reshard.sync import WeightSync

# every tensor of a rollout batch as it travels (dtype, 2-D?): the receiving ranks build an empty batch of it
ROLLOUT_KEYS = {
    "prompts": (torch.long, True), "prompt_len": (torch.long, False), "responses": (torch.long, True),
    "response_len": (torch.long, False), "response_mask": (torch.float32, True),
    "rollout_log_probs": (torch.float32, True), "index": (torch.long, False), "truncated": (torch.float32, False),
    "uid": (torch.long, False), "weight_version": (torch.long, False),
}


MULTI_TURN_KEYS = {"trajectory": (torch.long, True)}
"""What a multi-turn rollout batch carries besides: each sample's turns (rollout/trajectory.py)."""

ROUTE_KEYS = {"routed_experts": (torch.int16, True)}
"""What a rollout batch carries besides with actor.router_replay = "rollout": the experts vLLM chose
(rollout/routes.py)."""


VERSION_KEYS = {"versions": (torch.long, True)}
"""What a rollout batch carries besides in asynchronous split: each token's weight version (loop/partial.py)."""


def rollout_keys(multi_turn: bool, routes: bool = False, versions: bool = False) -> dict[str, tuple[torch.dtype, bool]]:
    return {**ROLLOUT_KEYS, **(MULTI_TURN_KEYS if multi_turn else {}), **(ROUTE_KEYS if routes else {}),
            **(VERSION_KEYS if versions else {})}


def empty_rollout_batch(keys: dict[str, tuple[torch.dtype, bool]] = ROLLOUT_KEYS) -> Batch:
    return Batch({k: torch.zeros((0, 1) if two_d else (0,), dtype=dt) for k, (dt, two_d) in keys.items()})


LAST_BATCH_METRICS = ("rollout/requests_carried_over", "rollout/generated_tokens_per_s", "rollout/stream_lead_steps")
"""Asynchronous split's rollout metrics that describe one batch (when a step posts two, the later one's)."""


class GroupStream:
    """Asynchronous split, on a rollout rank: one batch's groups posted to the training ranks as they complete (the
    groups of one engine step in one post, rows in completion order, each group's samples whole), and how early."""

    def __init__(self, stream: "BatchStream", step: int):
        self.stream, self.step = stream, step
        self.rows = 0  # this rank's rows of the batch posted so far
        self.posts: list[tuple[int, int]] = []  # (engine step, groups) of each post

    def __call__(self, groups: Batch, engine_step: int) -> None:
        st = self.stream
        st.check_keys(groups)
        st.sent.append(post_rows(groups, self.rows, st.rollout_mesh.dp_share(st.samples_per_step, "rollout samples"),
                                 st.rollout_mesh, st.actor_mesh, st.meshes.batch_group, tag=self.step))
        self.rows += len(groups)
        self.posts.append((engine_step, int(groups["uid"].unique().numel())))

    def metrics(self) -> dict[str, float]:
        """rollout/stream_sends (posts), rollout/groups_streamed_early (groups posted before the engine step that
        completed the batch) and rollout/stream_lead_steps (engine steps a group went out before that, mean)."""
        last = self.posts[-1][0] if self.posts else 0
        groups = sum(g for _, g in self.posts)
        return {"rollout/stream_sends": float(len(self.posts)),
                "rollout/groups_streamed_early": float(sum(g for at, g in self.posts if at < last)),
                "rollout/stream_lead_steps": sum((last - at) * g for at, g in self.posts) / max(groups, 1)}


class BatchStream:
    """Per step: the rollout ranks produce, the training ranks receive. One object on every rank.

    generator: the rollout ranks' Generator (None on the training ranks); sampler: the prompt sampler (the
    training ranks count the rollout ranks' draws, so a checkpoint saves the rollout's sampler state);
    weight_sync: the actor -> rollout WeightSync (the rollout ranks load what the training ranks send); memory:
    the rollout ranks' memory phases (vLLM's KV cache back before generating)."""

    def __init__(self, cfg, meshes: RoleMeshes, generator: Generator | None, sampler: DistributedPromptSampler,
                 weight_sync: WeightSync, memory: MemoryLifecycle):
        t = cfg.trainer
        self.k, self.total_steps, self.critic_warmup = t.max_staleness, t.total_steps, t.critic_warmup
        self.asynchronous = cfg.rollout.partial != "off"  # the engine stepped continuously (see the module doc)
        self.ahead = 1 if self.asynchronous else self.k  # batches the rollout ranks post ahead of training
        self.samples_per_step = cfg.data.train_batch_size * cfg.rollout.n
        self.meshes, self.generator, self.sampler, self.weight_sync = meshes, generator, sampler, weight_sync
        self.memory = memory
        self.keys = rollout_keys(rolls_out_trajectories(cfg), replays_routes(cfg), versions=self.asynchronous)
        self.loop_metrics: dict[str, float] = {}  # rollout ranks: the multi-turn loop's time split this step
        self.rollout_mesh, self.actor_mesh = meshes["rollout"], meshes["actor"]
        self.next_batch = 1  # rollout ranks: the next step whose batch is generated
        self.version = 0  # rollout ranks: the weight version vLLM holds
        self.sent: list[PendingSends] = []  # rollout ranks: batch sends posted this step
        self.inbox: dict[int, tuple[Batch, int, int]] = {}  # training ranks: batches taken in ahead or restored,
        # with the bytes and messages each came in
        self.messages: int | None = None  # training ranks, asynchronous: messages this step's batch came in
        self.batch_bytes = 0  # training ranks: bytes received this step
        self.lags: torch.Tensor | None = None  # training ranks, asynchronous: this step's trained tokens' version lags

    # ---- rollout ranks ---------------------------------------------------------------------------------
    def produce(self, step: int, timer) -> None:
        """Generate and post every batch up to step + k (the last step at most); asynchronous: up to step + 1, each
        batch the first groups to complete, streamed to the training ranks as they complete (`GroupStream`), for
        the actor after step s-1 to train on."""
        last = min(step + self.ahead, self.total_steps)
        while self.next_batch <= last:
            s = self.next_batch
            self.memory.for_rollout()
            stream = GroupStream(self, s) if self.asynchronous else None
            with timer("rollout"):
                batch = self.generator.generate(next(self.sampler), s, 0, self.version, self.version_after(s - 1),
                                                stream)
            # the training ranks log the lags of the batch they train
            self.add_metrics({k: v for k, v in self.generator.take_metrics().items()
                              if not k.startswith("rollout/version_lag")})
            if stream is not None:  # its groups are out already
                self.add_metrics(stream.metrics())
                self.next_batch += 1
                continue
            if "weight_version" not in batch:
                batch["weight_version"] = torch.full((len(batch),), self.version, dtype=torch.long)
            self.check_keys(batch)
            with timer("post_batch"):
                self.sent.append(post_batch(batch, self.rollout_mesh, self.actor_mesh, self.meshes.batch_group, tag=s))
            self.next_batch += 1

    def add_metrics(self, metrics: dict[str, float]) -> None:
        """A batch's rollout metrics into this step's: counts add up; a state or rate is the last batch's."""
        for k, v in metrics.items():
            self.loop_metrics[k] = v if k in LAST_BATCH_METRICS else self.loop_metrics.get(k, 0.0) + v

    def check_keys(self, batch: Batch) -> None:
        if set(batch.tensors) != set(self.keys):  # the training ranks unpack by this list
            raise SpmdrlError(f"a rollout batch has tensors {sorted(batch.tensors)} but spmdrl.loop.split.ROLLOUT_KEYS "
                              f"(and MULTI_TURN_KEYS, ROUTE_KEYS) list {sorted(self.keys)}: add new rollout "
                              "tensors there")

    def version_after(self, step: int) -> int:
        """The actor's weight version after `step` (critic warmup steps keep version 0)."""
        return step if step > self.critic_warmup else 0

    def take_metrics(self) -> dict[str, float]:
        """The multi-turn loop's time split over this step's rollouts, and asynchronous split's rollout metrics
        (rollout ranks)."""
        m, self.loop_metrics = self.loop_metrics, {}
        return m

    def load_weights(self, step: int) -> dict[str, float]:
        """Receive and load the weights of this step's actor update (rollout ranks; the caller has put the memory
        in its sync phase): vLLM holds version `step` from here."""
        got = self.weight_sync()  # asynchronous: between two engine steps, with the requests left in flight
        self.version = step
        return {"weight_sync/bytes_recv": got["weight_sync/bytes_recv"],
                "timing/weight_sync_transport_s": got["timing/weight_sync_transport_s"]}

    def wait_sends(self) -> None:
        """Wait until every batch posted is received (the training ranks take them all in before they send the
        weights), so that nothing is in flight at the step's meeting point (rollout ranks)."""
        for sends in self.sent:
            sends.wait()
        self.sent = []

    # ---- training ranks --------------------------------------------------------------------------------
    def receive(self, step: int) -> Batch:
        """Batch `step` on this training rank: from the inbox, else from the rollout ranks."""
        if step in self.inbox:
            batch, nbytes, messages = self.inbox.pop(step)
        else:
            batch, nbytes, messages = self.fetch(step)
        self.batch_bytes += nbytes
        if "versions" in batch:  # lag: the actor version that trains on it (after step - 1) minus the token's
            self.lags = (self.version_after(step - 1) - batch["versions"])[batch["response_mask"] > 0].double()
            self.messages = messages
        return batch

    def fetch(self, step: int) -> tuple[Batch, int, int]:
        """Receive batch `step` from the rollout ranks: (this rank's share, bytes received, messages it came in;
        asynchronous: as its groups complete, the rows of one post per message)."""
        per_src = self.rollout_mesh.dp_share(self.samples_per_step, "rollout samples")
        next(self.sampler)  # count the draw the rollout ranks made for it: the sampler state a checkpoint saves
        return recv_batch(empty_rollout_batch(self.keys), self.rollout_mesh, self.actor_mesh, per_src,
                          self.meshes.batch_group, tag=step)

    def take_in(self, step: int) -> None:
        """Training ranks, before the weights of `step` go out: receive every batch the rollout ranks posted for
        the next steps (step+1 .. step+k; asynchronous: step+1, its groups as they were streamed), so that no
        transfer is pending at the meeting point."""
        for s in range(step + 1, min(step + self.ahead, self.total_steps) + 1):
            if s not in self.inbox:
                self.inbox[s] = self.fetch(s)  # its bytes count in the step that trains on it

    def in_flight(self, step: int) -> dict[str, torch.Tensor]:
        """Training ranks, at a checkpoint after `step`: the batches posted for steps step+1 .. step+k (taken in
        during the step) as flat tensors to save, with the bytes and messages each came in (`s/_wire`)."""
        self.take_in(step)
        out = {}
        for s in range(step + 1, min(step + self.ahead, self.total_steps) + 1):
            batch, nbytes, messages = self.inbox[s]
            out.update({f"{s}/{k}": v.contiguous() for k, v in batch.tensors.items()})
            out[f"{s}/_wire"] = torch.tensor([nbytes, messages], dtype=torch.long)
        return out

    def restore(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """After a resume at `step`: training ranks get their saved in-flight batches back; rollout ranks go on
        after them (they hold the checkpoint's weights, version `step`)."""
        by_step: dict[int, dict[str, torch.Tensor]] = {}
        for name, v in tensors.items():
            s, key = name.split("/", 1)
            by_step.setdefault(int(s), {})[key] = v
        self.inbox = {}
        for s, d in by_step.items():
            wire = d.pop("_wire", None)  # absent in checkpoints written before it was saved: one message per batch
            nbytes, messages = wire.tolist() if wire is not None else (_wire_bytes(Batch(d)), 1)
            self.inbox[s] = (Batch(d), nbytes, messages)
        self.next_batch = min(step + self.ahead, self.total_steps) + 1
        self.version = self.version_after(step)

    def take_messages(self) -> dict[str, float]:
        """Asynchronous split, training ranks: batch_move/messages, the messages this rank's share of the batch it
        trains on this step came in (one per post of a rollout rank that held part of it); nothing otherwise."""
        m, self.messages = self.messages, None
        return {} if m is None else {"batch_move/messages": float(m)}

    def take_lags(self) -> torch.Tensor | None:
        """Asynchronous split: the version lag of every token of the batch this training rank trains on this step
        (None otherwise)."""
        lags, self.lags = self.lags, None
        return lags

    def take_bytes(self) -> int:
        """Batch bytes this training rank received for the current step's batch (float64 rows, as sent)."""
        n, self.batch_bytes = self.batch_bytes, 0
        return n


def _wire_bytes(batch: Batch) -> int:
    """The bytes a batch takes on the wire: every tensor a float64 column block of its width."""
    return 8 * len(batch) * sum(t.shape[1] if t.dim() == 2 else 1 for t in batch.tensors.values())
