"""Weight resharding: the pure plan against independent references, and real syncs on 2 and 4 processes."""
import json
import os
import re

import pytest
import torch

from spmdrl.dist.blocks import ModelDims, fsdp_block, fsdp_blocks, numel
from spmdrl.reshard.plan import plan_sync

from vllm_targets import vllm_blocks

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the plan, pure ----------------------------------------------------------------------------------------

@pytest.mark.quick
@pytest.mark.parametrize("shape", [(12, 8), (10, 6), (7, 5), (3, 4)])
@pytest.mark.parametrize("style", [None, "col", "row"])
@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 2), (3, 2), (2, 1), (4, 1)])
def test_fsdp_block_matches_dtensor_arithmetic(shape, style, dp, tp):
    """The planner's FSDP2 x TP blocks equal what DTensor computes for (Shard/_StridedShard, Shard) placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if style == "col" and shape[0] % (dp * tp):
        pytest.skip("uneven strided shards: DTensor's offset arithmetic and FSDP2's chunk-of-chunk storage differ; "
                    "the engine checks its real local shards against the plan at the first sync")
    if style == "col":
        placements = [_StridedShard(0, split_factor=tp) if tp > 1 else Shard(0), Shard(0) if tp > 1 else Replicate()]
    elif style == "row":
        placements = [Shard(0), Shard(1) if tp > 1 else Replicate()]
    else:
        placements = [Shard(0), Replicate()]
    for d in range(dp):
        for t in range(tp):
            local, offset = _compute_local_shape_and_global_offset(shape, (dp, tp), [d, t], placements)
            offs, size = fsdp_block(shape, style, dp, tp, d, t)
            assert tuple(size) == tuple(local), (d, t)
            if numel((offs, size)):
                assert tuple(offs) == tuple(offset), (d, t)


@pytest.mark.quick
def test_vllm_reads_learnt_from_the_loaders_match_the_rules_by_hand():
    """What vLLM's Llama loaders read per TP rank, learnt by running them on meta tensors, against the slicing
    rules written out by hand from vLLM's layer classes (QKVParallelLinear with kv heads replicated below tp,
    MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding's padded vocabulary)."""
    dims = ModelDims(num_heads=8, num_kv_heads=2, head_dim=4, vocab_size=100)
    params = [("model.embed_tokens.weight", (100, 16)), ("model.layers.0.self_attn.q_proj.weight", (32, 16)),
              ("model.layers.0.self_attn.k_proj.weight", (8, 16)), ("model.layers.0.self_attn.v_proj.weight", (8, 16)),
              ("model.layers.0.self_attn.o_proj.weight", (16, 32)), ("model.layers.0.mlp.gate_proj.weight", (40, 16)),
              ("model.layers.0.mlp.up_proj.weight", (40, 16)), ("model.layers.0.mlp.down_proj.weight", (16, 40)),
              ("model.layers.0.input_layernorm.weight", (16,)), ("model.norm.weight", (16,)), ("lm_head.weight", (100, 16))]

    def block(name, tp, r):
        (rank, b), = [(rank, b) for rank, b in vllm_blocks(params, [list(range(tp))], dims)[name] if rank == r]
        return b

    assert block("model.layers.0.self_attn.q_proj.weight", 4, 3) == ((24, 0), (8, 16))  # 2 heads x 4 rows a rank
    # 2 kv heads over tp=4: replicated, ranks 0-1 take head 0, ranks 2-3 head 1
    assert [block("model.layers.0.self_attn.k_proj.weight", 4, r)[0][0] for r in range(4)] == [0, 0, 4, 4]
    assert block("model.layers.0.self_attn.v_proj.weight", 2, 1) == ((4, 0), (4, 16))
    assert block("model.layers.0.mlp.down_proj.weight", 4, 2) == ((0, 20), (16, 10))
    assert block("model.layers.0.mlp.up_proj.weight", 4, 1) == ((10, 0), (10, 16))
    # vocabulary padded to 128 before the split: rank 1 of 2 holds rows 64..99
    assert block("lm_head.weight", 2, 1) == ((64, 0), (36, 16))
    assert block("model.norm.weight", 4, 3) == ((0,), (16,))
    assert block("model.layers.0.self_attn.q_proj.weight", 1, 0) == ((0, 0), (32, 16))


