"""Megatron-core (tp x pp x dp) as the source of the weight sync: the pure layout against megatron-core's own
stage arithmetic and against a reference fused/sharded Megatron tensor, and plans simulated without processes."""
import os

import pytest
import torch

from spmdrl.errors import LayoutError
from spmdrl.dist.blocks import ModelDims, megatron_blocks, megatron_padded_vocab, megatron_tp_block, numel, pp_stage_layers
from spmdrl.reshard.plan import plan_sync
from spmdrl.reshard.transport import held_shards

from vllm_targets import vllm_blocks

HERE = os.path.dirname(os.path.abspath(__file__))

# a GQA model: 8 heads in 4 query groups of head_dim 4, hidden 16, MLP 24, 4 layers, vocab 100
H, NH, NG, HD, FFN, V, L = 16, 8, 4, 4, 24, 100, 4
DIMS = ModelDims(num_heads=NH, num_kv_heads=NG, head_dim=HD, vocab_size=V)


def params(layers=L, tied=False, bias=True):
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (NH * HD, H)), (p + "self_attn.k_proj.weight", (NG * HD, H)),
                (p + "self_attn.v_proj.weight", (NG * HD, H))]
        if bias:
            out += [(p + "self_attn.q_proj.bias", (NH * HD,)), (p + "self_attn.k_proj.bias", (NG * HD,)),
                    (p + "self_attn.v_proj.bias", (NG * HD,))]
        out += [(p + "self_attn.o_proj.weight", (H, NH * HD)), (p + "mlp.gate_proj.weight", (FFN, H)),
                (p + "mlp.up_proj.weight", (FFN, H)), (p + "mlp.down_proj.weight", (H, FFN)),
                (p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,))]
    out.append(("model.norm.weight", (H,)))
    if not tied:
        out.append(("lm_head.weight", (V, H)))
    return out


def grid_of(dp, pp, tp, base=0):
    """[dp][pp][tp] ranks, tp fastest then pp then dp (megatron's tp-pp-dp order)."""
    return [[[base + (d * pp + p) * tp + t for t in range(tp)] for p in range(pp)] for d in range(dp)]


# ---- the stage split equals megatron-core's ---------------------------------------------------------------------

