"""Which block of each parameter each training rank holds: the layout arithmetic of the training backends, as
pure functions of the parameters' names and full shapes and the ranks' mesh grid, so the weight-sync planner
(reshard/plan.py), `spmdrl plan` and the engines (which check their real shards against it) share one answer.

A block is (offsets, shape) in the full tensor. FSDP2 dp x DTensor tp: `fsdp_blocks`; Megatron-core tp x pp x dp
(and ep for experts): `megatron_blocks`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from spmdrl.errors import LayoutError

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) in the full tensor


def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """(start, size) of part i when n is split like torch.chunk (and DTensor's Shard): ceil-sized parts,
    the last ones shorter or empty."""
    c = -(-n // parts) if n else 0
    lo = min(n, i * c)
    return lo, min(n, lo + c) - lo


def intersect(a: Block, b: Block) -> Block | None:
    offs, shape = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offs.append(lo)
        shape.append(hi - lo)
    return tuple(offs), tuple(shape)


def numel(b: Block) -> int:
    return math.prod(b[1])


def full_block(shape: tuple[int, ...]) -> Block:
    return tuple(0 for _ in shape), tuple(shape)


# ---------------------------------------------------------------------------------------- source: FSDP2 (+ tp)

TP_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # engines/fsdp.py tp_plan
TP_COLWISE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
TP_ROWWISE = re.compile(r"\.(o_proj|down_proj)\.weight$")


def fsdp_tp_style(name: str) -> str | None:
    """How the FSDP engine's DTensor TP plan shards an HF parameter: 'col' (dim 0), 'row' (dim 1) or None."""
    if TP_COLWISE.search(name):
        return "col"
    if TP_ROWWISE.search(name):
        return "row"
    return None


def fsdp_block(shape: tuple[int, ...], style: str | None, dp: int, tp: int, d: int, t: int) -> Block:
    """The block rank (dp=d, tp=t) holds: DTensor TP first (dim 0 for 'col', dim 1 for 'row'), then FSDP2
    shards dim 0 of the TP-local tensor over dp (torch's _StridedShard for 'col')."""
    offs, size = [0] * len(shape), list(shape)
    if style == "col" and tp > 1:
        offs[0], size[0] = chunk(shape[0], tp, t)
    elif style == "row" and tp > 1:
        offs[1], size[1] = chunk(shape[1], tp, t)
    lo, n = chunk(size[0], dp, d)
    offs[0] += lo
    size[0] = n
    return tuple(offs), tuple(size)


def fsdp_blocks(params: list[tuple[str, tuple[int, ...]]], grid: list[list[list[int]]]) -> dict[str, list[tuple[int, Block]]]:
    """Source blocks of an FSDP2 (+ DTensor tp) role. grid is the role's ranks as [dp][pp][tp] (pp must be 1)."""
    dp, tp = len(grid), len(grid[0][0])
    out = {}
    for name, shape in params:
        style = fsdp_tp_style(name)
        out[name] = [
            (grid[d][0][t], fsdp_block(shape, style, dp, tp, d, t)) for d in range(dp) for t in range(tp)
        ]
    return out


# ------------------------------------------------------------------------------- source: Megatron-core (tp x pp x dp)
#
# Megatron's own tensors are fused (linear_qkv, linear_fc1) and vocab-padded, but what a TP rank holds is, in HF
# coordinates, still one rectangle per HF parameter:
#   * linear_qkv is [query groups x (q heads of the group, k, v) x head_dim] and column-parallel over whole
#     query groups (megatron requires groups % tp == 0): TP rank t holds q heads and kv groups of its
#     contiguous 1/tp slice, i.e. rows chunk(rows, tp, t) of HF's q_proj, k_proj and v_proj (and their biases);
#   * linear_fc1 is column-parallel over [gate_t; up_t] per TP rank (the GLU splits the local output in
#     halves): rows chunk(ffn, tp, t) of gate_proj and of up_proj;
#   * linear_proj (o_proj) and linear_fc2 (down_proj) are row-parallel: columns chunk(cols, tp, t);
#   * word embeddings and the output layer are vocab-parallel over the padded vocabulary: rows
#     [t * Vp / tp, (t + 1) * Vp / tp) cut to HF's V rows (the padding rows do not exist in HF);
#   * norms (Qwen3's per-head q_norm / k_norm [head_dim] too: megatron's q_layernorm / k_layernorm hold one
#     weight for all heads), the value head and row-parallel biases are whole on every TP rank.
#   * a mixture of experts (expert parallelism over ep of the dp replicas; megatron's expert tensor parallelism
#     = tp): the fused HF expert tensors gate_up_proj [E, 2F, H] (gate rows [0, F), up rows [F, 2F)) and down_proj
#     [E, H, F] are cut by expert and by the FFN width. Expert-parallel rank e holds experts [e E / ep, (e + 1) E / ep);
#     tp rank t holds rows chunk(F, tp, t) of each of them in the gate half and the same rows in the up half (two
#     disjoint blocks of gate_up_proj when tp > 1, one when tp = 1) and columns chunk(F, tp, t) of down_proj. The
#     router (mlp.gate.weight [E, H]) is whole on every rank. A shared expert (Qwen2-MoE's mlp.shared_expert.*) is a
#     dense MLP by these rules, the same on every expert-parallel rank; its gate (mlp.shared_expert_gate.weight
#     [1, H]) is whole on every rank.
# A decoder layer lives on the one pipeline stage that builds it; embeddings on the first stage, final norm,
# output layer and value head on the last; tied embeddings with pp > 1 are also copied on the last stage
# (megatron's LanguageModule.setup_embeddings_and_output_layer). DP replicas hold identical copies (the
# distributed optimizer shards only optimizer state and fp32 main weights, which the sync does not read); with
# expert parallelism the replicas of an expert block are the dp ranks of the same expert-parallel rank.

# what spmdrl/engines/megatron converts (its engine refuses others at build)
MEGATRON_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
MEGATRON_COL = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
MEGATRON_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
MEGATRON_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
VALUE_HEAD = re.compile(r"^(score|v_head|value_head)\.")
MEGATRON_LAST = re.compile(r"^(model\.norm\.|lm_head\.|score\.|v_head\.|value_head\.)")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")  # transformers 5's fused expert tensors


def megatron_padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Rows of Megatron's word embeddings / output layer: V rounded up to a multiple of divisible_by * tp
    (Megatron-LM's make_vocab_size_divisible_by convention), so every TP rank holds Vp / tp rows."""
    m = divisible_by * tp
    return -(-vocab_size // m) * m


def pp_stage_layers(num_layers: int, pp: int, vp: int = 1) -> list[list[int]]:
    """Decoder layers each pipeline stage builds, megatron-core's default split (no custom layout, no uneven
    first/last stage): L / pp per stage, contiguous; with vp virtual stages, stage p's chunk v holds layers
    v * L / vp + p * L / (pp * vp) + [0, L / (pp * vp)) (get_transformer_layer_offset)."""
    if num_layers % (pp * vp):
        raise LayoutError(
            f"the model has {num_layers} layers, which megatron-core cannot split evenly over pp = {pp} stages"
            f"{f' x {vp} virtual stages' if vp > 1 else ''}; choose a pipeline degree that divides {num_layers}"
        )
    per = num_layers // (pp * vp)
    return [[v * num_layers // vp + p * per + i for v in range(vp) for i in range(per)] for p in range(pp)]


def megatron_stages(name: str, pp: int, stage_of_layer: dict[int, int], tied: bool) -> list[int]:
    """Pipeline stages holding HF parameter `name`."""
    m = LAYER.match(name)
    if m:
        return [stage_of_layer[int(m.group(1))]]
    if name.endswith("embed_tokens.weight"):
        return sorted({0, pp - 1}) if tied else [0]
    if MEGATRON_LAST.match(name):
        return [pp - 1]
    raise ValueError(f"{name}: no Megatron pipeline stage is known for this parameter "
                     f"({', '.join(MEGATRON_MODEL_TYPES)} only)")


def megatron_tp_block(name: str, shape: tuple[int, ...], tp: int, t: int, padded_vocab: int) -> Block:
    """The block (HF coordinates) of `name` that Megatron's TP rank t of tp holds."""
    offs, size = [0] * len(shape), list(shape)
    if tp == 1:
        return tuple(offs), tuple(size)
    if MEGATRON_VOCAB.search(name):
        per = padded_vocab // tp
        lo = min(shape[0], t * per)
        offs[0], size[0] = lo, min(shape[0], lo + per) - lo
        return tuple(offs), tuple(size)
    dim = 0 if MEGATRON_COL.search(name) else 1 if MEGATRON_ROW.search(name) else None
    if dim is None:
        return tuple(offs), tuple(size)
    if shape[dim] % tp:
        raise LayoutError(f"{name}: dim {dim} of size {shape[dim]} does not split over Megatron tp = {tp} "
                          "(heads, query groups and the MLP width must divide by the tensor-parallel degree)")
    offs[dim], size[dim] = chunk(shape[dim], tp, t)
    return tuple(offs), tuple(size)


def megatron_expert_blocks(name: str, shape: tuple[int, ...], tp: int, t: int, ep: int, e: int) -> list[Block]:
    """The blocks (HF coordinates) of a fused expert tensor that expert-parallel rank e of ep and TP rank t of tp
    hold: its experts' gate and up rows of the TP slice (gate_up_proj: one block, or two when tp > 1 splits
    each half), or their down_proj columns."""
    experts = shape[0]
    if experts % ep:
        raise LayoutError(f"{name}: {experts} experts do not split over expert parallelism ep = {ep}; choose an "
                          f"expert-parallel degree that divides {experts}")
    per = experts // ep
    gate_up = name.endswith("gate_up_proj")
    ffn = shape[1] // 2 if gate_up else shape[2]
    if ffn % tp:
        raise LayoutError(f"{name}: the experts' FFN width {ffn} does not split over Megatron tp = {tp}; choose a "
                          f"tensor-parallel degree that divides {ffn}")
    lo, n = chunk(ffn, tp, t)
    if not gate_up:
        return [((e * per, 0, lo), (per, shape[1], n))]
    if tp == 1:
        return [((e * per, 0, 0), (per, shape[1], shape[2]))]
    return [((e * per, lo, 0), (per, n, shape[2])), ((e * per, ffn + lo, 0), (per, n, shape[2]))]


def megatron_blocks(
    params: list[tuple[str, tuple[int, ...]]], grid: list[list[list[int]]], *, num_layers: int,
    dims: ModelDims | None = None, padded_vocab: int | None = None, vp: int = 1, tied: bool | None = None,
    tied_copy: bool = True, ep: int = 1,
) -> dict[str, list[tuple[int, Block]]]:
    """Source blocks of a Megatron-core role. grid is the role's ranks as [dp][pp][tp] (megatron's tp-pp-dp
    rank order); padded_vocab is the rows of megatron's embedding (default megatron_padded_vocab(V, tp));
    dims, when given, is checked the way megatron checks it (whole heads and query groups per TP rank).
    tied (default: params has neither lm_head.weight nor a value head, as HF lists a tied head once) with
    pp > 1 puts megatron's copy of the embeddings on the last stage, listed as a source unless not tied_copy
    (an engine that does not yield that copy from weight_shards). ep: expert parallelism over the dp replicas,
    dp replica d being expert-parallel rank d % ep (dist.layout.RoleLayout.ep_coords); a rank may hold several
    blocks of one fused expert tensor."""
    dp, pp, tp = len(grid), len(grid[0]), len(grid[0][0])
    if dp % ep:
        raise LayoutError(f"expert parallelism ep = {ep} must divide the data-parallel size {dp}")
    if dims is not None and (dims.num_heads % tp or dims.num_kv_heads % tp):
        raise LayoutError(
            f"Megatron tp = {tp} must divide the model's {dims.num_heads} attention heads and {dims.num_kv_heads} "
            f"query groups (key/value heads); choose a tensor-parallel degree that divides both"
        )
    stage_of = {layer: p for p, layers in enumerate(pp_stage_layers(num_layers, pp, vp)) for layer in layers}
    names = {n for n, _ in params}
    if tied is None:
        tied = "lm_head.weight" not in names and not any(VALUE_HEAD.match(n) for n in names)
    tied = tied and tied_copy
    out = {}
    for name, shape in params:
        if MEGATRON_VOCAB.search(name):
            pv = padded_vocab or megatron_padded_vocab(shape[0], tp)
            if pv < shape[0] or pv % tp:
                raise ValueError(f"{name}: padded vocabulary {pv} must be >= {shape[0]} and divide by tp = {tp}")
        else:
            pv = 0
        stages = megatron_stages(name, pp, stage_of, tied)
        if EXPERTS.search(name):
            held = {(e, t): megatron_expert_blocks(name, shape, tp, t, ep, e) for e in range(ep) for t in range(tp)}
            out[name] = [(grid[d][p][t], b) for p in stages for d in range(dp) for t in range(tp)
                         for b in held[d % ep, t]]
            continue
        blocks = [megatron_tp_block(name, shape, tp, t, pv) for t in range(tp)]
        out[name] = [(grid[d][p][t], blocks[t]) for p in stages for d in range(dp) for t in range(tp)]
    return out


# ------------------------------------------------------------------------------------- target: vLLM tensor parallel


@dataclass(frozen=True)
class ModelDims:
    """The attention and vocabulary dimensions Megatron's TP layout checks (from the HF config)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    model_type: str | None = None  # HF model_type (from_hf_config); None: dimensions given by hand

    @staticmethod
    def from_hf_config(c) -> "ModelDims":
        heads = c.num_attention_heads
        return ModelDims(
            num_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab_size=c.vocab_size,
            model_type=getattr(c, "model_type", ""),
        )