def _params():
    return [("model.embed_tokens.weight", (100, 16)), ("model.layers.0.self_attn.q_proj.weight", (32, 16)),
            ("model.layers.0.self_attn.k_proj.weight", (8, 16)), ("model.layers.0.self_attn.v_proj.weight", (8, 16)),
            ("model.layers.0.self_attn.o_proj.weight", (16, 32)), ("model.layers.0.mlp.gate_proj.weight", (40, 16)),
            ("model.layers.0.mlp.up_proj.weight", (40, 16)), ("model.layers.0.mlp.down_proj.weight", (16, 40)),
            ("model.layers.0.input_layernorm.weight", (16,)), ("lm_head.weight", (100, 16))]


@pytest.mark.quick
@pytest.mark.parametrize("world,actor_tp,rollout_tp", [(2, 1, 2), (2, 2, 2), (4, 1, 2), (4, 2, 2), (4, 2, 4), (8, 4, 2)])
def test_plan_covers_each_needed_element_once_at_the_lower_bound(world, actor_tp, rollout_tp):
    dims = ModelDims(num_heads=8, num_kv_heads=2, head_dim=4, vocab_size=100)
    params = _params()
    dp = world // actor_tp
    grid = [[[d * actor_tp + t for t in range(actor_tp)]] for d in range(dp)]
    groups = [list(range(k * rollout_tp, (k + 1) * rollout_tp)) for k in range(world // rollout_tp)]
    sources, targets = fsdp_blocks(params, grid), vllm_blocks(params, groups, dims)
    plan = plan_sync(params, sources, targets, elem_bytes=2)
    for name, shape in params:
        held = {r: b for r, b in sources[name]}
        for dst, need in targets[name]:
            painted = torch.zeros(shape, dtype=torch.int32)
            for t in plan.transfers[name] + plan.local[name]:
                if t.dst != dst:
                    continue
                if t.src != dst:  # the sender really holds what it sends
                    h = held[t.src]
                    assert all(ho <= o and o + n <= ho + hn for ho, hn, o, n in zip(h[0], h[1], t.block[0], t.block[1]))
                painted[tuple(slice(o, o + n) for o, n in zip(*t.block))] += 1
            want = torch.zeros(shape, dtype=torch.int32)
            want[tuple(slice(o, o + n) for o, n in zip(*need))] = 1
            assert torch.equal(painted, want), (name, dst)
    recv, lb = plan.bytes_recv(), plan.lower_bound()
    assert {r: recv.get(r, 0) for r in lb} == lb
    if actor_tp == rollout_tp and dp == world // actor_tp and world == actor_tp:
        assert sum(recv.values()) == 0


def test_replicas_share_the_sending():
    """A norm replicated over tp=4 actor ranks (dp=2) goes to 8 rollout ranks: sends spread over replicas."""
    params = [("model.norm.weight", (16,))]
    grid = [[[d * 4 + t for t in range(4)]] for d in range(2)]
    targets = {"model.norm.weight": [(r, ((0,), (16,))) for r in range(8)]}  # a norm is whole on every vLLM rank
    plan = plan_sync(params, fsdp_blocks(params, grid), targets, elem_bytes=4)
    senders = {t.src for t in plan.transfers["model.norm.weight"]}
    assert len(senders) > 2


def test_verify_differences_name_each_tensor_that_is_not_bitwise_equal():
    from spmdrl.reshard.verify import differences

    a = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor([1.0, float("nan")]), "i": torch.tensor([1, 2])}
    assert differences(a, {k: v.clone() for k, v in a.items()}) == []  # NaN where both have NaN is equal
    b = {**a, "w": a["w"].clone(), "i": torch.tensor([1, 3])}
    b["w"][1, 2] += 0.5
    nan = {**a, "w": a["w"].clone()}
    nan["w"][0, 0] = float("nan")
    assert differences(a, b) == ["i: 1 of 2 elements differ, max abs diff 1", "w: 1 of 6 elements differ, max abs diff 0.5"]
    assert differences(nan, a) == ["w: 1 of 6 elements differ, max abs diff nan (the engine read buffer memory the sync "
                                   "did not fill)"]
    assert differences(a, {"w": a["w"], "n": a["n"]}) == ["i: missing"]


# ---- real syncs: vLLM in-process, FSDP2 actor, gloo ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("vllm")
    from spmdrl.tiny import build_tiny

    return build_tiny(str(tmp_path_factory.mktemp("reshard") / "model"), seed=0)


@pytest.mark.dist
@pytest.mark.parametrize("world,actor_tp,rollout_tp", [(2, 2, 2), (4, 1, 2), (4, 2, 2)],
                         ids=["actor_tp2_to_rollout_tp2", "actor_dp4_to_rollout_tp2xdp2", "actor_tp2xdp2_to_rollout_tp2xdp2"])
def test_sync_moves_only_the_lower_bound(tiny_model, tmp_path, world, actor_tp, rollout_tp):
    from launching import run

    verify = world == 2  # rollout.verify_sync on the 2-rank run, plus two deliberately wrong syncs it must stop
    run([os.path.join(HERE, "dist_scripts", "reshard_sync.py"), "--model", tiny_model, "--out", str(tmp_path),
         "--actor-tp", str(actor_tp), "--rollout-tp", str(rollout_tp)] + ["--verify"] * verify, nproc=world)
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]
    if verify:
        check_verify_sync(res)
    for r in res:
        m = r["metrics"]
        assert r["n_tokens"] > 0 and r["logprob_max_diff"] < 1e-5, r
        # the transport's count (max over ranks) is the plan's, and it is the lower bound
        assert m["weight_sync/bytes_recv_max"] == max(x["plan_recv"] for x in res)
        assert m["weight_sync/bytes_recv_max"] <= 1.1 * m["weight_sync/bytes_lower_bound"]
        assert r["plan_recv"] == r["plan_lower_bound"]
        assert m["weight_sync/collectives"] == r["plan_summary"]["collectives"]
    if world == actor_tp == rollout_tp:  # training and rollout TP layouts coincide: nothing crosses ranks
        assert all(r["metrics"]["weight_sync/bytes_recv_max"] == 0 and r["tp_sharded_bytes_moved"] == 0 for r in res)
    else:
        # what the old full gather moved per rank (every parameter, fp32) versus now
        assert res[0]["metrics"]["weight_sync/bytes_recv_max"] < 0.5 * res[0]["model_bytes"]


