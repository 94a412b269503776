"""Rollout on this rank's TP group: prompts in, a Batch of sampled responses out.

Every rank of a rollout TP group issues the same requests with the same seeds, so the group samples
identically (docs/architecture.md, "Sampling in a TP group"). With multi_turn.enable the rollout is the agent
loop (rollout/multi_turn.py) and the batch has holes: tool results and template glue in `responses` with
response_mask 0 and rollout log-prob 0, and each sample's turns in `trajectory` (docs/tools.md). With route
capture (actor.router_replay = "rollout") both carry `routed_experts`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from spmdrl.batch import Batch
from spmdrl.data.prompts import PromptDataset
from spmdrl.dist.collectives import reduce_max, reduce_sum
from spmdrl.dist.meshes import RoleMesh
from spmdrl.loop.build import Specs
from spmdrl.loop.partial import PartialRollouts, groups_output
from spmdrl.loop.scoring import Scorer
from spmdrl.rollout.multi_turn import AgentLoop
from spmdrl.rollout.routes import batch_routes
from spmdrl.rollout.trajectory import Trajectory, encode_infos


def request_seeds(seed: int, step: int, first: int, count: int) -> list[int]:
    """Per-prompt sampling seeds: a function of (run seed, step, global prompt position) only, so every rank
    of a rollout TP group samples identically and a rerun samples the same tokens."""
    return [(seed * 1_000_003 + step * 100_003 + first + i) % (2**31 - 1) for i in range(count)]


def rollout_to_batch(prompts: list[list[int]], prompt_idx: list[int], out, n: int, pad_id: int) -> Batch:
    """The rollout engine's output (n samples per prompt, prompt-major) as padded tensors."""
    B = len(prompts) * n
    P = max(len(p) for p in prompts)
    R = max(1, max(len(x) for x in out.response_ids))
    prompt_t = torch.full((B, P), pad_id, dtype=torch.long)
    resp_t = torch.full((B, R), pad_id, dtype=torch.long)
    lp_t = torch.zeros(B, R)
    plen = torch.zeros(B, dtype=torch.long)
    rlen = torch.zeros(B, dtype=torch.long)
    for i in range(B):
        p, resp = prompts[i // n], out.response_ids[i]
        prompt_t[i, : len(p)] = torch.tensor(p)
        resp_t[i, : len(resp)] = torch.tensor(resp, dtype=torch.long)
        lp_t[i, : len(resp)] = torch.tensor(out.logprobs[i], dtype=torch.float32)
        plen[i], rlen[i] = len(p), len(resp)
    idx = torch.tensor(prompt_idx, dtype=torch.long).repeat_interleave(n)
    batch = Batch({
        "prompts": prompt_t, "prompt_len": plen, "responses": resp_t, "response_len": rlen,
        "response_mask": (torch.arange(R)[None] < rlen[:, None]).float(), "rollout_log_probs": lp_t,
        "index": idx, "truncated": torch.tensor([f == "length" for f in out.finish_reason], dtype=torch.float32),
    })
    if getattr(out, "routed_experts", None) is not None:  # routing replay: the experts vLLM chose (rollout/routes.py)
        batch["routed_experts"] = batch_routes(out.routed_experts, (plen + rlen).tolist())
    return batch


def generate_with_images(rollout, dataset: PromptDataset, prompts: list[list[int]], prompt_idx: list[int], spec,
                         seeds: list[int], pad_id: int) -> Batch:
    """A generate call whose prompts carry their images (data/images.py VisionInputs, per prompt or None); the batch
    keeps each sample's in meta["vision"], which the forwards' micro-batches take (loop/update.py)."""
    vision = dataset.batch(prompt_idx).vision
    batch = rollout_to_batch(prompts, prompt_idx, rollout.generate(prompts, spec, seeds, vision=vision), spec.n, pad_id)
    batch.meta["vision"] = [v for v in vision for _ in range(spec.n)]
    return batch


def trajectories_to_batch(trajs: list[Trajectory], prompt_idx: list[int], n: int, pad_id: int) -> Batch:
    """Multi-turn trajectories (n per prompt, prompt-major) as padded tensors: responses = every id after the
    prompt, response_mask 1 on model tokens only, rollout_log_probs 0 on tool/glue tokens, response_len the full
    length, truncated where the budget ran out, trajectory the turns (rollout/trajectory.py), and with route
    capture routed_experts (NO_ROUTE where no turn computed a position: the last token)."""
    B = len(trajs)
    P = max(len(t.prompt) for t in trajs)
    R = max(1, max(len(t.ids) for t in trajs))
    prompt_t = torch.full((B, P), pad_id, dtype=torch.long)
    resp_t = torch.full((B, R), pad_id, dtype=torch.long)
    mask_t = torch.zeros(B, R)
    lp_t = torch.zeros(B, R)
    for i, t in enumerate(trajs):
        prompt_t[i, : len(t.prompt)] = torch.tensor(t.prompt)
        resp_t[i, : len(t.ids)] = torch.tensor(t.ids, dtype=torch.long)
        mask_t[i, : len(t.mask)] = torch.tensor(t.mask, dtype=torch.float32)
        lp_t[i, : len(t.logprobs)] = torch.tensor(t.logprobs, dtype=torch.float32)
    batch = Batch({
        "prompts": prompt_t, "prompt_len": torch.tensor([len(t.prompt) for t in trajs], dtype=torch.long),
        "responses": resp_t, "response_len": torch.tensor([len(t.ids) for t in trajs], dtype=torch.long),
        "response_mask": mask_t, "rollout_log_probs": lp_t,
        "index": torch.tensor(prompt_idx, dtype=torch.long).repeat_interleave(n),
        "truncated": torch.tensor([t.truncated for t in trajs], dtype=torch.float32),
        "trajectory": encode_infos(trajs),
    })
    if any(t.routes is not None for t in trajs):  # routing replay: each position's routes (Trajectory.add_turn_routes)
        batch["routed_experts"] = batch_routes([t.routes for t in trajs], [len(t.prompt) + len(t.ids) for t in trajs])
    return batch


BRANCH, PADDING = "branch", -1
"""[agent] with agent.train_branches = "all": the batch key that says which trajectory of its session a row is: 0 the
final branch (the session's row without branches), k >= 1 its other branches, PADDING a row that fills its group
to the step's rows per group (response_mask 0: it trains nothing and counts in no metric)."""


def sessions_only(batch: Batch) -> Batch:
    """The rows of the sessions' final branches (all of `batch` without branch rows): one per session, what a
    group's statistics and the rollout metrics count."""
    return batch.select(batch[BRANCH] == 0) if BRANCH in batch else batch


def branch_rows(trajs: list[Trajectory], branches: list[list[Trajectory]], n: int, slots: int, eos: int):
    """Every branch of every session as rows, group-major, each group `n + slots` rows: its n sessions' final
    branches (sample order), then their other branches, then padding rows. Returns (rows, branch, session): the
    trajectories, each row's BRANCH value, and the session (sample j of its group) it belongs to (-1: padding)."""
    rows, branch, session = [], [], []
    for p in range(len(trajs) // n):
        own = trajs[p * n:(p + 1) * n]
        rows += own
        branch += [0] * n
        session += list(range(n))
        for j in range(n):
            for t in branches[p * n + j]:
                rows.append(t)
                branch.append(int(t.agent["branch"]))
                session.append(j)
        for _ in range(n + slots - (len(rows) - p * (n + slots))):
            rows.append(Trajectory(prompt=list(own[0].prompt), messages=[], seed=0, sample=-1, ids=[eos], mask=[0],
                                   logprobs=[0.0], agent={"reward": 0.0}))
            branch.append(PADDING)
            session.append(-1)
    return rows, branch, session


def sample(rollout, agent: AgentLoop | None, dataset: PromptDataset, prompt_idx: list[int], spec, seeds: list[int],
           pad_id: int) -> Batch:
    """One rollout of dataset rows `prompt_idx` with `spec` (spec.n samples each): a single generate call, or
    with `agent` the multi-turn loop or the black-box agent sessions ([agent])."""
    if agent is None:
        prompts = [dataset.prompt_ids(i) for i in prompt_idx]
        if dataset.vision is not None:  # a vision-language model: each prompt's images go with it
            return generate_with_images(rollout, dataset, prompts, prompt_idx, spec, seeds, pad_id)
        return rollout_to_batch(prompts, prompt_idx, rollout.generate(prompts, spec, seeds), spec.n, pad_id)
    trajs = agent.rollout(dataset.batch(prompt_idx), seeds, spec)
    return trajectories_to_batch(trajs, prompt_idx, spec.n, pad_id)


class Generator:
    """Training rollouts of this rank's rollout TP group, in the rollout layout (a rollout rank only).

    greedy_baseline: also generate one greedy response per prompt and score it (ReMax's baseline); agent: the
    multi-turn loop on `rollout` (multi_turn.enable), else None; sampler: where rollout.partial draws the prompts
    of the groups it keeps in flight beyond a step's own (loop/partial.py)."""

    def __init__(self, cfg, mesh: RoleMesh, rollout, specs: Specs, dataset: PromptDataset, pad_id: int,
                 scorer: Scorer, *, greedy_baseline: bool, agent: AgentLoop | None = None, sampler=None):
        self.cfg, self.mesh, self.rollout, self.specs = cfg, mesh, rollout, specs
        self.dataset, self.pad_id, self.scorer, self.greedy_baseline = dataset, pad_id, scorer, greedy_baseline
        self.agent = agent
        self.train_branches = cfg.agent.enable and cfg.agent.train_branches == "all"
        self.loop_time: dict[str, float] = {}
        self.partial = PartialRollouts(cfg, rollout, dataset, sampler, specs.train, mesh.dp_offset, agent) \
            if cfg.rollout.partial != "off" else None

    def take_metrics(self) -> dict[str, float]:
        """The multi-turn loop's time split since the last call (generation, tools, the rest) and its turns."""
        out, self.loop_time = self.loop_time, {}
        return out

    def _note_loop(self) -> None:
        if self.agent is None:
            return
        st, m = self.agent.stats, self.loop_time
        busy = st.generate_s + st.tools_s + st.other_s
        # idle: this rank's wait for the rollout rank whose loop took longest (one max over the rollout dp ranks)
        slowest = reduce_max(torch.tensor([busy]), group=self.mesh.group("dp"))[0] if self.mesh.dp_size > 1 else busy
        extra = getattr(st, "extra", {})  # [agent]: the sessions' counts (agents/sessions.py), summed over the groups
        if extra:
            total = torch.tensor(list(extra.values()), dtype=torch.float64)
            if self.mesh.dp_size > 1:
                total = reduce_sum(total, group=self.mesh.group("dp"))
            for k, v in zip(extra, total.tolist()):
                m[k] = m.get(k, 0.0) + v
        for k, v in (("timing/turn_generate_s", st.generate_s), ("timing/turn_tools_s", st.tools_s),
                     ("timing/turn_other_s", st.other_s), ("timing/turn_idle_s", slowest - busy),
                     ("multi_turn/loop_turns", float(st.turns))):
            m[k] = m.get(k, 0.0) + v

    def generate(self, prompt_idx: list[int], step: int, round_: int = 0, version: int = 0,
                 trained_by: int | None = None, stream: Callable[[Batch, int], None] | None = None) -> Batch:
        """The samples of dataset rows `prompt_idx` (this rollout dp rank's share of a step's prompts): same
        prompts and seeds on every rank of the TP group. The caller has put the memory in its rollout phase
        (MemoryLifecycle.for_rollout). With rollout.partial, the first as many groups as `prompt_idx` has to
        complete (the prompts join the queue), sampled by weights `version` and older, for the actor version
        `trained_by` (default `version`) to train on; `stream` gets them as they complete, as batches of whole
        groups, with the engine steps so far (loop/partial.py)."""
        if self.partial is not None:
            return self._partial(prompt_idx, step, version, trained_by, stream)
        self.rollout.weight_version = version  # what every token sampled now carries (Completion.versions)
        r = self.mesh
        first = round_ * self.cfg.data.train_batch_size + r.dp_offset(len(prompt_idx))
        seeds = request_seeds(self.cfg.trainer.seed, step, first, len(prompt_idx))
        n = self.specs.train.n
        if self.train_branches:
            batch, per_group = self._with_branches(prompt_idx, seeds)
        else:
            batch, per_group = sample(self.rollout, self.agent, self.dataset, prompt_idx, self.specs.train, seeds,
                                      self.pad_id), n
        self._note_loop()
        # the group id: one per prompt draw (step, round, global position), never the dataset row, so two
        # draws of one prompt in a step (an epoch boundary, a dynamic-sampling round) stay two groups
        uid = step * self.cfg.algorithm.max_sample_rounds * self.cfg.data.train_batch_size + first
        batch["uid"] = torch.arange(uid, uid + len(prompt_idx), dtype=torch.long).repeat_interleave(per_group)
        if self.greedy_baseline:  # ReMax: greedy rollout as the baseline
            gb = sample(self.rollout, self.agent, self.dataset, prompt_idx, self.specs.greedy, seeds, self.pad_id)
            self.scorer.attach_meta(gb, self.dataset, r)
            self.scorer.score(gb, r)  # the same shaped reward the samples get
            batch["baseline_rewards"] = gb["scores"].repeat_interleave(per_group)
        return batch

    def _with_branches(self, prompt_idx: list[int], seeds: list[int]) -> tuple[Batch, int]:
        """[agent] sessions with every branch a row (agent.train_branches = "all"; branch_rows): each group gets
        n + slots rows, slots the most branch rows any group of the step has (one max over the rollout dp ranks, so
        that every rank holds as many rows per group and the batch moves keep groups whole). Returns the batch and
        its rows per group."""
        n = self.specs.train.n
        trajs = self.agent.rollout(self.dataset.batch(prompt_idx), seeds, self.specs.train)
        branches = self.agent.branches
        extra = [sum(len(b) for b in branches[p * n:(p + 1) * n]) for p in range(len(prompt_idx))]
        slots = max(extra, default=0)
        if self.mesh.dp_size > 1:
            slots = int(reduce_max(torch.tensor([float(slots)]), group=self.mesh.group("dp"))[0])
        self.agent.stats.extra["agent/branch_rows"] = float(sum(extra))
        eos = self.agent.tokenizer.eos_token_id if self.agent.tokenizer.eos_token_id is not None else self.pad_id
        rows, branch, session = branch_rows(trajs, branches, n, slots, eos)
        batch = trajectories_to_batch(rows, [i for i in prompt_idx for _ in range(n + slots)], 1, self.pad_id)
        batch[BRANCH] = torch.tensor(branch, dtype=torch.long)
        batch["session"] = torch.tensor(session, dtype=torch.long)
        return batch, n + slots

    def _partial(self, prompt_idx: list[int], step: int, version: int, trained_by: int | None,
                 stream: Callable[[Batch, int], None] | None) -> Batch:
        emit = None if stream is None else lambda groups, at: stream(self._groups_batch(groups, version), at)
        groups, metrics = self.partial.rollout(prompt_idx, step, version, trained_by, emit)
        self.loop_time.update(metrics)
        if self.agent is not None:
            self._note_loop()
        return self._groups_batch(groups, version)

    def _groups_batch(self, groups: list, version: int) -> Batch:
        """Complete groups of a partial rollout as a batch: their samples, each token's version (`versions`), the
        oldest version a sample saw (`weight_version`) and the group ids."""
        n = self.specs.train.n
        if self.agent is not None:  # multi-turn: each group's trajectories
            trajs = [g.done[j] for g in groups for j in range(n)]
            batch = trajectories_to_batch(trajs, [g.row for g in groups], n, self.pad_id)
            versions = [t.versions for t in trajs]
        else:
            out, versions = groups_output(groups, n)
            batch = rollout_to_batch([g.prompt for g in groups], [g.row for g in groups], out, n, self.pad_id)
        R = batch["responses"].shape[1]
        v = torch.full((len(versions), R), version, dtype=torch.long)
        for i, vs in enumerate(versions):
            v[i, : len(vs)] = torch.tensor(vs, dtype=torch.long)
        batch["versions"] = v
        # the oldest weights a sample saw: train/weight_version_lag (and MismatchWatch skips stale batches)
        batch["weight_version"] = torch.tensor([min(vs, default=version) for vs in versions], dtype=torch.long)
        batch["uid"] = torch.tensor([g.uid for g in groups], dtype=torch.long).repeat_interleave(n)
        return batch
