"""HF (Llama / Qwen2 / Qwen3 family) <-> megatron-core GPTModel weights, as pure block arithmetic.

Every megatron parameter a rank holds is a stack of row ranges ("pieces"), each of which is a rectangular
block of one HF parameter. That single mapping drives loading (read exactly those HF slices from safetensors),
the weight sync (`weight_shards` / `source_blocks`), checkpoints (HF names and full HF shapes) and export.

Megatron's layouts (tp ranks t = 0..tp-1, each holding its contiguous share of dim 0 unless noted):
  linear_qkv.weight [ng*(qpg+2)*hd, H]: per query group g (ng = num_key_value_heads, qpg = heads / ng),
      the group's qpg query heads, then its key head, then its value head; tp shards whole groups.
      Query group g of rank t = t*ng/tp + gl. Piece: local rows gl*(qpg+2)*hd + [0, qpg*hd) = HF q_proj rows
      g*qpg*hd + [0, qpg*hd); the next hd rows = k_proj rows g*hd + [0, hd); the next hd = v_proj (same rows).
      The bias (Qwen2) follows the same rows.
  linear_fc1.weight [2*F, H] (SwiGLU): rank t holds [gate rows t*F/tp + [0, F/tp); up rows, the same range].
  linear_proj.weight [H, heads*hd] and linear_fc2.weight [H, F]: row-parallel, tp shards dim 1.
  word_embeddings / output_layer [Vp, H]: Vp = V rounded up to a multiple of make_vocab_size_divisible_by * tp;
      rank t holds rows t*Vp/tp + [0, Vp/tp); rows >= V are padding (zero, masked out of the softmax, never in
      HF). A tied model's output_layer on the last PP stage (PP > 1) is megatron's copy of the embedding: it
      loads from model.embed_tokens.weight and is not an HF parameter of its own (no pieces out).
  norms, the critic's value head: replicated over tp (every tp rank holds the full HF block). Qwen3's per-head
      q / k norms (HF self_attn.q_norm / k_norm [head_dim], megatron's self_attention.q_layernorm / k_layernorm,
      qk_layernorm) are such norms: one weight shared by every head, so every tp rank holds it whole.
Layers: PP stage p holds global layers [p*L/pp, (p+1)*L/pp) (megatron's even split; the engine asserts its
layer numbers agree); megatron names them decoder.layers.<local index>.
The reshard planner's Megatron source layout (spmdrl/reshard/plan.py) must agree with `hf_pieces`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from spmdrl.errors import ConfigError
from spmdrl.reshard.plan import Block


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    groups: int  # num_key_value_heads
    head_dim: int
    ffn: int
    vocab: int
    vocab_padded: int
    layers: int
    tie: bool
    qkv_bias: bool
    value_head: bool  # a critic: score.weight/score.bias instead of lm_head
    value_bias: bool = True
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every query and key head (megatron's qk_layernorm)


@dataclass(frozen=True)
class Piece:
    hf_name: str
    block: Block  # in the full HF tensor
    rows: tuple[int, int]  # [start, stop) rows (dim 0) of the local megatron tensor


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    m = divisible_by * tp
    return -(-vocab // m) * m


def dims_from_hf(cfg, *, tp: int, divisible_by: int = 128, value_head: bool = False) -> Dims:
    heads = cfg.num_attention_heads
    groups = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if groups % tp or heads % groups:
        raise ConfigError(f"megatron backend: num_key_value_heads = {groups} must be divisible by tp = {tp} (and divide "
                          f"num_attention_heads = {heads}); choose a tp that divides {groups}")
    if cfg.intermediate_size % tp:
        raise ConfigError(f"megatron backend: intermediate_size = {cfg.intermediate_size} is not divisible by tp = {tp}")
    sliding = [i for i, kind in enumerate(getattr(cfg, "layer_types", None) or []) if kind != "full_attention"]
    if sliding:  # megatron's attention here is full causal attention: a window would be silently dropped
        raise ConfigError(f"megatron backend: layers {sliding} of this {cfg.model_type} model use sliding-window "
                          "attention (config.json use_sliding_window / layer_types), which the backend does not "
                          "implement; use trainer.backend = 'fsdp' or a config without sliding windows")
    qkv_bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
    return Dims(cfg.hidden_size, heads, groups, head_dim, cfg.intermediate_size, cfg.vocab_size,
                padded_vocab(cfg.vocab_size, divisible_by, tp), cfg.num_hidden_layers,
                bool(getattr(cfg, "tie_word_embeddings", False)), qkv_bias, value_head,
                qk_norm=cfg.model_type == "qwen3")


def vocab_rows(dims: Dims, tp: int, t: int) -> tuple[int, int]:
    """(first global row, real rows) of the padded vocabulary that tp rank t holds; a rank holding only
    padding gets (V, 0)."""
    per = dims.vocab_padded // tp
    lo = min(dims.vocab, t * per)
    return lo, min(dims.vocab, t * per + per) - lo


def stage_layers(num_layers: int, pp: int, p: int) -> range:
    """Global decoder layers of PP stage p (megatron's even split)."""
    if num_layers % pp:
        raise ConfigError(f"megatron backend: num_hidden_layers = {num_layers} is not divisible by pp = {pp}")
    n = num_layers // pp
    return range(p * n, (p + 1) * n)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _rows(start: int, n: int) -> tuple[int, int]:
    return start, start + n


def hf_pieces(mname: str, dims: Dims, tp: int, t: int, first_layer: int, *, last_stage_copy: bool = False) -> list[Piece]:
    """The HF blocks of megatron parameter `mname` on tp rank t of the stage whose first global layer is
    `first_layer`. last_stage_copy: the parameter is the last stage's copy of a tied embedding (no pieces)."""
    H, hd = dims.hidden, dims.head_dim
    m = _LAYER.match(mname)
    if m:
        rest, pre = m.group(2), f"model.layers.{first_layer + int(m.group(1))}."
        if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
            return [Piece(pre + "input_layernorm.weight", ((0,), (H,)), (0, H))]
        if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
            return [Piece(pre + "post_attention_layernorm.weight", ((0,), (H,)), (0, H))]
        if rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
            proj = "q_norm" if rest.startswith("self_attention.q") else "k_norm"
            return [Piece(f"{pre}self_attn.{proj}.weight", ((0,), (hd,)), (0, hd))]
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            qpg, ng_local = dims.heads // dims.groups, dims.groups // tp
            out = []
            for gl in range(ng_local):
                g, base = t * ng_local + gl, gl * (qpg + 2) * hd
                for proj, off, n, hf_row in (("q_proj", 0, qpg * hd, g * qpg * hd), ("k_proj", qpg * hd, hd, g * hd),
                                             ("v_proj", (qpg + 1) * hd, hd, g * hd)):
                    block = ((hf_row, 0), (n, H)) if kind == "weight" else ((hf_row,), (n,))
                    out.append(Piece(f"{pre}self_attn.{proj}.{kind}", block, _rows(base + off, n)))
            return out
        if rest == "self_attention.linear_proj.weight":
            w = dims.heads * hd // tp
            return [Piece(pre + "self_attn.o_proj.weight", ((0, t * w), (H, w)), (0, H))]
        if rest == "mlp.linear_fc1.weight":
            f = dims.ffn // tp
            return [Piece(pre + "mlp.gate_proj.weight", ((t * f, 0), (f, H)), (0, f)),
                    Piece(pre + "mlp.up_proj.weight", ((t * f, 0), (f, H)), (f, 2 * f))]
        if rest == "mlp.linear_fc2.weight":
            f = dims.ffn // tp
            return [Piece(pre + "mlp.down_proj.weight", ((0, t * f), (H, f)), (0, H))]
        raise ConfigError(f"megatron backend: no HF counterpart for parameter {mname!r}")
    if mname == "decoder.final_layernorm.weight":
        return [Piece("model.norm.weight", ((0,), (H,)), (0, H))]
    if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if last_stage_copy:
            return []
        lo, n = vocab_rows(dims, tp, t)
        name = "model.embed_tokens.weight" if mname.startswith("embedding") else "lm_head.weight"
        return [Piece(name, ((lo, 0), (n, H)), (0, n))]
    if mname == "value_head.weight":
        return [Piece("score.weight", ((0, 0), (1, H)), (0, 1))]
    if mname == "value_head.bias":
        return [Piece("score.bias", ((0,), (1,)), (0, 1))]
    raise ConfigError(f"megatron backend: no HF counterpart for parameter {mname!r}")


def hf_param_shapes(dims: Dims) -> list[tuple[str, tuple[int, ...]]]:
    """Every HF parameter (name, full shape) in HF's named_parameters order (tied lm_head omitted)."""
    H, hd, L = dims.hidden, dims.head_dim, dims.layers
    q, kv = dims.heads * hd, dims.groups * hd
    out = [("model.embed_tokens.weight", (dims.vocab, H))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, H))]
        if dims.qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (q,))]
        out += [(p + "self_attn.k_proj.weight", (kv, H))]
        if dims.qkv_bias:
            out += [(p + "self_attn.k_proj.bias", (kv,))]
        out += [(p + "self_attn.v_proj.weight", (kv, H))]
        if dims.qkv_bias:
            out += [(p + "self_attn.v_proj.bias", (kv,))]
        out += [(p + "self_attn.o_proj.weight", (H, q))]
        if dims.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        out += [(p + "mlp.gate_proj.weight", (dims.ffn, H)),
                (p + "mlp.up_proj.weight", (dims.ffn, H)), (p + "mlp.down_proj.weight", (H, dims.ffn)),
                (p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,))]
    out.append(("model.norm.weight", (H,)))
    if dims.value_head:
        out += [("score.weight", (1, H))] + ([("score.bias", (1,))] if dims.value_bias else [])
    elif not dims.tie:
        out.append(("lm_head.weight", (dims.vocab, H)))
    return out