def check_verify_sync(res):
    """rollout.verify_sync let the right sync through (the run got past it) and stopped both wrong ones on every rank,
    naming the parameter (vLLM's name), the rank and the difference."""
    for r in res:
        rule, swap = r["wrong_rule"], r["swapped_rows"]
        # a wrong slicing rule: vLLM narrows its own q rows, where the sync left the NaN fill
        assert "rank 0's rollout engine differs" in rule and "ranks [0, 1] differ" in rule, rule
        assert "model.layers.0.self_attn.qkv_proj.weight" in rule and "max abs diff nan" in rule, rule
        assert "did not fill" in rule, rule
        # two swapped rows on rank 1 only: finite values in the wrong place
        assert "rank 1's rollout engine differs" in swap and "ranks [" not in swap, swap
        m = re.search(r"model\.layers\.1\.mlp\.down_proj\.weight: (\d+) of \d+ elements differ, max abs diff ([0-9.e-]+)$",
                      swap)
        assert m and int(m.group(1)) > 0 and float(m.group(2)) > 0, swap


@pytest.mark.dist
def test_hf_export_streams_buckets_to_one_writer(tiny_model, tmp_path):
    """The SFT save / engine export: no full gather; the written directory loads in transformers exactly."""
    from launching import run

    run([os.path.join(HERE, "dist_scripts", "export_stream.py"), "--model", tiny_model, "--out", str(tmp_path)], nproc=2)
    res = json.load(open(tmp_path / "result.json"))
    for tp in ("tp1", "tp2"):
        assert res[tp]["max_diff"] == 0.0 and not res[tp]["missing"], res[tp]
        assert len(res[tp]["files"]) > 1  # 1 MiB buckets: several safetensors files, one bucket in memory at a time
