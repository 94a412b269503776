"""Build a megatron-core GPTModel for one role from an HF Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE / Mixtral
config, on the role's mesh.

parallel_state is initialised with the RoleLayout's own order (`megatron_order`: "tp-cp-ep-pp-dp", tp fastest,
then pp, then dp, as megatron's RankGenerator reads the string fastest first, cp = 1; "tp-cp-ep-dp-pp", pipeline
stages outermost, with expert and pipeline parallelism together); the engine then asserts
that megatron's tp / pp / dp groups contain exactly the ranks of the role mesh's groups, and with expert parallelism
that its expert-parallel and expert-data-parallel groups are the layout's ep / edp groups (no rank arithmetic
here). megatron's parallel state is one per process, so every Megatron role of a run must share one layout.

Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral): every layer's MLP is megatron's MoELayer with the all-to-all
token dispatcher over the expert-parallel group, SequentialMLP experts (one megatron MLP per local expert; TE's
grouped GEMM on the TE spec), expert tensor parallelism = tp, and spmdrl's Router (routing.py) in place of megatron's
TopKRouter. Qwen2-MoE's shared expert is megatron's SharedExpertMLP with its sigmoid gate (moe_shared_expert_gate):
output = routed experts' output + sigmoid(x g^T) * MLP_S(x), computed on every token of this rank, tensor-parallel
like a dense MLP and replicated over ep. Megatron adds no load-balancing or z-loss and drops no tokens (no capacity
factor); spmdrl's own router losses are routing.py's.

Rotary embeddings: the engine computes the rotary angles itself from each token's position id with HF's own
inverse frequencies (`transformers.modeling_rope_utils`, so rope_theta and rope scaling follow the HF config
exactly) and hands them to megatron's attention as `rotary_pos_emb` [s, b, 1, d] (b = 1 for padded rows, which
all have positions 0, 1, ...); megatron applies them unfused, or with TE's fused RoPE on the TE spec
(fusion_flags). Per-row tables are what let packed rows (several sequences, each with positions 0, 1, ...) work
without TransformerEngine.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from spmdrl.errors import ConfigError

from .convert import Dims, stage_layers


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401

        from megatron.core.extensions import transformer_engine as _te  # noqa: F401
    except Exception:  # ImportError, or TE built against another torch
        return False
    return True


def init_parallel_state(mesh, device: torch.device, seed: int) -> None:
    """Initialise megatron's parallel_state for `mesh` (or check an existing one) and assert that its groups
    are the mesh's groups."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if len(mesh.layout.ranks) != world or list(mesh.layout.ranks) != sorted(mesh.layout.ranks):
        raise ConfigError(f"megatron backend: the {mesh.layout.role} role must span all {world} ranks in order "
                          "(megatron's parallel state is world-wide); use colocated placement")
    if device.type == "cpu":
        from . import cpu_compat

        cpu_compat.apply()
    ep = mesh.layout.ep
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=mesh.tp_size, pipeline_model_parallel_size=mesh.pp_size,
            expert_model_parallel_size=ep, order=mesh.layout.megatron_order,
            create_gloo_process_groups=device.type == "cuda",
        )
        if device.type == "cuda":
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(seed)
    ranks = dist.get_process_group_ranks
    for dim, mgroup in (("tp", ps.get_tensor_model_parallel_group()), ("pp", ps.get_pipeline_model_parallel_group()),
                        ("dp", ps.get_data_parallel_group())):
        ours = ranks(mesh.group(dim))
        if ranks(mgroup) != ours:
            raise ConfigError(
                f"megatron backend: megatron's {dim} group {ranks(mgroup)} differs from the {mesh.layout.role} mesh's "
                f"{ours}; every Megatron role must use the same tp/pp/dp layout"
            )
    groups = mesh.layout.groups() if ep > 1 else {}
    for dim, mgroup in (("ep", ps.get_expert_model_parallel_group()), ("edp", ps.get_expert_data_parallel_group())):
        if not groups:
            break
        ours = next(g for g in groups[f"{dim}_groups"] if mesh.rank in g)
        if ranks(mgroup) != ours:
            raise ConfigError(
                f"megatron backend: megatron's expert {dim} group {ranks(mgroup)} differs from the {mesh.layout.role} "
                f"layout's {ours}; every Megatron role must use the same ep layout"
            )


