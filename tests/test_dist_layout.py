"""Role layouts and launcher detection: pure arithmetic, no process group."""
import pytest

from spmdrl.config import PlacementConfig
from spmdrl.dist.init import detect_env, expand_nodelist
from spmdrl.dist.layout import RoleLayout, plan_layout
from spmdrl.errors import LayoutError

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def test_colocated_layout_degrees_and_coords():
    lay = plan_layout(PlacementConfig(actor_tp=2, rollout_tp=4), 8)
    assert (lay["actor"].dp, lay["actor"].tp) == (4, 2)
    assert (lay["rollout"].dp, lay["rollout"].tp) == (2, 4)
    assert lay["ref"].ranks == lay["critic"].ranks == tuple(range(8))
    # tp is the fastest dim: a TP group is adjacent ranks
    assert lay["rollout"].mesh_ranks() == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert lay["actor"].coords(5) == (2, 0, 1)


def test_sequence_parallel_layout_coords_groups_and_shard_rows():
    """(dp, pp, sp, tp) with tp fastest: at sp=2 x dp=2 on 4 ranks the sp groups are adjacent ranks, the data
    replicas {0, 1} and {2, 3}, and every rank is its own FSDP2 shard row (dp-major, then sp)."""
    lay = plan_layout(PlacementConfig(actor_sp=2), 4)["actor"]
    assert (lay.dp, lay.sp, lay.tp) == (2, 2, 1)
    assert [lay.coords4(r) for r in range(4)] == [(0, 0, 0, 0), (0, 0, 1, 0), (1, 0, 0, 0), (1, 0, 1, 0)]
    assert lay.coords(3) == (1, 0, 0)
    assert lay.mesh_ranks() == [[[0]], [[1]], [[2]], [[3]]]
    assert lay.replica_ranks(1) == [2, 3]
    g = lay.groups()
    assert g["sp_groups"] == [[0, 1], [2, 3]] and g["dp_groups"] == [[0, 2], [1, 3]]
    assert plan_layout(PlacementConfig(actor_sp=2), 4)["rollout"].sp == 1


def test_split_layout_puts_training_roles_after_the_rollout_prefix():
    lay = plan_layout(PlacementConfig(mode="split", rollout_ranks=[0, 1], rollout_tp=2), 4)
    assert lay["rollout"].ranks == (0, 1) and (lay["rollout"].dp, lay["rollout"].tp) == (1, 2)
    assert lay["actor"].ranks == lay["ref"].ranks == lay["critic"].ranks == lay["reward"].ranks == (2, 3)
    assert lay["actor"].dp == 2 and lay["actor"].coords(0) is None and lay["actor"].coords(3) == (1, 0, 0)
    lay = plan_layout(PlacementConfig(mode="split", rollout_ranks=[0, 1, 2, 3], actor_tp=2), 8)
    assert (lay["actor"].dp, lay["actor"].tp) == (2, 2) and lay["actor"].mesh_ranks() == [[[4, 5]], [[6, 7]]]
    assert (lay["rollout"].dp, lay["rollout"].tp) == (4, 1)


