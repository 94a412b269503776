"""Pure parts of the Megatron backend (no process group): the HF <-> Megatron block arithmetic and the config keys.

The engine's numerics against real megatron-core are in tests/test_megatron_engine.py; these check the block
layout the weight sync relies on (spmdrl/reshard/plan.py's Megatron source layout must agree with it)."""
import itertools

import pytest
import torch

pytest.importorskip("megatron.core")
from spmdrl.engines.megatron.convert import (dims_from_hf, hf_param_shapes, hf_pieces, padded_vocab,  # noqa: E402
                                             source_blocks, stage_layers, stage_megatron_names)
from spmdrl.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def _config(**kw):
    from transformers import Qwen2Config

    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, tie_word_embeddings=False)
    return Qwen2Config(**{**base, **kw})


def _qwen3_config(**kw):
    """Qwen3: per-head q / k norms, no q/k/v bias, head_dim 32 set explicitly (heads * head_dim = 256 != hidden)."""
    from transformers import Qwen3Config

    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=32, tie_word_embeddings=False, use_sliding_window=False)
    return Qwen3Config(**{**base, **kw})


def _grid(dp, pp, tp):
    r = iter(range(dp * pp * tp))
    return [[[next(r) for _ in range(tp)] for _ in range(pp)] for _ in range(dp)]


@pytest.mark.parametrize("dp,pp,tp,tie,arch", [(1, 1, 1, False, "qwen2"), (2, 1, 2, False, "qwen2"),
                                                (1, 2, 2, True, "qwen2"), (2, 2, 4, False, "qwen2"),
                                                (1, 2, 2, False, "qwen3"), (2, 2, 4, True, "qwen3")])
def test_source_blocks_tile_every_hf_parameter_once(dp, pp, tp, tie, arch):
    dims = dims_from_hf((_config if arch == "qwen2" else _qwen3_config)(tie_word_embeddings=tie), tp=tp)
    shapes = dict(hf_param_shapes(dims))
    if arch == "qwen3":  # the HF model's own parameter list: q/k norms [head_dim], no q/k/v bias
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(_qwen3_config(tie_word_embeddings=tie))
        assert list(shapes.items()) == [(n, tuple(p.shape)) for n, p in hf.named_parameters()]
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == (32,)
    blocks = source_blocks(dims, _grid(dp, pp, tp))
    assert blocks.keys() == shapes.keys()
    for name, shape in shapes.items():
        cover = torch.zeros(shape, dtype=torch.int32)
        for offs, size in {b for _, b in blocks[name]}:  # distinct blocks; replicas hold identical ones
            cover[tuple(slice(o, o + s) for o, s in zip(offs, size))] += 1
        assert bool((cover == 1).all()), name
        holders = {r for r, _ in blocks[name]}
        assert len(holders) == len(blocks[name])  # one block per holding rank
        if name.startswith("model.layers."):  # only the ranks of the stage that owns the layer
            layer = int(name.split(".")[2])
            stage = next(p for p in range(pp) if layer in stage_layers(dims.layers, pp, p))
            assert holders == {g[stage][t] for g in _grid(dp, pp, tp) for t in range(tp)}


