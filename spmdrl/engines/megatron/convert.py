"""HF (Llama / Qwen2 / Qwen3, Qwen3-MoE / Qwen2-MoE / Mixtral) <-> megatron-core GPTModel weights, as pure block
arithmetic.

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
Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral; every decoder layer a MoE layer). HF coordinates are
transformers 5's in-memory tensors (models.model.model_param_shapes; the checkpoint's per-expert tensors are read
through loading.CheckpointReader): per layer mlp.gate.weight [E, H] (the router), mlp.experts.gate_up_proj
[E, 2F, H] (gate rows [0, F), up rows [F, 2F)) and mlp.experts.down_proj [E, H, F], F = moe_intermediate_size
(Mixtral: intermediate_size). With expert parallelism over ep ranks, expert-parallel rank e holds global experts
[e*E/ep, (e+1)*E/ep) as its local experts j = 0, 1, ... (global expert e*E/ep + j); the expert tensor parallel size
is tp, so tp rank t holds, of each local expert:
  local_experts.{j}.linear_fc1.weight [2F/tp, H]: rows [0, F/tp) = gate rows t*F/tp + [0, F/tp) of gate_up_proj[e],
      rows [F/tp, 2F/tp) = up rows F + t*F/tp + [0, F/tp): two disjoint blocks of gate_up_proj when tp > 1;
  local_experts.{j}.linear_fc2.weight [H, F/tp]: columns t*F/tp + [0, F/tp) of down_proj[e];
  router.weight [E, H]: whole on every rank.
Qwen2-MoE's shared expert (HF mlp.shared_expert.{gate,up,down}_proj, width S = shared_expert_intermediate_size, and
mlp.shared_expert_gate.weight [1, H]) is megatron's SharedExpertMLP (mlp.shared_experts.*): a dense SwiGLU MLP,
tensor-parallel like the dense linear_fc1 / linear_fc2 above with F = S, and the same on every expert-parallel rank
(it is not an expert: the dp replicas hold it whole, as they hold attention); its gate
mlp.shared_experts.gate_weight [1, H] is whole on every rank.
The TE spec's grouped experts (experts.linear_fc1.weight{j} / linear_fc2.weight{j}) map the same way; TE never runs
on the CPU machines, so those names are untested. An expert piece is a 3-d block [1, rows, cols] of its HF tensor
taken from a 2-d megatron tensor: its rows are viewed with the block's shape.
Layers: PP stage p holds global layers [p*L/pp, (p+1)*L/pp) (megatron's even split; the engine asserts its
layer numbers agree); megatron names them decoder.layers.<local index>.
The reshard planner's Megatron source layout (spmdrl/reshard/plan.py) must agree with `hf_pieces`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from spmdrl.errors import ConfigError
from spmdrl.dist.blocks import Block


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
    experts: int = 0  # a mixture of experts: experts per MoE layer (0: a dense model)
    top_k: int = 0  # experts each token is routed to
    moe_ffn: int = 0  # F, one expert's intermediate size
    norm_topk_prob: bool = True  # the top-k router probabilities renormalised to sum to 1 (always for Mixtral)
    router_first: bool = False  # HF lists mlp.gate before mlp.experts (Mixtral, Qwen2-MoE), not after (Qwen3-MoE)
    shared_ffn: int = 0  # S: a shared expert MLP of this width on every token, gated by sigmoid (Qwen2-MoE); 0: none


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
    moe = moe_sizes(cfg)
    ffn_key, ffn = ("moe_intermediate_size", moe["moe_ffn"]) if moe and cfg.model_type != "mixtral" else \
        ("intermediate_size", cfg.intermediate_size)
    for key, width in ((ffn_key, ffn), ("shared_expert_intermediate_size", moe.get("shared_ffn", 0))):
        if width % tp:
            raise ConfigError(f"megatron backend: {key} = {width} is not divisible by tp = {tp}; choose a tp that "
                              "divides it")
    sliding = [i for i, kind in enumerate(getattr(cfg, "layer_types", None) or []) if kind != "full_attention"]
    if sliding:  # megatron's attention here is full causal attention: a window would be silently dropped
        raise ConfigError(f"megatron backend: layers {sliding} of this {cfg.model_type} model use sliding-window "
                          "attention (config.json use_sliding_window / layer_types), which the backend does not "
                          "implement; use trainer.backend = 'fsdp' or a config without sliding windows")
    qkv_bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2" or \
        (cfg.model_type == "qwen2_moe" and bool(getattr(cfg, "qkv_bias", True)))
    return Dims(cfg.hidden_size, heads, groups, head_dim, cfg.intermediate_size, cfg.vocab_size,
                padded_vocab(cfg.vocab_size, divisible_by, tp), cfg.num_hidden_layers,
                bool(getattr(cfg, "tie_word_embeddings", False)), qkv_bias, value_head,
                qk_norm=cfg.model_type in ("qwen3", "qwen3_moe"), **moe)


def moe_sizes(cfg) -> dict:
    """Dims' mixture-of-experts fields of a Qwen3-MoE / Qwen2-MoE / Mixtral config ({} for a dense model). Refuses
    what the backend does not build (config validation's megatron_moe_problem, checked again here): dense layers
    between MoE layers, a Qwen2-MoE without its shared expert, router jitter."""
    from spmdrl.config.validate import megatron_moe_problem

    if cfg.model_type not in ("qwen3_moe", "qwen2_moe", "mixtral"):
        return {}
    problem = megatron_moe_problem(cfg.to_dict())
    if problem:
        raise ConfigError(f"megatron backend: {problem}")
    if cfg.model_type in ("qwen3_moe", "qwen2_moe"):
        shared = cfg.shared_expert_intermediate_size if cfg.model_type == "qwen2_moe" else 0
        return dict(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, moe_ffn=cfg.moe_intermediate_size,
                    norm_topk_prob=bool(cfg.norm_topk_prob), router_first=cfg.model_type == "qwen2_moe",
                    shared_ffn=shared)
    if getattr(cfg, "router_jitter_noise", 0.0):
        raise ConfigError(f"megatron backend: router_jitter_noise = {cfg.router_jitter_noise} (mixtral) is not "
                          "implemented; set it to 0 in config.json")
    return dict(experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok, moe_ffn=cfg.intermediate_size,
                norm_topk_prob=True, router_first=True)


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


_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")


def hf_pieces(mname: str, dims: Dims, tp: int, t: int, first_layer: int, *, ep: int = 1, ep_rank: int = 0,
              last_stage_copy: bool = False) -> list[Piece]:
    """The HF blocks of megatron parameter `mname` on tp rank t (expert-parallel rank ep_rank of ep) of the stage
    whose first global layer is `first_layer`. last_stage_copy: the parameter is the last stage's copy of a tied
    embedding (no pieces)."""
    H, hd = dims.hidden, dims.head_dim
    m = _LAYER.match(mname)
    if m:
        rest, pre = m.group(2), f"model.layers.{first_layer + int(m.group(1))}."
        if rest == "mlp.router.weight":
            return [Piece(pre + "mlp.gate.weight", ((0, 0), (dims.experts, H)), (0, dims.experts))]
        if rest == "mlp.shared_experts.gate_weight":
            return [Piece(pre + "mlp.shared_expert_gate.weight", ((0, 0), (1, H)), (0, 1))]
        if rest in ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"):
            return mlp_pieces(pre + "mlp.shared_expert.", rest.rsplit(".", 2)[1], dims.shared_ffn, H, tp, t)
        x = _EXPERT.match(rest)
        if x:
            j, fc = (int(x.group(1)), x.group(2)) if x.group(1) is not None else (int(x.group(4)), x.group(3))
            return expert_pieces(pre, fc, dims, tp, t, ep_rank * (dims.experts // ep) + j)
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
        if rest in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
            return mlp_pieces(pre + "mlp.", rest.rsplit(".", 2)[1], dims.ffn, H, tp, t)
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


def mlp_pieces(pre: str, fc: str, ffn: int, H: int, tp: int, t: int) -> list[Piece]:
    """Pieces of a dense SwiGLU MLP of width `ffn` (HF {pre}gate_proj / up_proj / down_proj) on tp rank t: linear_fc1
    holds gate rows then up rows of its share, linear_fc2 those columns of down_proj."""
    f = ffn // tp
    if fc == "linear_fc1":
        return [Piece(pre + "gate_proj.weight", ((t * f, 0), (f, H)), (0, f)),
                Piece(pre + "up_proj.weight", ((t * f, 0), (f, H)), (f, 2 * f))]
    return [Piece(pre + "down_proj.weight", ((0, t * f), (H, f)), (0, H))]


def expert_pieces(pre: str, fc: str, dims: Dims, tp: int, t: int, e: int) -> list[Piece]:
    """Pieces of global expert e's linear_fc1 (gate rows, then up rows) or linear_fc2 (down columns) on tp rank t."""
    H, F = dims.hidden, dims.moe_ffn
    f = F // tp
    if fc == "linear_fc1":
        name = pre + "mlp.experts.gate_up_proj"
        return [Piece(name, ((e, t * f, 0), (1, f, H)), (0, f)), Piece(name, ((e, F + t * f, 0), (1, f, H)), (f, 2 * f))]
    return [Piece(pre + "mlp.experts.down_proj", ((e, 0, t * f), (1, H, f)), (0, H))]


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
        if dims.experts:
            E, F = dims.experts, dims.moe_ffn
            router = [(p + "mlp.gate.weight", (E, H))]
            experts = [(p + "mlp.experts.gate_up_proj", (E, 2 * F, H)), (p + "mlp.experts.down_proj", (E, H, F))]
            out += router + experts if dims.router_first else experts + router
            if dims.shared_ffn:
                S, s = dims.shared_ffn, p + "mlp.shared_expert"
                out += [(s + ".gate_proj.weight", (S, H)), (s + ".up_proj.weight", (S, H)),
                        (s + ".down_proj.weight", (H, S)), (s + "_gate.weight", (1, H))]
        else:
            out += [(p + "mlp.gate_proj.weight", (dims.ffn, H)),
                    (p + "mlp.up_proj.weight", (dims.ffn, H)), (p + "mlp.down_proj.weight", (H, dims.ffn))]
        out += [(p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,))]
    out.append(("model.norm.weight", (H,)))
    if dims.value_head:
        out += [("score.weight", (1, H))] + ([("score.bias", (1,))] if dims.value_bias else [])
    elif not dims.tie:
        out.append(("lm_head.weight", (dims.vocab, H)))
    return out