@pytest.mark.parametrize("layers,pp,vp", [(8, 2, 1), (8, 4, 1), (8, 2, 2), (12, 3, 2), (80, 4, 1), (80, 4, 5)])
def test_pp_stage_layers_match_megatron_core(layers, pp, vp):
    """Reference: megatron-core's get_transformer_layer_offset / get_num_layers_to_build for every (pp, vp) stage."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    c = TransformerConfig(num_layers=layers, hidden_size=16, num_attention_heads=4, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp if vp > 1 else None, pipeline_dtype=torch.float32)
    for p, mine in enumerate(pp_stage_layers(layers, pp, vp)):
        ref = []
        for v in range(vp):
            kw = dict(vp_stage=v) if vp > 1 else {}
            off = get_transformer_layer_offset(c, pp_rank=p, **kw)
            ref += list(range(off, off + get_num_layers_to_build(c, pp_rank=p, **kw)))
        assert mine == ref, (p, mine, ref)


def test_uneven_pipeline_split_is_a_layout_error():
    with pytest.raises(LayoutError, match="80 layers.*pp = 3"):
        pp_stage_layers(80, 3)


# ---- TP blocks: what a Megatron TP rank's fused shard holds, in HF coordinates ----------------------------------

def megatron_fused_shards(hf: dict[str, torch.Tensor], tp: int, vp_rows: int) -> dict[str, list[torch.Tensor]]:
    """Reference Megatron tensors of layer 0 built from HF ones, split the way megatron's parallel layers split
    them: linear_qkv = per query group [its q heads; k; v] rows, column-parallel (dim 0 chunks); linear_fc1 =
    [gate_t; up_t] per tp rank; linear_proj / linear_fc2 row-parallel (dim 1 chunks); embedding rows padded
    to vp_rows with zeros, then dim 0 chunks."""
    p = "model.layers.0."
    q = hf[p + "self_attn.q_proj.weight"].view(NG, NH // NG * HD, H)
    k = hf[p + "self_attn.k_proj.weight"].view(NG, HD, H)
    v = hf[p + "self_attn.v_proj.weight"].view(NG, HD, H)
    qkv = torch.cat([q, k, v], dim=1).reshape(-1, H)
    gate, up = hf[p + "mlp.gate_proj.weight"].chunk(tp), hf[p + "mlp.up_proj.weight"].chunk(tp)
    fc1 = torch.cat([torch.cat([g, u]) for g, u in zip(gate, up)])
    emb = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(vp_rows - V, H)])
    return {"qkv": list(qkv.chunk(tp)), "fc1": list(fc1.chunk(tp)), "emb": list(emb.chunk(tp)),
            "proj": list(hf[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)),
            "fc2": list(hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1))}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_blocks_are_what_megatron_shards_hold(tp):
    torch.manual_seed(0)
    hf = {n: torch.randn(s) for n, s in params(1, bias=False)}
    vp_rows = megatron_padded_vocab(V, tp, divisible_by=8)
    ref = megatron_fused_shards(hf, tp, vp_rows)

    def cut(name, t):
        (o, n) = megatron_tp_block(name, hf[name].shape, tp, t, vp_rows)
        return hf[name][tuple(slice(a, a + b) for a, b in zip(o, n))]

    p = "model.layers.0."
    for t in range(tp):
        g = NG // tp  # query groups on this rank, each [q heads of the group; k; v]
        q = cut(p + "self_attn.q_proj.weight", t).view(g, NH // NG * HD, H)
        k = cut(p + "self_attn.k_proj.weight", t).view(g, HD, H)
        v = cut(p + "self_attn.v_proj.weight", t).view(g, HD, H)
        assert torch.equal(torch.cat([q, k, v], dim=1).reshape(-1, H), ref["qkv"][t])
        assert torch.equal(torch.cat([cut(p + "mlp.gate_proj.weight", t), cut(p + "mlp.up_proj.weight", t)]), ref["fc1"][t])
        assert torch.equal(cut(p + "self_attn.o_proj.weight", t), ref["proj"][t])
        assert torch.equal(cut(p + "mlp.down_proj.weight", t), ref["fc2"][t])
        emb = cut("model.embed_tokens.weight", t)  # the HF rows of the shard; the padding rows are not in HF
        assert torch.equal(emb, ref["emb"][t][: emb.shape[0]]) and not ref["emb"][t][emb.shape[0]:].any()
        assert megatron_tp_block(p + "input_layernorm.weight", (H,), tp, t, vp_rows) == ((0,), (H,))


def test_tp_that_splits_a_query_group_is_a_layout_error():
    with pytest.raises(LayoutError, match="tp = 8 must divide .* 8 attention heads and 4 query groups"):
        megatron_blocks(params(), grid_of(1, 1, 8), num_layers=L, dims=DIMS)
    with pytest.raises(LayoutError, match="down_proj.*24 does not split over Megatron tp = 16"):
        megatron_tp_block("model.layers.0.mlp.down_proj.weight", (H, FFN), 16, 0, 128)


# ---- whole-model layouts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp,pp,tp,tied", [(1, 2, 2, False), (2, 1, 2, False), (1, 2, 2, True), (2, 2, 1, True),
                                           (2, 2, 2, False), (1, 4, 1, False)])
def test_megatron_blocks_partition_each_tensor_per_replica(dp, pp, tp, tied):
    """Each DP replica (and, tied with pp > 1, the first and the last stage each) holds every element exactly
    once; a layer's parameters are held only by the stage megatron builds it on."""
    ps = params(tied=tied)
    grid = grid_of(dp, pp, tp)
    blocks = megatron_blocks(ps, grid, num_layers=L)
    stage_of = {r: p for d in range(dp) for p in range(pp) for r in grid[d][p]}
    dp_of = {r: d for d in range(dp) for p in range(pp) for r in grid[d][p]}
    layers = pp_stage_layers(L, pp)
    for name, shape in ps:
        by_copy: dict[tuple[int, int], set] = {}  # distinct blocks per (dp replica, stage): tp copies count once
        for rank, b in blocks[name]:
            by_copy.setdefault((dp_of[rank], stage_of[rank]), set()).add(b)
        for key, bs in by_copy.items():
            painted = torch.zeros(shape, dtype=torch.int32)
            for o, n in bs:
                painted[tuple(slice(a, a + b) for a, b in zip(o, n))] += 1
            assert bool((painted == 1).all()), (name, key)
            assert len(bs) in (1, tp), (name, bs)  # whole on every tp rank, or one distinct slice per tp rank
        stages = {s for _, s in by_copy}
        assert {d for d, _ in by_copy} == set(range(dp))
        if ".layers." in name:
            i = int(name.split(".")[2])
            assert stages == {next(p for p in range(pp) if i in layers[p])}, name
        elif name == "model.embed_tokens.weight":
            assert stages == ({0, pp - 1} if tied else {0}), name
        else:
            assert stages == {pp - 1}, name


def paint_received(plan, sources, name: str, shape, dst: int) -> torch.Tensor:
    """How many times the plan hands rank `dst` each element of `name` (transfers and local copies), checking that
    the sender (or the rank itself) really holds every block it hands over."""
    held: dict[int, list] = {}
    for r, b in sources[name]:
        held.setdefault(r, []).append(b)
    painted = torch.zeros(shape, dtype=torch.int32)
    for t in plan.transfers[name] + plan.local[name]:
        if t.dst != dst:
            continue
        assert any(all(ho <= o and o + n <= ho + hn for ho, hn, o, n in zip(h[0], h[1], *t.block))
                   for h in held[t.src]), (name, t)
        painted[tuple(slice(o, o + n) for o, n in zip(*t.block))] += 1
    return painted