@pytest.mark.parametrize("kw,words", [
    ({"mode": "split", "rollout_ranks": [2, 3]}, ["rollout_ranks", "0..R-1"]),  # vLLM needs a prefix of the world
    ({"mode": "split", "rollout_ranks": [0, 1, 2, 3]}, ["R < 4"]),  # nothing left to train on
    ({"mode": "split", "rollout_ranks": [0, 1], "critic_ranks": [0, 1]}, ["critic_ranks", "[2, 3]"]),
    ({"rollout_ranks": [0, 1]}, ["rollout_ranks", "colocated"]),
    ({"critic_ranks": [2, 3]}, ["critic_ranks", "colocated"]),
    ({"mode": "spread"}, ["placement.mode", "'spread'"]),
])
def test_bad_split_layouts_are_rejected(kw, words):
    with pytest.raises(LayoutError) as e:
        plan_layout(PlacementConfig(**kw), 4)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("kw,world,words", [
    ({"rollout_tp": 3}, 8, ["world size 8", "3*1*1 = 3", "rollout_tp"]),
    ({"actor_tp": 4}, 2, ["world size 2", "4*1*1 = 4"]),
    ({"actor_sp": 3}, 4, ["world size 4", "1*1*3 = 3", "actor_sp"]),
    ({"critic_sp": 2, "critic_tp": 2}, 4, ["critic_sp = 2", "critic_tp = 1"]),
    ({"actor_ranks": [0, 9]}, 4, ["actor_ranks", "outside the world of 4"]),
    ({"actor_ranks": [1, 1]}, 4, ["twice"]),
    ({"actor_tp": 0}, 4, ["actor_tp must be >= 1"]),
    ({"actor_pp": 2}, 4, ["actor_pp = 2", "fsdp backend", 'trainer.backend = "megatron"']),
    ({"critic_pp": 2}, 4, ["critic_pp = 2", "fsdp backend"]),
    ({"mode": "split"}, 4, ["placement.mode", "rollout_ranks"]),
])
def test_impossible_layouts_are_rejected(kw, world, words):
    with pytest.raises(LayoutError) as e:
        plan_layout(PlacementConfig(**kw), world)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_megatron_roles_take_pipeline_parallelism():
    """(dp, pp, tp) with tp fastest, then pp: megatron's tp-pp-dp rank order."""
    megatron = {"actor": "megatron", "ref": "megatron", "critic": "megatron"}
    lay = plan_layout(PlacementConfig(actor_tp=2, actor_pp=2, critic_tp=2, critic_pp=2, ref_pp=4, rollout_tp=2), 8,
                      backends=megatron)
    a = lay["actor"]
    assert (a.dp, a.pp, a.tp) == (2, 2, 2)
    assert a.mesh_ranks() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert a.coords(6) == (1, 1, 0)
    assert a.groups()["pp_groups"][:2] == [[0, 2], [1, 3]] and a.groups()["dp_groups"][0] == [0, 4]
    assert (lay["ref"].dp, lay["ref"].pp, lay["ref"].tp) == (2, 4, 1)
    with pytest.raises(LayoutError, match=r"tp\*pp\*sp = 2\*3\*1 = 6 does not divide"):
        plan_layout(PlacementConfig(actor_tp=2, actor_pp=3), 8, backends=megatron)
    with pytest.raises(LayoutError, match="ref_pp = 2 needs pipeline"):  # a role left on fsdp keeps pp = 1
        plan_layout(PlacementConfig(ref_pp=2), 8, backends={"actor": "megatron"})


def test_expand_slurm_nodelist():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("node5") == ["node5"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]


def test_detect_env_torchrun_slurm_and_single():
    t = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert (t.rank, t.world_size, t.local_rank, t.master_addr, t.master_port, t.launcher) == (3, 8, 3, "h0", 1234, "torchrun")
    s = detect_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                    "SLURM_JOB_NODELIST": "gpu[12-13]", "SLURM_JOB_ID": "4242"})
    assert (s.rank, s.world_size, s.local_rank, s.master_addr, s.launcher) == (5, 16, 1, "gpu12", "slurm")
    assert s.master_port == 20000 + 4242
    one = detect_env({})
    assert (one.rank, one.world_size, one.launcher) == (0, 1, "single") and one.master_port > 0


def _layout(role, ranks, dp, tp, sp=1):
    return RoleLayout(role, tuple(ranks), dp, 1, tp, sp)


