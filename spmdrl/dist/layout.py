"""Placement -> per-role rank sets and parallel degrees. Pure arithmetic: runs before init.

A role owns a list of global ranks, laid out as (dp, pp, sp, tp) with tp fastest, so the ranks of one
tensor-parallel group are adjacent (on one node), and the sequence-parallel ranks of one data-parallel replica
next to them (megatron-core's order "tp-cp-ep-pp-dp"). A Megatron role with both expert and pipeline
parallelism is laid out (pp, dp, tp) instead, pipeline stages outermost (megatron's "tp-cp-ep-dp-pp", the only
order in which megatron-core gives the expert layers their own data-parallel size next to pipeline stages):
`pp_outer`. Colocated placement gives every role all ranks; split placement gives roles disjoint lists; the
arithmetic is the same.
"""
from __future__ import annotations

from dataclasses import dataclass

from spmdrl.errors import LayoutError

ROLES = ("actor", "ref", "critic", "teacher", "reward", "rollout")  # rollout last: split placement's other side


@dataclass(frozen=True)
class RoleLayout:
    role: str
    ranks: tuple[int, ...]
    dp: int
    pp: int
    tp: int
    sp: int = 1  # sequence parallel: the sp ranks of a replica split each sequence's tokens (FSDP2 Ulysses)
    ep: int = 1  # expert parallel (Megatron): expert layers split their experts over ep of the dp replicas

    @property
    def pp_outer(self) -> bool:
        """Ranks ordered (pp, dp, sp, tp): expert and pipeline parallelism together (see the module docstring)."""
        return self.ep > 1 and self.pp > 1

    @property
    def megatron_order(self) -> str:
        """megatron-core's name of this rank order (initialize_model_parallel's `order`, fastest first, cp = 1)."""
        return "tp-cp-ep-dp-pp" if self.pp_outer else "tp-cp-ep-pp-dp"

    def ep_coords(self, rank: int) -> tuple[int, int] | None:
        """(expert-parallel rank, expert-data-parallel rank) of a global rank, or None if it is not in the role.
        With the expert tensor-parallel size = tp, megatron-core's expert layers see the dp replicas of a pipeline
        stage as ep (fastest) x edp, in either order (tp-cp-ep-pp-dp or tp-cp-ep-dp-pp): ep_rank = dp_rank % ep
        and edp_rank = dp_rank // ep."""
        c = self.coords4(rank)
        return None if c is None else (c[0] % self.ep, c[0] // self.ep)

    def coords(self, rank: int) -> tuple[int, int, int] | None:
        """(dp_rank, pp_rank, tp_rank) of a global rank in this role, or None if it is not in the role."""
        c = self.coords4(rank)
        return None if c is None else (c[0], c[1], c[3])

    def coords4(self, rank: int) -> tuple[int, int, int, int] | None:
        """(dp_rank, pp_rank, sp_rank, tp_rank) of a global rank in this role, or None if it is not in the role."""
        if rank not in self.ranks:
            return None
        i = self.ranks.index(rank)
        t, s, rest = i % self.tp, (i // self.tp) % self.sp, i // (self.sp * self.tp)
        if self.pp_outer:
            return rest % self.dp, rest // self.dp, s, t
        return rest // self.pp, rest % self.pp, s, t

    def _index(self, d: int, p: int, s: int, t: int) -> int:
        """Position in `ranks` of coordinates (d, p, s, t): the inverse of coords4."""
        rest = p * self.dp + d if self.pp_outer else d * self.pp + p
        return (rest * self.sp + s) * self.tp + t

    def grid4(self) -> list[list[list[list[int]]]]:
        """Ranks as a [dp][pp][sp][tp] nested list (the DeviceMesh layout)."""
        r = self.ranks
        return [[[[r[self._index(d, p, s, t)] for t in range(self.tp)] for s in range(self.sp)]
                 for p in range(self.pp)] for d in range(self.dp)]

    def mesh_ranks(self) -> list[list[list[int]]]:
        """Ranks as a [dp * sp][pp][tp] nested list: one row per FSDP2 shard index (dp-major, then sp), which is
        the (dp, pp, tp) mesh when sp = 1. What holds which weights (the reshard planners) and the tp groups."""
        g = self.grid4()
        return [[g[d][p][s] for p in range(self.pp)] for d in range(self.dp) for s in range(self.sp)]

    def replica_ranks(self, d: int) -> list[int]:
        """Every rank of data-parallel replica d (they hold the same samples): its pp stages, sp and tp ranks."""
        return [r for p in self.grid4()[d] for s in p for r in s]

    def groups(self) -> dict[str, list[list[int]]]:
        """Global ranks of every tp, dp, pp (and sp) group of the role (what `spmdrl plan` prints)."""
        g = self.grid4()
        dims = [(d, p, s, t) for d in range(self.dp) for p in range(self.pp) for s in range(self.sp) for t in range(self.tp)]
        out = {
            "tp_groups": [g[d][p][s] for d in range(self.dp) for p in range(self.pp) for s in range(self.sp)],
            "dp_groups": [[g[d][p][s][t] for d in range(self.dp)] for (_, p, s, t) in dims if _ == 0],
            "pp_groups": [[g[d][p][s][t] for p in range(self.pp)] for (d, _, s, t) in dims if _ == 0],
        }
        if self.sp > 1:
            out["sp_groups"] = [[g[d][p][s][t] for s in range(self.sp)] for (d, p, _, t) in dims if _ == 0]
        if self.ep > 1:  # the dp index d = edp * ep + e
            edp = self.dp // self.ep
            out["ep_groups"] = [[g[x * self.ep + e][p][s][t] for e in range(self.ep)]
                                for x in range(edp) for p in range(self.pp) for s in range(self.sp) for t in range(self.tp)]
            out["edp_groups"] = [[g[x * self.ep + e][p][s][t] for x in range(edp)]
                                 for e in range(self.ep) for p in range(self.pp) for s in range(self.sp) for t in range(self.tp)]
        return out


def _ranks(spec: list[int], default: tuple[int, ...], world_size: int, key: str) -> tuple[int, ...]:
    if not spec:
        return default
    bad = [r for r in spec if not 0 <= r < world_size]
    if bad:
        raise LayoutError(f"placement.{key} has ranks {bad} outside the world of {world_size} ranks (0..{world_size - 1})")
    if len(set(spec)) != len(spec):
        raise LayoutError(f"placement.{key} lists a rank twice: {spec}")
    return tuple(spec)


PIPELINE_BACKENDS = ("megatron",)  # training backends that run pipeline parallelism
TRAINED_ROLES = ("actor", "ref", "critic", "teacher")  # roles built by a training backend (trainer.backend)


def role_backends(cfg) -> dict[str, str]:
    """The training backend of each role that has one: trainer.backend for actor, ref and the distillation teacher,
    for the critic trainer.critic_backend when set (the same rule as engines.role_backend, without importing the
    engines)."""
    t = cfg.trainer
    return {"actor": t.backend, "ref": t.backend, "critic": getattr(t, "critic_backend", "") or t.backend,
            "teacher": t.backend}


def smallest_world(placement, backends: dict[str, str] | None = None, limit: int = 4096) -> int:
    """The fewest ranks plan_layout accepts for `placement` (its explicit rank lists and tp x pp degrees)."""
    for world in range(1, limit + 1):
        try:
            plan_layout(placement, world, backends=backends)
            return world
        except LayoutError:
            continue
    raise LayoutError(f"no world of up to {limit} ranks fits the [placement] section; check its ranks and degrees")


def plan_layout(placement, world_size: int, *, allow_split: bool = True,
                backends: dict[str, str] | None = None) -> dict[str, RoleLayout]:
    """Rank sets and degrees for every role; raises LayoutError naming the world size and the degrees.

    colocate: every role on all ranks. split: the rollout ranks are the first ranks of the world
    (placement.rollout_ranks, a prefix 0..R-1: in-process vLLM is built on a prefix sub-world, see
    rollout/vllm_world.py) and the training roles (actor, ref, critic, reward) share the other ranks
    (empty lists mean all of them). `allow_split=False` accepts colocated layouts only. backends (role ->
    training backend, see `role_backends`; default fsdp) decides where pp > 1 is allowed: only on Megatron roles.
    """
    backends = backends or {}
    if placement.mode not in ("colocate", "split") or (placement.mode == "split" and not allow_split):
        raise LayoutError(f"placement.mode = {placement.mode!r} is not one of {'colocate, split' if allow_split else 'colocate'}")
    split = placement.mode == "split"
    everyone = tuple(range(world_size))
    if split:
        rollout = _ranks(placement.rollout_ranks, (), world_size, "rollout_ranks")
        if not rollout or rollout != tuple(range(len(rollout))) or len(rollout) == world_size:
            raise LayoutError(
                f"placement.mode = 'split' needs placement.rollout_ranks = the first ranks of the world, 0..R-1 with "
                f"R < {world_size} (found {list(rollout)}): in-process vLLM sees its ranks as a prefix of the world"
            )
        trainers = tuple(r for r in everyone if r not in rollout)
    else:
        rollout, trainers = _ranks(placement.rollout_ranks, everyone, world_size, "rollout_ranks"), everyone
    actor = _ranks(placement.actor_ranks, trainers, world_size, "actor_ranks")
    ranks = {
        "actor": actor,
        "ref": _ranks(placement.ref_ranks, actor, world_size, "ref_ranks"),
        "critic": _ranks(placement.critic_ranks, actor, world_size, "critic_ranks"),
        "teacher": _ranks(placement.teacher_ranks, actor, world_size, "teacher_ranks"),
        "reward": _ranks(placement.reward_ranks, actor, world_size, "reward_ranks"),
        "rollout": rollout,
    }
    degrees = {  # (tp, pp, sp, ep)
        "actor": (placement.actor_tp, placement.actor_pp, placement.actor_sp, placement.actor_ep),
        "ref": (placement.ref_tp, placement.ref_pp, placement.ref_sp, placement.ref_ep),
        "critic": (placement.critic_tp, placement.critic_pp, placement.critic_sp, placement.critic_ep),
        "teacher": (placement.teacher_tp, placement.teacher_pp, 1, placement.teacher_ep),
        "reward": (placement.reward_tp, 1, 1, 1),
        "rollout": (placement.rollout_tp, 1, 1, 1),
    }
    out = {}
    for role in ROLES:
        tp, pp, sp, ep = degrees[role]
        n = len(ranks[role])
        for name, v in (("tp", tp), ("pp", pp), ("sp", sp), ("ep", ep)):
            if v < 1:
                raise LayoutError(f"placement.{role}_{name} must be >= 1, found {v}")
        if n % (tp * pp * sp):
            raise LayoutError(
                f"placement: {role} has {n} ranks (world size {world_size}) but tp*pp*sp = {tp}*{pp}*{sp} = "
                f"{tp * pp * sp} does not divide it; choose "
                + (f"{role}_tp, {role}_pp and {role}_sp whose product divides {n}" if role in TRAINED_ROLES else
                   f"a {role}_tp that divides {n}")
            )
        dp = n // (tp * pp * sp)
        if dp % ep:
            raise LayoutError(
                f"placement.{role}_ep = {ep} must divide the {role}'s data-parallel size {dp} (its {n} ranks / "
                f"(tp*pp*sp = {tp * pp * sp})): expert parallelism splits the experts over data-parallel ranks; "
                f"choose a {role}_ep that divides {dp}"
            )
        out[role] = RoleLayout(role, ranks[role], dp, pp, tp, sp, ep)
    want = trainers if split else everyone
    for role in ROLES[:-1] if split else ROLES:
        if out[role].ranks != want:
            raise LayoutError(
                f"placement.{role}_ranks = {list(out[role].ranks)}: "
                + (f"split placement puts the training roles on the ranks after the rollout ranks, {list(trainers)}; "
                   if split else f"colocated placement puts every role on all {world_size} ranks; ")
                + f"leave {role}_ranks empty"
            )
    for role in TRAINED_ROLES:
        backend = backends.get(role, "fsdp")
        if out[role].pp != 1 and backend not in PIPELINE_BACKENDS:
            raise LayoutError(
                f"placement.{role}_pp = {out[role].pp} needs pipeline parallelism, which the {backend} backend does "
                f"not have; set {'trainer.critic_backend' if role == 'critic' else 'trainer.backend'} = \"megatron\" "
                f"or {role}_pp = 1"
            )
    for role in TRAINED_ROLES:
        lay, backend = out[role], backends.get(role, "fsdp")
        if lay.ep > 1 and backend not in PIPELINE_BACKENDS:
            raise LayoutError(
                f"placement.{role}_ep = {lay.ep} needs expert parallelism, which the {backend} backend does not have "
                f"(its experts train whole on each FSDP2 shard); set "
                f"{'trainer.critic_backend' if role == 'critic' else 'trainer.backend'} = \"megatron\" or {role}_ep = 1"
            )
    for role in TRAINED_ROLES:
        lay = out[role]
        if lay.sp > 1 and lay.tp > 1:
            raise LayoutError(
                f"placement.{role}_sp = {lay.sp} with {role}_tp = {lay.tp}: the FSDP2 backend splits sequences "
                f"(Ulysses) without tensor parallelism; set {role}_tp = 1 (FSDP2 then shards over dp x sp ranks)"
            )
    return out


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node a global rank runs on (ranks fill nodes in order, gpus_per_node each)."""
    return rank // gpus_per_node


def is_split(layouts: dict[str, RoleLayout]) -> bool:
    """Whether the rollout ranks and the training ranks are disjoint (split placement)."""
    return not set(layouts["rollout"].ranks) & set(layouts["actor"].ranks)


def check_megatron_roles(layout: dict[str, RoleLayout], backends: dict[str, str], built: list[str]) -> None:
    """megatron-core keeps one parallel state per process, so every Megatron role a run builds needs the
    actor's ranks and (tp, pp) degrees."""
    roles = [r for r in built if backends.get(r) == "megatron"]
    for role in roles[1:]:
        a, b = layout[roles[0]], layout[role]
        if (a.ranks, a.tp, a.pp, a.ep) != (b.ranks, b.tp, b.pp, b.ep):
            raise LayoutError(
                f"placement: the Megatron roles {roles[0]} (tp={a.tp}, pp={a.pp}, ep={a.ep}) and {role} (tp={b.tp}, "
                f"pp={b.pp}, ep={b.ep}) differ, but megatron-core has one parallel layout per process; set "
                f"{role}_tp = {a.tp}, {role}_pp = {a.pp} and {role}_ep = {a.ep}"
            )


def external_launcher_tp_groups(world_size: int, tp: int) -> list[list[int]]:
    """The TP groups vLLM's external_launcher forms: blocks of tp consecutive ranks over the whole world."""
    if tp < 1 or world_size % tp:
        raise LayoutError(
            f"rollout tp_size={tp} does not divide the world size {world_size}: "
            "vLLM splits the whole world into TP groups of consecutive ranks; pick a divisor"
        )
    return [list(range(k * tp, (k + 1) * tp)) for k in range(world_size // tp)]


def contiguous_share(n: int, parts: int, i: int) -> range:
    """Part i of n items split into `parts` equal contiguous parts (n must divide evenly)."""
    per = n // parts
    return range(i * per, (i + 1) * per)


def splits_evenly(n: int, parts: int) -> bool:
    return parts > 0 and n % parts == 0


def sp_head_problem(heads: int, kv_heads: int, sp: int) -> str | None:
    """Why sequence parallelism over sp ranks cannot split these attention heads, else None (config validation, the FSDP2 engine)."""
    if sp <= 1:
        return None
    if heads % sp:
        return f"{heads} attention heads are not divisible by sp = {sp}"
    if kv_heads % sp and sp % kv_heads:
        return f"{kv_heads} key/value heads are neither divisible by sp = {sp} nor a divisor of it (to repeat them)"
    return None