@pytest.mark.parametrize("dp,pp,tp,rollout_tp,tied", [
    (1, 2, 2, 2, False),  # the e2e layout: TP=2 x PP=2 on 4 ranks -> vLLM TP=2 x DP=2
    (2, 1, 2, 2, False),  # TP=2 x DP=2 -> vLLM TP=2 x DP=2: nothing moves but the other tp group's copies
    (1, 2, 2, 2, True),
    (2, 2, 2, 4, False),  # 8 ranks, rollout TP=4 wider than the actor's TP
    (2, 2, 2, 1, True),
    (1, 4, 2, 8, False),
])
def test_megatron_plan_covers_each_needed_element_once_at_the_lower_bound(dp, pp, tp, rollout_tp, tied):
    ps = params(tied=tied)
    world = dp * pp * tp
    grid = grid_of(dp, pp, tp)
    groups = [list(range(k * rollout_tp, (k + 1) * rollout_tp)) for k in range(world // rollout_tp)]
    sources, targets = megatron_blocks(ps, grid, num_layers=L), vllm_blocks(ps, groups, DIMS)
    plan = plan_sync(ps, sources, targets, elem_bytes=2)
    stage_of = {r: p for d in range(dp) for p in range(pp) for r in grid[d][p]}
    layers = pp_stage_layers(L, pp)
    for name, shape in ps:
        for dst, need in targets[name]:
            painted = paint_received(plan, sources, name, shape, dst)
            if ".layers." in name:  # pp stages send only their own layers
                assert all(int(name.split(".")[2]) in layers[stage_of[t.src]]
                           for t in plan.transfers[name] + plan.local[name] if t.dst == dst)
            want = torch.zeros(shape, dtype=torch.int32)
            want[tuple(slice(o, o + n) for o, n in zip(*need))] = 1
            assert torch.equal(painted, want), (name, dst)
    recv, lb = plan.bytes_recv(), plan.lower_bound()
    assert {r: recv.get(r, 0) for r in lb} == lb
    s = plan.summary(1 << 20)
    assert s["bytes_recv_max"] <= 1.1 * s["bytes_lower_bound"]


def test_dp_replicas_share_the_sending():
    """TP=2 x PP=2 x DP=2 (8 ranks) -> vLLM TP=2: every layer has two DP copies; both send, about equally."""
    ps = params()
    grid = grid_of(2, 2, 2)
    groups = [[2 * k, 2 * k + 1] for k in range(4)]
    plan = plan_sync(ps, megatron_blocks(ps, grid, num_layers=L), vllm_blocks(ps, groups, DIMS), elem_bytes=2)
    sent = plan.bytes_sent()
    assert set(sent) == set(range(8))  # every actor rank sends something
    for d0, d1 in zip(sum(grid[0], []), sum(grid[1], [])):  # a rank and its DP twin send about the same
        assert abs(sent[d0] - sent[d1]) <= 0.25 * max(sent[d0], sent[d1]), sent
    # an unbalanced choice (always the first replica) would have one replica send everything
    assert max(sent.values()) < 0.75 * sum(sent.values()) / 4


def test_megatron_blocks_at_70b_scale():
    """Llama-3.3-70B (80 layers, 64 heads / 8 kv groups, vocab 128256) at TP=8 x PP=2 x DP=2 (32 ranks) ->
    vLLM TP=8 in bf16: each rollout rank receives exactly what it lacks of its vLLM shard (its own stage's
    layers are already local), and the DP replicas split the sending."""
    from spmdrl.models.model import load_hf_config, model_param_shapes
    from spmdrl.reshard.vllm_reads import rollout_targets

    hf = load_hf_config("meta-llama/Llama-3.3-70B-Instruct")
    ps = model_param_shapes(hf)
    grid = grid_of(2, 2, 8)
    groups = [list(range(8 * k, 8 * k + 8)) for k in range(4)]
    plan = plan_sync(ps, megatron_blocks(ps, grid, num_layers=80), rollout_targets(ps, groups, hf, True)[0], elem_bytes=2)
    s = plan.summary(1 << 30)
    total = sum(numel(((0,) * len(sh), sh)) for _, sh in ps)
    assert total == 70_553_706_496
    shard = sum(numel(b) for ts in plan.targets.values() for r, b in ts if r == 0) * 2
    # rank 0 (stage 0, tp 0) holds 40 layers' tp shard and the embedding shard: it lacks the other 40 layers',
    # the final norm and lm_head's shard
    assert s["bytes_recv_max"] == s["bytes_lower_bound"] < shard
    assert 0.45 * shard < s["bytes_lower_bound"] < 0.55 * shard
    assert s["bytes_sent_max"] <= 1.1 * s["bytes_recv_total"] / 32 * 2  # no rank sends much more than its share


def test_value_head_model_has_no_embedding_copy():
    """A critic (value head, no lm_head) does not share its embedding with an output layer: first stage only."""
    ps = params(tied=True) + [("score.weight", (1, H)), ("score.bias", (1,))]
    grid = grid_of(1, 2, 2)
    b = megatron_blocks(ps, grid, num_layers=L)
    assert {r for r, _ in b["model.embed_tokens.weight"]} == set(grid[0][0])
    assert b["score.weight"] == [(r, ((0, 0), (1, H))) for r in grid[0][1]]
    tied = megatron_blocks(params(tied=True), grid, num_layers=L)
    assert {r for r, _ in tied["model.embed_tokens.weight"]} == set(grid[0][0] + grid[0][1])
    no_copy = megatron_blocks(params(tied=True), grid, num_layers=L, tied_copy=False)
    assert {r for r, _ in no_copy["model.embed_tokens.weight"]} == set(grid[0][0])


@pytest.mark.parametrize("dp,pp,tp,tied,bias,value_head,qk_norm", [
    (1, 2, 2, False, True, False, False), (2, 1, 2, True, False, False, False), (1, 2, 2, True, True, False, False),
    (2, 2, 1, False, False, True, False), (1, 4, 2, False, True, True, False), (2, 2, 2, True, False, False, False),
    (1, 2, 2, False, False, False, True), (2, 2, 2, True, False, True, True),  # Qwen3: q_norm / k_norm
])
def test_engine_pieces_agree_with_megatron_blocks(dp, pp, tp, tied, bias, value_head, qk_norm):
    """The Megatron engine's own HF<->Megatron piece arithmetic (what its weight_shards yields, from the fused
    megatron tensors) holds exactly the blocks megatron_blocks says, rank by rank (the engine does not yield
    the last stage's copy of a tied embedding: tied_copy=False)."""
    from spmdrl.engines.megatron.convert import Dims, hf_param_shapes, padded_vocab
    from spmdrl.engines.megatron.convert import source_blocks as engine_blocks

    dims = Dims(hidden=H, heads=NH, groups=NG, head_dim=HD, ffn=FFN, vocab=V, vocab_padded=padded_vocab(V, 8, tp),
                layers=L, tie=tied, qkv_bias=bias, value_head=value_head, qk_norm=qk_norm)
    ps = hf_param_shapes(dims)
    grid = grid_of(dp, pp, tp)
    mine = megatron_blocks(ps, grid, num_layers=L, padded_vocab=dims.vocab_padded, dims=DIMS,
                           tied=tied and not value_head, tied_copy=False)
    theirs = engine_blocks(dims, grid)
    assert set(mine) == set(theirs) == {n for n, _ in ps}
    assert qk_norm == ("model.layers.0.self_attn.q_norm.weight" in mine)
    for name in mine:
        assert sorted(mine[name]) == sorted(theirs[name]), name


def test_qwen3_sync_from_megatron_plans_q_k_norms_at_the_lower_bound():
    """A Qwen3 (head_dim 32 set explicitly, heads * head_dim != hidden) trained at megatron tp 2 x pp 2 synced
    into vLLM tp 2, targets learnt from vLLM's own Qwen3 loaders: q_norm / k_norm are whole on both tp ranks of
    their layer's stage and on every vLLM rank, and the plan hands each rollout rank every element it needs
    exactly once, at the lower bound (nothing on the whole-tensor route)."""
    pytest.importorskip("vllm")
    from transformers import Qwen3Config

    from spmdrl.engines.megatron.convert import dims_from_hf, hf_param_shapes
    from spmdrl.engines.megatron.convert import source_blocks as engine_blocks
    from spmdrl.reshard.vllm_reads import rollout_targets

    cfg = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, use_sliding_window=False,
                      max_position_embeddings=256, architectures=["Qwen3ForCausalLM"])  # as config.json has it
    dims = dims_from_hf(cfg, tp=2, divisible_by=8)
    ps = hf_param_shapes(dims)
    grid = grid_of(1, 2, 2)
    sources = megatron_blocks(ps, grid, num_layers=L, padded_vocab=dims.vocab_padded,
                              dims=ModelDims.from_hf_config(cfg))
    assert {n: sorted(b) for n, b in sources.items()} == {n: sorted(b) for n, b in engine_blocks(dims, grid).items()}
    targets, reads = rollout_targets(ps, [[0, 1], [2, 3]], cfg, loads_tp_shards=True)
    assert not reads.whole, reads.whole
    norms = [n for n, _ in ps if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * L
    for name in norms:
        stage = next(p for p, layers in enumerate(pp_stage_layers(L, 2)) if int(name.split(".")[2]) in layers)
        assert sorted(sources[name]) == [(r, ((0,), (32,))) for r in grid[0][stage]], name
        assert sorted(targets[name]) == [(r, ((0,), (32,))) for r in range(4)], name
    plan = plan_sync(ps, sources, targets, elem_bytes=2)
    for name, shape in ps:
        for dst, need in targets[name]:
            painted = torch.zeros(shape, dtype=torch.int32)
            for t in plan.transfers[name] + plan.local[name]:
                if t.dst == dst:
                    painted[tuple(slice(o, o + n) for o, n in zip(*t.block))] += 1
            want = torch.zeros(shape, dtype=torch.int32)
            want[tuple(slice(o, o + n) for o, n in zip(*need))] = 1
            assert torch.equal(painted, want), (name, dst)
    recv, lb = plan.bytes_recv(), plan.lower_bound()
    assert {r: recv.get(r, 0) for r in lb} == lb and max(lb.values()) > 0


def test_sync_refuses_shards_that_disagree_with_the_plan():
    """WeightSync checks once that weight_shards yields exactly the plan's blocks for the rank."""
    from spmdrl.reshard.sync import check_shards

    ps = params(layers=2)
    grid = grid_of(1, 2, 2)
    plan = plan_sync(ps, megatron_blocks(ps, grid, num_layers=2), vllm_blocks(ps, [[0, 1], [2, 3]], DIMS), 2)
    rank = 1  # stage 0, tp 1: embedding shard and layer 0
    shards = held_shards((n, torch.zeros(b[1]), b) for n, bs in plan.sources.items() for r, b in bs if r == rank)
    check_shards(plan, shards, rank)
    q = "model.layers.0.self_attn.q_proj.weight"
    wrong = dict(shards)
    wrong[q] = {((0, 0), (16, H)): torch.zeros(16, H)}  # tp rank 0's rows
    with pytest.raises(RuntimeError, match="q_proj.*expects"):
        check_shards(plan, wrong, rank)
    with pytest.raises(RuntimeError, match="layers.1"):  # a layer of the other stage
        check_shards(plan, {**shards, "model.layers.1.input_layernorm.weight": {((0,), (H,)): torch.zeros(H)}}, rank)


# ---- mixtures of experts: expert parallelism over the dp replicas -------------------------------------------------

def moe_config(experts=4, ffn=32, layers=2, arch="qwen3_moe"):
    """A tiny Qwen3-MoE config (no weights): 4 experts of FFN width 32, hidden 64, 4 heads of 32 in 2 kv groups; or
    (arch "qwen2_moe") a Qwen2-MoE of those sizes with a shared expert of width 64, q/k/v biases and top-k weights
    not renormalised."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=ffn, num_experts=experts,
              num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
              use_sliding_window=False, max_position_embeddings=256)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**kw, norm_topk_prob=False, shared_expert_intermediate_size=64,
                              architectures=["Qwen2MoeForCausalLM"])
    return Qwen3MoeConfig(**kw, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])


def megatron_local_experts(gate_up: torch.Tensor, down: torch.Tensor, tp: int, ep: int):
    """Reference: megatron's SequentialMLP weights of every (expert-parallel rank e, tp rank t), built from HF's
    fused tensors the way megatron holds them: local expert j of rank e is global expert e * E / ep + j; its
    linear_fc1 is [gate_t; up_t] (the GLU halves of this tp rank's columns), its linear_fc2 the tp rank's
    columns of down_proj."""
    E, F = gate_up.shape[0], gate_up.shape[1] // 2
    out = {}
    for e in range(ep):
        for t in range(tp):
            fc1, fc2 = [], []
            for j in range(E // ep):
                g = e * E // ep + j
                gate, up = gate_up[g, :F].chunk(tp)[t], gate_up[g, F:].chunk(tp)[t]
                fc1.append(torch.cat([gate, up]))
                fc2.append(down[g].chunk(tp, dim=1)[t])
            out[e, t] = (fc1, fc2)
    return out


@pytest.mark.parametrize("dp,tp,ep", [(2, 1, 2), (2, 2, 2), (4, 1, 4), (4, 2, 2), (4, 1, 2)])
def test_expert_blocks_are_what_megatron_expert_shards_hold(dp, tp, ep):
    """Every rank's blocks of the fused expert tensors, cut from random HF tensors, are exactly the weights of its
    megatron local experts (the reference above); the rank's expert-parallel rank is dist.layout's; the router is
    whole everywhere; and each expert-data-parallel replica's distinct blocks partition each expert tensor once."""
    from spmdrl.dist.layout import RoleLayout
    from spmdrl.models.model import model_param_shapes

    ps = model_param_shapes(moe_config())
    shapes = dict(ps)
    gu, dn, router = "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.gate.weight"
    assert shapes[gu] == (4, 64, 64) and shapes[dn] == (4, 64, 32) and shapes[router] == (4, 64)
    torch.manual_seed(0)
    hf = {gu: torch.randn(shapes[gu]), dn: torch.randn(shapes[dn])}
    ref = megatron_local_experts(hf[gu], hf[dn], tp, ep)
    grid = grid_of(dp, 1, tp)
    lay = RoleLayout("actor", tuple(range(dp * tp)), dp, 1, tp, ep=ep)
    blocks = megatron_blocks(ps, grid, num_layers=2, dims=ModelDims.from_hf_config(moe_config()), ep=ep)

    def cut(name, rank):
        return [hf[name][tuple(slice(o, o + n) for o, n in zip(*b))] for r, b in blocks[name] if r == rank]

    for d in range(dp):
        for t in range(tp):
            rank = grid[d][0][t]
            e = lay.ep_coords(rank)[0]
            fc1, fc2 = ref[e, t]
            pieces = cut(gu, rank)
            assert len(pieces) == (2 if tp > 1 else 1)  # gate rows and up rows: two blocks when tp splits each half
            if tp > 1:
                gate, up = pieces
            else:
                gate, up = pieces[0].chunk(2, dim=1)
            assert torch.equal(torch.cat([gate, up], dim=1), torch.stack(fc1)), (d, t)
            (down,) = cut(dn, rank)
            assert torch.equal(down, torch.stack(fc2)), (d, t)
            assert [b for r, b in blocks[router] if r == rank] == [((0, 0), (4, 64))]
    for name in (gu, dn):
        for x in range(dp // ep):  # replicas d with d // ep == x hold every expert once
            painted = torch.zeros(shapes[name], dtype=torch.int32)
            for d in range(x * ep, (x + 1) * ep):
                for b in {b for r, b in blocks[name] if r in grid[d][0]}:
                    painted[tuple(slice(o, o + n) for o, n in zip(*b))] += 1
            assert bool((painted == 1).all()), (name, x)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("dp,tp,ep,pp", [(2, 1, 2, 1), (2, 2, 2, 1), (4, 2, 2, 1), (4, 1, 4, 1), (2, 2, 2, 2)])
def test_engine_expert_pieces_agree_with_megatron_blocks(dp, tp, ep, pp, arch):
    """The Megatron engine's piece arithmetic for a mixture of experts (convert.source_blocks: what its weight_shards
    yields from its local experts, and Qwen2-MoE's shared expert and its gate) holds exactly the blocks the planner's
    megatron_blocks says, rank by rank, with the ranks' expert-parallel ranks from dist.layout (the engine's weight
    sync plans with megatron_blocks). The shared expert is cut like a dense MLP and held alike by every ep rank."""
    from spmdrl.dist.layout import RoleLayout
    from spmdrl.models.model import model_param_shapes
    from spmdrl.engines.megatron.convert import dims_from_hf, hf_param_shapes
    from spmdrl.engines.megatron.convert import source_blocks as engine_blocks

    cfg = moe_config(arch=arch)
    dims = dims_from_hf(cfg, tp=tp, divisible_by=8)
    lay = RoleLayout("actor", tuple(range(dp * tp * pp)), dp, pp, tp, ep=ep)
    grid = lay.mesh_ranks()
    mine = megatron_blocks(hf_param_shapes(dims), grid, num_layers=2, padded_vocab=dims.vocab_padded,
                           dims=ModelDims.from_hf_config(cfg), tied=False, tied_copy=False, ep=ep)
    theirs = engine_blocks(dims, grid, ep, {r: lay.ep_coords(r)[0] for r in lay.ranks})
    assert set(mine) == set(theirs)
    assert any("experts" in n for n in mine)
    for name in mine:
        assert sorted(mine[name]) == sorted(theirs[name]), name
    assert hf_param_shapes(dims) == model_param_shapes(cfg)  # transformers' names, shapes and order
    if arch == "qwen2_moe":
        p, f = "model.layers.1.mlp.", 64 // tp  # the shared expert's width 64 over tp
        for r in lay.ranks:
            _, stage, t = lay.coords(r)
            held = stage == pp - 1  # layer 1 of 2 is on the last stage
            assert [b for x, b in mine[p + "shared_expert.gate_proj.weight"] if x == r] == [((t * f, 0), (f, 64))] * held
            assert [b for x, b in mine[p + "shared_expert.down_proj.weight"] if x == r] == [((0, t * f), (64, f))] * held
            assert [b for x, b in mine[p + "shared_expert_gate.weight"] if x == r] == [((0, 0), (1, 64))] * held


def test_expert_layouts_that_do_not_split_are_layout_errors():
    from spmdrl.models.model import model_param_shapes

    ps = model_param_shapes(moe_config(experts=6))
    with pytest.raises(LayoutError, match="6 experts do not split over expert parallelism ep = 4"):
        megatron_blocks(ps, grid_of(4, 1, 1), num_layers=2, ep=4)
    ps = model_param_shapes(moe_config(ffn=36))
    with pytest.raises(LayoutError, match="FFN width 36 does not split over Megatron tp = 8"):
        megatron_blocks(ps, grid_of(1, 1, 8), num_layers=2)


def _moe_reads(arch: str):
    pytest.importorskip("vllm")
    from spmdrl.models.model import model_param_shapes
    from spmdrl.reshard.vllm_reads import probe_vllm_reads

    cfg = moe_config(arch=arch)
    ps = model_param_shapes(cfg)
    return cfg, ps, probe_vllm_reads(cfg, ps, 2)


@pytest.fixture(scope="module")
def moe_rollout_tp2():
    """The tiny Qwen3-MoE's parameters and what vLLM's own loaders read of them at rollout TP = 2 (one probe)."""
    return _moe_reads("qwen3_moe")


@pytest.fixture(scope="module")
def shared_moe_rollout_tp2():
    """The same for the tiny Qwen2-MoE (shared expert)."""
    return _moe_reads("qwen2_moe")


@pytest.mark.parametrize("reads_of", ["moe_rollout_tp2", "shared_moe_rollout_tp2"], ids=["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("dp,tp,ep,pp", [(2, 1, 2, 1), (2, 2, 2, 1), (2, 1, 2, 2)], ids=["ep2", "ep2xtp2", "ep2xpp2"])
def test_moe_plan_from_expert_parallel_megatron_at_the_lower_bound(request, reads_of, dp, tp, ep, pp):
    """Megatron EP = 2 (dp 2), EP = 2 x TP = 2 and EP = 2 x PP = 2 (4 ranks, pipeline stages outermost) into vLLM TP = 2, targets learnt from vLLM's Qwen3-MoE
    and Qwen2-MoE loaders: every element a rollout rank's loaders read is handed to it exactly once, by a rank that
    holds it, and nothing else; each rank receives exactly the lower bound; and of the expert tensors each rollout
    rank receives exactly the slices its vLLM shard reads that its own Megatron blocks lack (painted by hand from the
    layout: its stage's layer, its ep rank's experts, its tp share). Without pipeline parallelism Qwen2-MoE's shared
    expert and its gate never move: each rank holds them whole (tp 1) or holds the same tensor-parallel shard its
    vLLM rank reads (tp 2)."""
    from spmdrl.dist.layout import RoleLayout
    from spmdrl.reshard.vllm_reads import vllm_targets

    cfg, ps, reads = request.getfixturevalue(reads_of)
    assert not reads.whole, reads.whole
    world = dp * tp * pp
    lay = RoleLayout("actor", tuple(range(world)), dp, pp, tp, ep=ep)
    grid = lay.mesh_ranks()
    if pp > 1:  # stages outermost: stage p is ranks [p * dp * tp, (p + 1) * dp * tp)
        assert grid == [[[p * dp * tp + d * tp + t for t in range(tp)] for p in range(pp)] for d in range(dp)]
    groups = [list(range(k * 2, k * 2 + 2)) for k in range(world // 2)]
    sources = megatron_blocks(ps, grid, num_layers=2, dims=ModelDims.from_hf_config(cfg), ep=ep)
    targets = vllm_targets(ps, groups, reads)
    plan = plan_sync(ps, sources, targets, elem_bytes=2)
    experts = [n for n, _ in ps if ".mlp.experts." in n]
    assert len(experts) == 4
    E, F = 4, 32
    for name, shape in ps:
        for dst in sorted({r for r, _ in targets[name]}):
            painted = paint_received(plan, sources, name, shape, dst)
            want = torch.zeros(shape, dtype=torch.int32)
            for r, need in targets[name]:
                if r == dst:
                    want[tuple(slice(o, o + n) for o, n in zip(*need))] = 1
            assert torch.equal(painted, want), (name, dst)
            if name in experts:
                # what this rank's Megatron blocks hold, by hand: experts of its ep rank, its tp share of the FFN
                d, p, t = lay.coords(dst)
                e = lay.ep_coords(dst)[0]
                mine = torch.zeros(shape, dtype=torch.bool)
                xs, f = slice(e * E // ep, (e + 1) * E // ep), slice(t * F // tp, (t + 1) * F // tp)
                on_stage = int(name.split(".")[2]) * pp // 2 == p  # 2 layers: layer i on stage i * pp // 2
                if on_stage and name.endswith("gate_up_proj"):
                    mine[xs, f] = True
                    mine[xs, F + f.start: F + f.stop] = True
                elif on_stage:
                    mine[xs, :, f] = True
                got = sum(numel(x.block) for x in plan.transfers[name] if x.dst == dst)
                assert got == int((want.bool() & ~mine).sum()) > 0, (name, dst)
                assert sum(numel(x.block) for x in plan.local[name] if x.dst == dst) == int((want.bool() & mine).sum())
    recv, lb = plan.bytes_recv(), plan.lower_bound()
    assert {r: recv.get(r, 0) for r in lb} == lb and max(lb.values()) > 0
    shared = [n for n, _ in ps if ".mlp.shared_expert" in n]
    assert len(shared) == (8 if cfg.model_type == "qwen2_moe" else 0)
    for name in shared if pp == 1 else []:
        assert not plan.transfers.get(name) and plan.local[name], name
    if tp == 2:  # gate_up_proj: tp rank t holds two blocks (its gate rows, its up rows) and sends from both
        gu = "model.layers.0.mlp.experts.gate_up_proj"
        assert len([b for r, b in sources[gu] if r == 0]) == 2
        assert {x.block[1][1] for x in plan.transfers[gu] if x.src == 2} == {F // 2}
        assert len({x.block for x in plan.transfers[gu] if x.src == 2}) == 2


@pytest.mark.dist
def test_transport_sends_from_several_blocks_of_one_parameter(moe_rollout_tp2, tmp_path):
    """4 gloo processes, Megatron EP = 2 x TP = 2 -> vLLM TP = 2 x DP = 2 (targets learnt from vLLM's loaders): a
    rank holds its gate rows and its up rows of every gate_up_proj as two blocks; the transport cuts each transfer
    from the block that holds it. Every rollout rank assembles exactly the reference values in every block its
    loaders read (NaN elsewhere), receiving the plan's bytes; verify's whole-tensor gather and the HF export from
    the same blocks give back every reference tensor."""
    import json

    from launching import run
    from spmdrl.reshard.vllm_reads import vllm_targets

    _, ps, reads = moe_rollout_tp2
    targets = vllm_targets(ps, [[0, 1], [2, 3]], reads)
    spec = {"params": ps, "targets": targets, "dp": 2, "tp": 2, "ep": 2, "layers": 2}
    (tmp_path / "plan.json").write_text(json.dumps(spec))
    run([os.path.join(HERE, "dist_scripts", "moe_reshard.py"), "--plan", str(tmp_path / "plan.json"),
         "--out", str(tmp_path)], nproc=4, timeout=300)
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    names = sorted(n for n, _ in ps)
    for r in res:
        assert r["blocks_per_name"]["model.layers.0.mlp.experts.gate_up_proj"] == 2
        assert r["delivered"] == names and not r["bad"] and not r["outside_not_nan"], r
        assert r["bytes_recv"] == r["plan_recv"] > 0
        assert r["whole_equal"] == names
    assert res[0]["export_equal"] == names


def test_vllm_expert_parallel_targets_whole_experts_and_megatron_ep_keeps_them_local(moe_rollout_tp2):
    """rollout.expert_parallel: what vLLM's loaders read with enable_expert_parallel at TP = 2, learnt by the probe
    (vLLM's expert maps built for real): rank r reads experts [r E / 2, (r + 1) E / 2) whole, and the rest as without
    it. From Megatron EP = 2 (dp 2, ranks 0 and 1 = vLLM's TP group) every rollout rank already holds exactly its
    experts: the plan moves none of their bytes, and each rank still receives exactly the lower bound."""
    from spmdrl.reshard.vllm_reads import probe_vllm_reads, vllm_targets

    cfg, ps, tp_reads = moe_rollout_tp2
    reads = probe_vllm_reads(cfg, ps, 2, expert_parallel=True)
    assert not reads.whole, reads.whole
    E = 4
    for name, shape in ps:
        for r in range(2):
            got = reads.blocks(name, shape, r)
            if ".mlp.experts." in name:
                assert got == [((r * E // 2,) + (0,) * (len(shape) - 1), (E // 2,) + tuple(shape[1:]))], (name, r)
            else:
                assert got == tp_reads.blocks(name, shape, r), (name, r)
    sources = megatron_blocks(ps, grid_of(2, 1, 1), num_layers=2, dims=ModelDims.from_hf_config(cfg), ep=2)
    plan = plan_sync(ps, sources, vllm_targets(ps, [[0, 1]], reads), elem_bytes=2)
    experts = [n for n, _ in ps if ".mlp.experts." in n]
    assert experts and all(not plan.transfers[n] for n in experts)
    assert {x.dst for n in experts for x in plan.local[n]} == {0, 1}
    recv, lb = plan.bytes_recv(), plan.lower_bound()
    assert {r: recv.get(r, 0) for r in lb} == lb