def stage_megatron_names(dims: Dims, pp: int, p: int, *, te: bool = False) -> list[str]:
    """Megatron parameter names of stage p (local layer indices), in the order the engine yields them."""
    n = len(stage_layers(dims.layers, pp, p))
    out = ["embedding.word_embeddings.weight"] if p == 0 else []
    for i in range(n):
        d = f"decoder.layers.{i}."
        out.append(d + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"))
        out.append(d + "self_attention.linear_qkv.weight")
        if dims.qkv_bias:
            out.append(d + "self_attention.linear_qkv.bias")
        out.append(d + "self_attention.linear_proj.weight")
        if dims.qk_norm:
            out += [d + "self_attention.q_layernorm.weight", d + "self_attention.k_layernorm.weight"]
        out.append(d + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"))
        out += [d + "mlp.linear_fc1.weight", d + "mlp.linear_fc2.weight"]
    if p == pp - 1:
        out.append("decoder.final_layernorm.weight")
        if dims.value_head:
            out += ["value_head.weight"] + (["value_head.bias"] if dims.value_bias else [])
        elif not dims.tie:
            out.append("output_layer.weight")
    return out


def merged_blocks(pieces: list[Piece]) -> dict[str, tuple[Block, list[Piece]]]:
    """Group pieces by HF name; the pieces of one name stack along dim 0 (q rows of consecutive groups) or
    are a single piece, so their union is one rectangular block."""
    out: dict[str, tuple[Block, list[Piece]]] = {}
    for pc in pieces:
        if pc.hf_name not in out:
            out[pc.hf_name] = (pc.block, [pc])
            continue
        (offs, shape), lst = out[pc.hf_name]
        assert pc.block[0][0] == offs[0] + shape[0], f"{pc.hf_name}: pieces are not consecutive rows"
        out[pc.hf_name] = ((offs, (shape[0] + pc.block[1][0], *shape[1:])), lst + [pc])
    return out


def source_blocks(dims: Dims, grid: list[list[list[int]]]) -> dict[str, list[tuple[int, Block]]]:
    """For every HF parameter, (global rank, block) of every rank of the [dp][pp][tp] grid: what `weight_shards`
    yields there. Pure arithmetic; DP replicas and tp-replicated norms list identical blocks."""
    pp, tp = len(grid[0]), len(grid[0][0])
    out: dict[str, list[tuple[int, Block]]] = {n: [] for n, _ in hf_param_shapes(dims)}
    for d_ranks in grid:
        for p, tp_ranks in enumerate(d_ranks):
            first = stage_layers(dims.layers, pp, p).start
            for t, rank in enumerate(tp_ranks):
                pieces = [pc for m in stage_megatron_names(dims, pp, p) for pc in hf_pieces(m, dims, tp, t, first)]
                for name, (block, _) in merged_blocks(pieces).items():
                    out[name].append((rank, block))
    return out