@pytest.mark.parametrize("src,dst", [
    ((range(4), 4, 1), (range(4), 2, 2)),   # rollout dp=4 -> actor tp=2: ranks receive their tp partner's samples
    ((range(4), 2, 2), (range(4), 4, 1)),   # rollout tp=2 -> actor dp=4: a local slice
    ((range(4), 2, 2), (range(4), 1, 4)),   # everything to one tp group of 4
    ((range(2), 2, 1), (range(2, 4), 2, 1)),  # split placement: disjoint rank sets
    ((range(2), 1, 2), (range(2, 6), 4, 1)),  # 2 rollout ranks (one tp group) -> 4 disjoint actor ranks
    ((range(4), 4, 1), (range(4), 2, 1, 2)),  # rollout dp=4 -> actor sp=2: the sp ranks of a replica share samples
    ((range(2), 2, 1), (range(2, 6), 1, 1, 4)),  # split placement, one actor replica of sp=4
])
def test_batch_move_plan_gives_each_rank_exactly_its_samples(src, dst):
    """Independent reference: the global sample order is src dp-rank major; dst dp rank j needs its contiguous
    share. Simulate the plan's keeps, sends and receives on real sample ids."""
    from spmdrl.dist.collectives import batch_move_plan

    s, d = _layout("rollout", *src), _layout("actor", *dst)
    per_src = 12
    total = per_src * s.dp
    holds = {r: list(range(s.coords(r)[0] * per_src, (s.coords(r)[0] + 1) * per_src)) for r in s.ranks}
    plan = batch_move_plan(s, d, per_src)
    for rank in d.ranks:
        j = d.coords(rank)[0]
        want = list(range(j * total // d.dp, (j + 1) * total // d.dp))
        got = []
        if rank in plan.keep:
            lo, hi, hlo = plan.keep[rank]
            assert holds[rank][lo - hlo: hi - hlo] == list(range(lo, hi))
            got += list(range(lo, hi))
        for peer, (glo, ghi) in plan.recvs.get(rank, {}).items():
            llo, lhi = plan.sends[peer][rank]
            assert holds[peer][llo:lhi] == list(range(glo, ghi))  # the sender really has those samples
            got += list(range(glo, ghi))
        assert sorted(got) == want, rank
    # nothing is received that the rank already holds, and tp copies are not all sent by one rank
    for rank, peers in plan.recvs.items():
        for glo, ghi in peers.values():
            assert not set(range(glo, ghi)) & set(holds.get(rank, []))


def test_megatron_roles_must_share_one_layout():
    """One megatron-core parallel state per process: a built critic on another (tp, pp) fails at validation."""
    from spmdrl.config import load_config, validate

    base = ["trainer.backend=megatron", "model.path=m", 'data.train_files=["x.parquet"]', "placement.actor_tp=2",
            "placement.actor_pp=2", "placement.rollout_tp=2", "data.train_batch_size=8", "actor.micro_batch_size=1",
            "critic.micro_batch_size=1", "rollout.n=2"]
    validate(load_config(None, base), 8)  # the ref (tp=1) is not built without a KL term
    bad = load_config(None, base + ["critic.enable=true", "algorithm.adv_estimator=gae", "placement.critic_tp=2"])
    with pytest.raises(LayoutError, match="critic .tp=2, pp=1, ep=1. differ.*critic_pp = 2"):
        validate(bad, 8)


@pytest.mark.parametrize("tp,pp,dp,ep", [(1, 1, 4, 2), (2, 1, 2, 2), (1, 2, 2, 2), (2, 2, 2, 2), (1, 2, 4, 2), (2, 2, 4, 4),
                                         (2, 2, 2, 1)])
def test_layout_groups_are_megatron_cores_for_its_order(tp, pp, dp, ep):
    """Independent reference: megatron-core's own RankGenerator for the order the layout names (megatron_order):
    the dense tp / pp / dp groups and the expert ep / edp groups (expert tp = tp) equal the layout's, pipeline stages
    outermost exactly when ep > 1 and pp > 1; replica_ranks are each dp group member's stages, tp ranks."""
    rg = pytest.importorskip("megatron.core.parallel_state").RankGenerator
    world = tp * pp * dp
    lay = RoleLayout("actor", tuple(range(world)), dp, pp, tp, 1, ep)
    assert lay.pp_outer == (ep > 1 and pp > 1)
    dense = rg(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=lay.megatron_order)
    expert = rg(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order=lay.megatron_order)
    groups = lay.groups()
    for ours, theirs in (("tp_groups", dense.get_ranks("tp")), ("pp_groups", dense.get_ranks("pp")),
                         ("dp_groups", dense.get_ranks("dp"))) + ((("ep_groups", expert.get_ranks("ep")),
                                                                  ("edp_groups", expert.get_ranks("dp"))) if ep > 1 else ()):
        assert sorted(groups[ours]) == sorted(theirs), ours
    for r in range(world):
        d, p, t = lay.coords(r)
        assert lay.grid4()[d][p][0][t] == r and lay.ep_coords(r) == (d % ep, d // ep)
    for d in range(dp):
        assert sorted(lay.replica_ranks(d)) == sorted(r for r in range(world) if lay.coords(r)[0] == d)