def stage_megatron_names(dims: Dims, pp: int, p: int, *, te: bool = False, ep: int = 1) -> list[str]:
    """Megatron parameter names of stage p (local layer indices), in the order the engine yields them; a MoE
    layer's experts are the E / ep local experts of one expert-parallel rank."""
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
        if dims.experts:
            out += [d + "pre_mlp_layernorm.weight", d + "mlp.router.weight"]
            for j in range(dims.experts // ep):
                out += ([f"{d}mlp.experts.linear_fc1.weight{j}", f"{d}mlp.experts.linear_fc2.weight{j}"] if te else
                        [f"{d}mlp.experts.local_experts.{j}.linear_fc1.weight",
                         f"{d}mlp.experts.local_experts.{j}.linear_fc2.weight"])
            if dims.shared_ffn:  # megatron's SharedExpertMLP: its own gate_weight first, then its linears
                out += [d + "mlp.shared_experts.gate_weight", d + "mlp.shared_experts.linear_fc1.weight",
                        d + "mlp.shared_experts.linear_fc2.weight"]
            continue
        out.append(d + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"))
        out += [d + "mlp.linear_fc1.weight", d + "mlp.linear_fc2.weight"]
    if p == pp - 1:
        out.append("decoder.final_layernorm.weight")
        if dims.value_head:
            out += ["value_head.weight"] + (["value_head.bias"] if dims.value_bias else [])
        elif not dims.tie:
            out.append("output_layer.weight")
    return out


def merged_blocks(pieces: list[Piece]) -> list[tuple[str, Block, list[Piece]]]:
    """(HF name, block, its pieces) of a rank's pieces: pieces of one name are merged wherever two blocks are
    adjacent along one dimension and equal along the others (q rows of consecutive query groups, gate and up rows of
    an expert at tp 1, consecutive experts), repeatedly, so each name gets the fewest rectangles; pieces that do not
    touch (gate rows and up rows of an expert at tp > 1) stay separate blocks. Order: by name's first piece, then
    by offsets."""
    out: dict[str, list[tuple[Block, list[Piece]]]] = {}
    for pc in pieces:
        blocks = out.setdefault(pc.hf_name, [])
        blocks.append((pc.block, [pc]))
        merged = True
        while merged:
            merged = False
            for i in range(len(blocks)):
                for k in range(len(blocks)):
                    joined = _join(blocks[i][0], blocks[k][0]) if i != k else None
                    if joined is not None:
                        blocks[i] = (joined, blocks[i][1] + blocks[k][1])
                        del blocks[k]
                        merged = True
                        break
                if merged:
                    break
    return [(name, block, pcs) for name, blocks in out.items() for block, pcs in sorted(blocks, key=lambda b: b[0][0])]


def _join(a: Block, b: Block) -> Block | None:
    """The block a followed by b along one dimension (b starts where a ends, every other extent equal), else None."""
    (ao, asz), (bo, bsz) = a, b
    for d in range(len(ao)):
        if ao[d] + asz[d] == bo[d] and all(ao[i] == bo[i] and asz[i] == bsz[i] for i in range(len(ao)) if i != d):
            return ao, tuple(asz[i] + (bsz[i] if i == d else 0) for i in range(len(ao)))
    return None


def source_blocks(dims: Dims, grid: list[list[list[int]]], ep: int = 1,
                  ep_rank: dict[int, int] | None = None) -> dict[str, list[tuple[int, Block]]]:
    """For every HF parameter, (global rank, block) of every rank of the [dp][pp][tp] grid: what `weight_shards`
    yields there. ep_rank: global rank -> its expert-parallel rank (RoleLayout.ep_coords; all 0 without expert
    parallelism). Pure arithmetic; DP replicas and tp-replicated norms list identical blocks; a rank may list
    several blocks of one name (merged_blocks)."""
    pp, tp = len(grid[0]), len(grid[0][0])
    out: dict[str, list[tuple[int, Block]]] = {n: [] for n, _ in hf_param_shapes(dims)}
    for d_ranks in grid:
        for p, tp_ranks in enumerate(d_ranks):
            first = stage_layers(dims.layers, pp, p).start
            for t, rank in enumerate(tp_ranks):
                e = (ep_rank or {}).get(rank, 0)
                pieces = [pc for m in stage_megatron_names(dims, pp, p, ep=ep)
                          for pc in hf_pieces(m, dims, tp, t, first, ep=ep, ep_rank=e)]
                for name, block, _ in merged_blocks(pieces):
                    out[name].append((rank, block))
    return out