def fused_kernels() -> dict[str, bool]:
    """Which of the kernels behind megatron-core's fusion flags import in this process (nothing is run):
      triton       torch.compile's GPU backend: megatron's jit_fuser is torch.compile (fused SwiGLU)
      te_rope      TransformerEngine's fused RoPE (megatron.core.extensions.transformer_engine)
      apex_wgrad   apex's fused_weight_gradient_mlp_cuda (wgrad GEMM accumulating into main_grad, local spec)
      softmax      megatron's fused masked-softmax CUDA extensions (scaled_[upper_triang_]masked_softmax_cuda)"""
    import importlib.util

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    from torch.utils._triton import has_triton_package

    te_rope = False
    if have_te():
        from megatron.core.models.common.embeddings import rope_utils

        te_rope = rope_utils.fused_apply_rotary_pos_emb is not None
    return {"triton": has_triton_package(), "te_rope": te_rope, "apex_wgrad": found("fused_weight_gradient_mlp_cuda"),
            "softmax": found("scaled_masked_softmax_cuda") and found("scaled_upper_triang_masked_softmax_cuda")
            and found("scaled_softmax_cuda")}


def fusion_flags(device: torch.device, use_te: bool, trainable: bool, kernels: dict[str, bool] | None = None) -> dict:
    """megatron-core 0.16.1's TransformerConfig fusion flags for spmdrl's model (RMSNorm of its own or TE's, SwiGLU,
    no biases but Qwen2's qkv bias, dropout 0, RoPE from per-token position ids, log-probs computed by spmdrl).
    All off on CPU (the kernels are CUDA / Triton ones); on CUDA each is on only where its kernel imports
    (`kernels`, default fused_kernels()) and where it applies:

      bias_activation_fusion   on with Triton: the MLP's SwiGLU runs as megatron's torch.compile'd swiglu (one
                               fused kernel forward and backward instead of silu, mul and their backward); both specs
      gradient_accumulation_fusion  trainable engines; TE spec: TE's own fused wgrad accumulation into main_grad;
                               local spec: only with apex's fused_weight_gradient_mlp_cuda (megatron refuses the
                               flag without it)
      apply_rope_fusion        TE spec with TE's fused RoPE: it takes one rotary table for the whole batch
                               ([s, 1, 1, d]), which padded rows give (the TE spec refuses packed rows); the local
                               spec packs rows, whose positions restart per sequence, so its RoPE stays unfused
      masked_softmax_fusion    with megatron's fused softmax extensions: read only by megatron's own
                               DotProductAttention (attention = "local"); SDPA and TE attention ignore it
      bias_dropout_fusion      off: the residual adds have no bias and dropout is 0, so the unfused path is one add
      persist_layer_norm       off: read only by apex's FusedLayerNorm; spmdrl's RMSNorm and TE's norms ignore it
      cross_entropy_loss_fusion off: read only by GPTModel's own loss; spmdrl computes log-probs itself (forward.py)
    """
    if device.type != "cuda":
        return dict(bias_activation_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
                    masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
                    cross_entropy_loss_fusion=False)
    k = fused_kernels() if kernels is None else kernels
    return dict(bias_activation_fusion=k["triton"],
                gradient_accumulation_fusion=trainable and (use_te or k["apex_wgrad"]),
                apply_rope_fusion=use_te and k["te_rope"], masked_softmax_fusion=k["softmax"],
                bias_dropout_fusion=False, persist_layer_norm=False, cross_entropy_loss_fusion=False)


def transformer_config(dims: Dims, hf_config, mesh, device: torch.device, dtype: torch.dtype, recompute: bool | str = False,
                       use_te: bool = False, trainable: bool = True, kernels: dict[str, bool] | None = None):
    """recompute (model.gradient_checkpointing with model.checkpoint_policy): None, "full" (megatron's full
    activation recompute, one layer per checkpoint; True means "full") or "selective" (megatron's selective
    recompute of core attention).

    The same configuration on every device (sequence parallelism is on whenever tp > 1, CPU included, so the CPU
    tests run the layout a GPU gets) except where the weights are first allocated and the fusion flags
    (fusion_flags: all off on CPU). batch_p2p_sync is off: megatron's device-wide synchronize after every batched
    pipeline send / receive works around a bug of old PyTorch versions; variable_seq_lengths stays on (micro-batches
    differ in shape), so with pp > 1 megatron still exchanges each send's shape first (a small read per transfer)."""
    from megatron.core.transformer import TransformerConfig

    cuda = device.type == "cuda"
    mode = ("full" if recompute is True else recompute) or None
    if mode not in (None, "full", "selective"):
        raise ConfigError(f"megatron backend: recompute {recompute!r} is not one of full, selective")
    return TransformerConfig(
        num_layers=dims.layers, hidden_size=dims.hidden, num_attention_heads=dims.heads,
        num_query_groups=dims.groups, kv_channels=dims.head_dim, ffn_hidden_size=dims.moe_ffn or dims.ffn,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=dims.qkv_bias, qk_layernorm=dims.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=mesh.tp_size, pipeline_model_parallel_size=mesh.pp_size,
        sequence_parallel=mesh.tp_size > 1,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not cuda, perform_initialization=False,
        **fusion_flags(device, use_te, trainable, kernels),
        recompute_granularity=mode, recompute_method="uniform" if mode == "full" else None,
        recompute_num_layers=1 if mode == "full" else None,
        variable_seq_lengths=True, batch_p2p_sync=False, moe_token_dispatcher_type="alltoall",
        deallocate_pipeline_outputs=False, **moe_fields(dims, mesh, use_te),
    )


def moe_fields(dims: Dims, mesh, use_te: bool) -> dict:
    """TransformerConfig's mixture-of-experts fields ({} for a dense model): E experts, top-k, one expert's F, expert
    parallelism over the layout's ep ranks with expert tensor parallelism = tp; a shared expert of width S with its
    sigmoid gate (Qwen2-MoE), not overlapped with the dispatch; megatron's own load balancing, aux loss, z-loss,
    capacity and expert bias off (spmdrl's Router routes, routing.py). The score function fields
    describe HF's routing (softmax over all experts, then top-k, renormalised unless norm_topk_prob is off) for
    anything of megatron's that reads them; spmdrl's Router computes the weights itself. Grouped GEMM only on the TE
    spec (its grouped experts), never on CPU."""
    if not dims.experts:
        return {}
    return dict(num_moe_experts=dims.experts, moe_router_topk=dims.top_k, moe_ffn_hidden_size=dims.moe_ffn,
                moe_router_score_function="softmax", moe_router_pre_softmax=not dims.norm_topk_prob,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
                moe_expert_capacity_factor=None, moe_router_enable_expert_bias=False, moe_grouped_gemm=use_te,
                expert_model_parallel_size=mesh.layout.ep, expert_tensor_parallel_size=mesh.tp_size,
                moe_permute_fusion=False, moe_shared_expert_intermediate_size=dims.shared_ffn or None,
                moe_shared_expert_gate=bool(dims.shared_ffn), moe_shared_expert_overlap=False)


def build_gpt(dims: Dims, hf_config, mesh, device: torch.device, dtype: torch.dtype, use_te: bool, recompute: bool | str = False,
              attention: str = "sdpa", trainable: bool = True):
    """The GPTModel of this rank's PP stage (weights uninitialised), on `device`. attention (local spec only):
    "sdpa" (torch scaled_dot_product_attention, SdpaAttention) or "local" (megatron's DotProductAttention)."""
    from megatron.core.models.gpt import GPTModel

    cfg = transformer_config(dims, hf_config, mesh, device, dtype, recompute, use_te=use_te, trainable=trainable)
    spec = block_spec(cfg, use_te, attention, len(stage_layers(dims.layers, mesh.pp_size, mesh.pp_rank)))
    first, last = mesh.pp_rank == 0, mesh.pp_rank == mesh.pp_size - 1
    kw = dict(config=cfg, transformer_layer_spec=spec, vocab_size=dims.vocab_padded,
              max_sequence_length=hf_config.max_position_embeddings, pre_process=first, post_process=last,
              parallel_output=True, share_embeddings_and_output_weights=dims.tie and not dims.value_head,
              position_embedding_type="none")
    if device.type == "cpu":
        from .cpu_compat import cuda_tensors_stay_on_cpu

        with cuda_tensors_stay_on_cpu():
            gpt = GPTModel(**kw)
    else:
        gpt = GPTModel(**kw)
    _mark_tensor_parallel(gpt)
    if dims.value_head and last:
        del gpt.output_layer  # a critic reads the value head, never the vocabulary
        gpt.output_layer = None
    gpt.to(device=device, dtype=dtype)  # every parameter in the compute dtype (Module.to keeps the Parameter objects)
    want = list(stage_layers(dims.layers, mesh.pp_size, mesh.pp_rank))
    got = [layer.layer_number - 1 for layer in gpt.decoder.layers]
    if got != want:
        raise RuntimeError(f"megatron put layers {got} on pp stage {mesh.pp_rank}, the converter expects {want}")
    return gpt, cfg


def block_spec(cfg, use_te: bool, attention: str, num_layers: int):
    """The decoder block spec of one PP stage with `num_layers` layers.

    TransformerEngine installed: megatron's TE spec (TE's fused norm + linear; its norms support sequence
    parallelism). Otherwise megatron's local spec with two changes: core attention through torch SDPA
    (`attention="sdpa"`), and every RMSNorm (the two per layer and the final one) is `RMSNorm` below, which
    supports sequence parallelism; megatron's own torch norm (WrappedTorchNorm) refuses it. Qwen3's q / k norms
    (`qk_layernorm`) are `RMSNorm` too: each tp rank normalises the heads it holds with the one replicated
    weight, so that gradient is a partial sum as well; finalize_model_grads all-reduces every q_layernorm /
    k_layernorm gradient over tp when qk_layernorm is set. A mixture of experts gets megatron's MoE layer spec
    (get_gpt_layer_local_spec(num_experts=...)) with spmdrl's Router (routing.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from .routing import Router

    experts = cfg.num_moe_experts
    if use_te:
        layer = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=bool(experts),
                                                           qk_layernorm=cfg.qk_layernorm)
        if experts:
            layer.submodules.mlp.submodules.router = Router
        return layer
    layer = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                     qk_layernorm=cfg.qk_layernorm)
    if experts:  # SequentialMLP experts (megatron MLPs over ColumnParallel / RowParallel linears), spmdrl's router
        layer.submodules.mlp.submodules.router = Router
    if attention == "sdpa":
        layer.submodules.self_attention.submodules.core_attention = SdpaAttention
    elif attention != "local":
        raise ConfigError(f"megatron backend: attention {attention!r} is not one of sdpa, local")
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    if cfg.qk_layernorm:  # Qwen3's per-head q / k norms over head_dim (the local spec's default: megatron's torch norm)
        attn = layer.submodules.self_attention.submodules
        attn.q_layernorm = attn.k_layernorm = RMSNorm
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=RMSNorm))


class RMSNorm(nn.Module):
    """RMSNorm for megatron's local spec that works with sequence parallelism: under SP every tp rank normalises
    its own slice of the sequence with a replicated weight, so the weight's gradient is a partial sum; its
    `sequence_parallel` attribute makes megatron's finalize_model_grads all-reduce it over the tp group (what
    TransformerEngine's norms do). torch's fused rms_norm kernel on CUDA; the weight is created in the config's
    params_dtype."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _mark_tensor_parallel(gpt) -> None:
    """megatron sets a weight's `tensor_model_parallel` attribute only inside its weight initialisers, which
    perform_initialization=False skips (the weights come from the HF checkpoint). The grad norm (tp duplicates
    counted once) and the checkpoint's replica sync read it, so set it here for the local spec's layers."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                      set_tensor_model_parallel_attributes)

    for mod in gpt.modules():
        dim = 0 if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)) else 1 if isinstance(mod, RowParallelLinear) else None
        w = getattr(mod, "weight", None)
        if dim is not None and isinstance(w, torch.nn.Parameter) and not getattr(w, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(w, True, dim, 1)


def rope_inv_freq(hf_config) -> torch.Tensor:
    """HF's inverse frequencies for this config (default, linear, llama3, ... scaling); float32 [d/2]."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"megatron backend: rope_type {rope_type!r} is not supported (length-dependent scaling)")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    if not math.isclose(scaling, 1.0):
        raise ConfigError(f"megatron backend: rope_type {rope_type!r} scales attention by {scaling}; not supported")
    return inv_freq.float()


class StageModel(nn.Module):
    """One PP stage: the GPTModel's embedding (first stage) and decoder, plus a critic's value head (last
    stage). forward(tb) -> hidden states [L(/tp under sequence parallelism), N, H] after the final norm on the
    last stage. The LM head is applied by the engine at response positions only (forward.py)."""

    def __init__(self, gpt, inv_freq: torch.Tensor, value_head: bool, dtype: torch.dtype):
        super().__init__()
        self.gpt = gpt
        # what megatron's schedules look up on the model
        self.config, self.model_type = gpt.config, gpt.model_type
        self.pre_process, self.post_process = gpt.pre_process, gpt.post_process
        self.share_embeddings_and_output_weights = gpt.share_embeddings_and_output_weights
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.value_head = nn.Linear(gpt.config.hidden_size, 1, dtype=dtype) if value_head and gpt.post_process else None

    def shared_embedding_or_output_weight(self):
        return self.gpt.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor) -> None:
        self.gpt.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                varlen=None):
        """position_ids [N, L], or [1, L] when every row has the same positions (padded rows, or the one row of
        packed sequences); varlen: the packed sequences' boundaries (varlen_params) for SdpaAttention."""
        if self.config.apply_rope_fusion and position_ids.shape[0] != 1:
            raise ValueError("megatron backend: TE's fused RoPE takes one rotary table per batch; packed rows (their "
                             "own positions per row) need apply_rope_fusion off")
        # angles in float32 like HF: [N or 1, L] positions x [d/2] -> [L, N or 1, 1, d]
        freqs = position_ids.t().float()[..., None] * self.inv_freq.float()
        freqs = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
        x = self.gpt.embedding(input_ids=input_ids, position_ids=None) if self.gpt.pre_process else None
        return self.gpt.decoder(hidden_states=x, attention_mask=attention_mask, rotary_pos_emb=freqs, packed_seq_params=varlen)


class SdpaAttention(nn.Module):
    """megatron core attention through torch's scaled_dot_product_attention (flash / memory-efficient kernels on
    CUDA) instead of megatron's local DotProductAttention, which materialises [b, heads, s, s] scores.
    query [sq, b, np, hn], key / value [sk, b, ng, hn] -> [sq, b, np * hn]; GQA groups go to SDPA as they are
    (enable_gqa: no repeated copy of K / V; CUDA's flash and memory-efficient kernels take grouped heads).
    attention_mask None means causal (padded rows: right padding never reaches a real query); otherwise megatron's
    bool mask, True = not allowed. With packed_seq_params (varlen_params: packed sequences in one row, b = 1)
    each sequence attends causally to itself only (spmdrl.engines.attention.varlen_attention), no mask tensor.
    Scale 1 / sqrt(hn) unless the config sets softmax_scale; no dropout."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.config, self.scale = config, softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SdpaAttention: spmdrl passes no attention_bias")
        if packed_seq_params is not None:  # packed sequences in one row: causal within each (varlen_params)
            from spmdrl.engines.attention import varlen_attention

            q, k, v = (x.squeeze(1) for x in (query, key, value))  # [T, heads, hn]
            out = varlen_attention(q, k, v, packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q,
                                   scale=self.scale, lengths=getattr(packed_seq_params, "lengths", None))
            return out.reshape(out.shape[0], 1, -1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        gqa = k.shape[1] != q.shape[1]
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.scale, enable_gqa=gqa)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def varlen_params(cu_seqlens: torch.Tensor, max_seqlen: int, lengths: list[int] | None = None):
    """megatron's PackedSeqParams carrying packed sequences' boundaries (int32 [n + 1], one row) to SdpaAttention.
    qkv_format "sbhd": megatron's attention keeps its [s, b = 1, heads, hn] layout and applies spmdrl's per-token
    rotary angles as for any row (its "thd" handling would re-derive positions from the boundaries); only
    SdpaAttention reads the boundaries. `lengths`: the sequence lengths as host integers, for the per-sequence
    loop of the CPU path."""
    from megatron.core.packed_seq_params import PackedSeqParams

    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    params.lengths = lengths  # the same boundaries as host integers (lengths: computed before the batch moved)
    return params


def megatron_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """spmdrl's mask -> megatron's [N, 1, L, L] bool, True where attention is NOT allowed. A padded batch's
    [N, L] mask becomes causal AND key-valid (right padding); a packed batch's [N, 1, L, L] block-diagonal
    causal mask (True = allowed) is inverted."""
    if attention_mask.dim() == 4:
        return ~attention_mask.bool()
    L = attention_mask.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    # a padding query row sees no key at all; let it see itself so its softmax stays finite (never read)
    allowed = allowed | torch.eye(L, dtype=torch.bool, device=attention_mask.device)[None]
    return ~allowed[:, None]


def pad_sequence_dim(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, multiple: int):
    """Right-pad the sequence dimension to a multiple of `multiple` (sequence parallelism splits it over tp).
    The new columns are padding: token 0, positions continuing, attended by nobody (the rows that are not
    padding never see them; they are never read)."""
    L = ids.shape[1]
    extra = -L % multiple
    if not extra:
        return ids, pos, mask
    ids = F.pad(ids, (0, extra))
    pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, extra + 1, device=pos.device)], dim=1)
    if mask is not None:
        mask = F.pad(mask, (0, extra)) if mask.dim() == 2 else F.pad(mask, (0, extra, 0, extra))
    return ids, pos, mask