def test_fused_qkv_and_gate_up_rows_follow_megatrons_layout():
    """Megatron's linear_qkv of tp rank t is [for each of its query groups: q heads, k head, v head] and its
    linear_fc1 is [gate share; up share]: build both from full HF tensors the megatron way and compare with
    what hf_pieces says each row range holds."""
    tp, H = 2, 64
    dims = dims_from_hf(_config(), tp=tp)
    hd, ng, qpg = dims.head_dim, dims.groups, dims.heads // dims.groups
    q = torch.randn(dims.heads * hd, H)
    k, v = torch.randn(ng * hd, H), torch.randn(ng * hd, H)
    fused = torch.cat([q.view(ng, qpg * hd, H), k.view(ng, hd, H), v.view(ng, hd, H)], dim=1)  # [ng, (qpg+2)hd, H]
    gate, up = torch.randn(dims.ffn, H), torch.randn(dims.ffn, H)
    full = {"q_proj": q, "k_proj": k, "v_proj": v, "gate_proj": gate, "up_proj": up}
    for t in range(tp):
        local_qkv = fused[t * ng // tp: (t + 1) * ng // tp].reshape(-1, H)
        f = dims.ffn // tp
        local_fc1 = torch.cat([gate[t * f: (t + 1) * f], up[t * f: (t + 1) * f]])
        for mname, local in (("decoder.layers.0.self_attention.linear_qkv.weight", local_qkv),
                             ("decoder.layers.0.mlp.linear_fc1.weight", local_fc1)):
            pieces = hf_pieces(mname, dims, tp, t, 0)
            assert sum(pc.rows[1] - pc.rows[0] for pc in pieces) == local.shape[0]
            for pc in pieces:
                src = full[pc.hf_name.split(".")[-2]]
                (r0, c0), (nr, nc) = pc.block
                assert torch.equal(local[pc.rows[0]: pc.rows[1]], src[r0: r0 + nr, c0: c0 + nc]), (t, pc)


def test_qwen3_q_k_norms_are_whole_on_every_tp_rank_and_sliding_windows_are_refused():
    """megatron's q_layernorm / k_layernorm are one [head_dim] weight shared by all heads: every tp rank of the
    layer's stage holds HF's q_norm / k_norm whole. A config with sliding-window layers is refused (the
    backend's attention is full causal attention)."""
    dims = dims_from_hf(_qwen3_config(), tp=2)
    assert dims.qk_norm and not dims.qkv_bias and dims.head_dim == 32
    for t in range(2):
        for kind, hf in (("q", "q_norm"), ("k", "k_norm")):
            got = hf_pieces(f"decoder.layers.1.self_attention.{kind}_layernorm.weight", dims, 2, t, 2)
            assert [(pc.hf_name, pc.block, pc.rows) for pc in got] == [
                (f"model.layers.3.self_attn.{hf}.weight", ((0,), (32,)), (0, 32))]
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in stage_megatron_names(dims, 2, 0)
    assert not dims_from_hf(_config(), tp=2).qk_norm
    with pytest.raises(ConfigError, match=r"layers \[2, 3\] of this qwen3 model use sliding-window attention"):
        dims_from_hf(_qwen3_config(use_sliding_window=True, sliding_window=16, max_window_layers=2), tp=1)


def test_vocabulary_padding_and_trimming():
    assert padded_vocab(151936, 128, 1) == 151936 and padded_vocab(300, 128, 2) == 512
    dims = dims_from_hf(_config(), tp=2)
    rows = [hf_pieces("embedding.word_embeddings.weight", dims, 2, t, 0)[0] for t in range(2)]
    assert [(pc.block, pc.rows) for pc in rows] == [(((0, 0), (256, 64)), (0, 256)), (((256, 0), (44, 64)), (0, 44))]
    tied_copy = hf_pieces("output_layer.weight", dims_from_hf(_config(tie_word_embeddings=True), tp=1), 1, 0, 2,
                          last_stage_copy=True)
    assert tied_copy == []


def test_layouts_megatron_cannot_shard_are_refused():
    with pytest.raises(ConfigError, match="num_key_value_heads = 4 must be divisible by tp = 8"):
        dims_from_hf(_config(), tp=8)
    with pytest.raises(ConfigError, match="not divisible by pp = 3"):
        stage_layers(4, 3, 0)


@pytest.mark.parametrize("config", [_config, _qwen3_config])
def test_stage_names_cover_the_model_once(config):
    dims = dims_from_hf(config(), tp=1)
    names = [(p, m) for p in range(2) for m in stage_megatron_names(dims, 2, p)]
    hf = {pc.hf_name for p, m in names for pc in hf_pieces(m, dims, 1, 0, stage_layers(4, 2, p).start)}
    assert hf == {n for n, _ in hf_param_shapes(dims)}
    assert len(list(itertools.chain(names))) == len(set(names))


def test_config_accepts_megatron_and_rejects_unknown_backends():
    from spmdrl.config.loader import load_config
    from spmdrl.config.validate import validate
    from spmdrl.engines import role_backend

    cfg = load_config(None, ["model.path=/models/tiny", 'data.train_files=["train.parquet"]'])
    cfg.trainer.backend, cfg.trainer.critic_backend = "megatron", "fsdp"
    validate(cfg, 1)
    assert (role_backend(cfg, "actor"), role_backend(cfg, "ref"), role_backend(cfg, "critic")) == ("megatron", "megatron", "fsdp")
    cfg.trainer.critic_backend = "deepspeed"
    with pytest.raises(ConfigError, match="trainer.critic_backend = 'deepspeed'"):
        validate(cfg, 1)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_shapes_and_expert_blocks_follow_the_contract(arch):
    """A mixture of experts in HF coordinates is transformers' in-memory model (model_param_shapes, the FSDP2
    backend's): same names, shapes and order. At dp 4 x tp 2 with ep 2, rank (d, t) holds experts
    [e*E/ep, (e+1)*E/ep) with e = d % ep: gate rows t*F/tp + [0, F/tp) and up rows F + t*F/tp + [0, F/tp) of
    gate_up_proj (two blocks; one block at tp 1) and columns t*F/tp + [0, F/tp) of down_proj; the router whole.
    Each expert-data-parallel replica (the dp ranks d // ep = x) tiles every parameter exactly once."""
    from spmdrl.dist.layout import RoleLayout
    from spmdrl.models.model import model_param_shapes
    from spmdrl.tiny import build_model

    cfg = build_model(arch=arch, num_layers=2).config
    E, H = 4, cfg.hidden_size
    F = cfg.intermediate_size if arch == "mixtral" else cfg.moe_intermediate_size
    for dp, tp, ep in ((2, 1, 2), (4, 2, 2)):
        dims = dims_from_hf(cfg, tp=tp)
        assert hf_param_shapes(dims) == model_param_shapes(cfg)
        grid, layout = _grid(dp, 1, tp), RoleLayout("actor", tuple(range(dp * tp)), dp, 1, tp, 1, ep)
        blocks = source_blocks(dims, grid, ep, {r: layout.ep_coords(r)[0] for r in layout.ranks})
        n, f = E // ep, F // tp
        for d, t in itertools.product(range(dp), range(tp)):
            rank, e = grid[d][0][t], d % ep
            held = {name: sorted(b for r, b in bs if r == rank) for name, bs in blocks.items()}
            gate, up = ((e * n, t * f, 0), (n, f, H)), ((e * n, F + t * f, 0), (n, f, H))
            want_gate_up = [gate, up] if tp > 1 else [((e * n, 0, 0), (n, 2 * F, H))]
            for layer in range(2):
                p = f"model.layers.{layer}.mlp."
                assert held[p + "experts.gate_up_proj"] == want_gate_up
                assert held[p + "experts.down_proj"] == [((e * n, 0, t * f), (n, H, f))]
                assert held[p + "gate.weight"] == [((0, 0), (E, H))]
        for x in range(dp // ep):  # one expert-data-parallel replica: its ranks tile every parameter once
            ranks = {grid[d][0][t] for d in range(x * ep, (x + 1) * ep) for t in range(tp)}
            for name, shape in hf_param_shapes(dims):
                cover = torch.zeros(shape, dtype=torch.int32)
                for offs, size in {b for r, b in blocks[name] if r in ranks}:
                    cover[tuple(slice(o, o + s) for o, s in zip(offs, size))] += 1
                assert bool((cover == 1).all()), (name, dp, tp)


def test_moe_layouts_megatron_cannot_build_are_refused():
    from spmdrl.tiny import build_model

    cfg = build_model(arch="qwen3_moe", num_layers=2).config
    with pytest.raises(ConfigError, match="moe_intermediate_size = 128 is not divisible by tp = 3"):
        dims_from_hf(_moe(cfg, num_key_value_heads=3, num_attention_heads=3), tp=3)  # heads split, experts' F not
    with pytest.raises(ConfigError, match="dense MLP layers"):
        dims_from_hf(_moe(cfg, mlp_only_layers=[1]), tp=1)
    q2 = build_model(arch="qwen2_moe", num_layers=2).config
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size = 255 is not divisible by tp = 2"):
        dims_from_hf(_moe(q2, shared_expert_intermediate_size=255), tp=2)
    with pytest.raises(ConfigError, match=r"layers \[0\] of this qwen2_moe model are dense MLP layers"):
        dims_from_hf(_moe(q2, decoder_sparse_step=2), tp=1)


def _moe(cfg, **kw):
    import copy

    cfg = copy.deepcopy(cfg)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg
