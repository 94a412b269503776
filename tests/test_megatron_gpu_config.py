"""The Megatron configuration a GPU gets, built and checked on CPU.

The engine builds the same TransformerConfig and layer spec on every device (sequence parallelism whenever
tp > 1, an RMSNorm that supports it), so the CPU runs of tests/test_megatron_engine.py at tp 2 exercise the GPU's
configuration against an unsharded float64 reference; this file checks that the two configurations are the same
(tests/test_megatron_engine.py checks that its tp 2 run was built that way), and that the distributed
optimizer's inner optimizer is torch's Adam whatever megatron found installed.
"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

pytest.importorskip("megatron.core")


FUSIONS = {"bias_activation_fusion", "gradient_accumulation_fusion", "apply_rope_fusion", "masked_softmax_fusion",
           "bias_dropout_fusion", "persist_layer_norm", "cross_entropy_loss_fusion"}
ALL_KERNELS = {"triton": True, "te_rope": True, "apex_wgrad": True, "softmax": True}


def _configs(tp, arch="qwen2", **kw):
    from spmdrl.engines.megatron.convert import dims_from_hf
    from spmdrl.engines.megatron.model import transformer_config
    from spmdrl.tiny import build_model

    hf = build_model(None, arch=arch).config
    dims = dims_from_hf(hf, tp=tp, divisible_by=128, value_head=False)
    mesh = SimpleNamespace(tp_size=tp, pp_size=2)
    # TransformerConfig is a plain dataclass: building it for a CUDA device needs no GPU
    return (transformer_config(dims, hf, mesh, torch.device("cuda"), torch.bfloat16, **kw),
            transformer_config(dims, hf, mesh, torch.device("cpu"), torch.bfloat16, **kw))


@pytest.mark.parametrize("tp,arch", [(1, "qwen2"), (2, "qwen2"), (2, "qwen3")])
def test_cpu_builds_the_transformer_config_cuda_gets(tp, arch):
    """Only where the weights are first allocated and the fusion flags (all off on CPU) differ; the CUDA config
    carries fusion_flags' decision for the kernels this process finds. A Qwen3 gets megatron's q/k layernorm."""
    from spmdrl.engines.megatron.model import fused_kernels, fusion_flags

    cuda, cpu = _configs(tp, arch)
    assert cuda.sequence_parallel is (tp > 1)
    assert cuda.qk_layernorm is cpu.qk_layernorm is (arch == "qwen3")
    assert cuda.batch_p2p_sync is False and cuda.variable_seq_lengths is True
    differ = {f.name for f in dataclasses.fields(cuda)
              if not f.name.endswith("init_method")  # functions built per instance
              and getattr(cuda, f.name) != getattr(cpu, f.name)}
    assert differ - FUSIONS == {"use_cpu_initialization"}
    assert {f: getattr(cuda, f) for f in FUSIONS} == fusion_flags(torch.device("cuda"), False, True, fused_kernels())
    assert not any(getattr(cpu, f) for f in FUSIONS)


@pytest.mark.parametrize("use_te", [False, True])
def test_fusion_flags_megatron_accepts(use_te, monkeypatch):
    """What CUDA gets with every kernel present (TE spec and local spec, trainable and frozen), and that
    megatron's TransformerConfig validation accepts it. megatron checks apply_rope_fusion against TE's fused RoPE
    at construction; TE does not build here, so its presence is replayed with a stand-in function."""
    from megatron.core.models.common.embeddings import rope_utils

    from spmdrl.engines.megatron.model import fusion_flags

    cuda = torch.device("cuda")
    want = dict(bias_activation_fusion=True, gradient_accumulation_fusion=True, apply_rope_fusion=use_te,
                masked_softmax_fusion=True, bias_dropout_fusion=False, persist_layer_norm=False,
                cross_entropy_loss_fusion=False)
    assert fusion_flags(cuda, use_te, True, ALL_KERNELS) == want
    assert fusion_flags(cuda, use_te, False, ALL_KERNELS)["gradient_accumulation_fusion"] is False  # frozen
    none = dict.fromkeys(ALL_KERNELS, False)
    assert fusion_flags(cuda, use_te, True, none) == {**dict.fromkeys(FUSIONS, False),
                                                      "gradient_accumulation_fusion": use_te}  # TE's own wgrad fusion
    assert not any(fusion_flags(torch.device("cpu"), use_te, True, ALL_KERNELS).values())
    if use_te:
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda t, freqs, interleaved=False: t)
    for tp in (1, 2):
        cfg, _ = _configs(tp, use_te=use_te, trainable=True, kernels=ALL_KERNELS)
        assert {f: getattr(cfg, f) for f in FUSIONS} == want


def test_rope_fusion_refuses_per_row_positions():
    """TE's fused RoPE takes one rotary table per batch: the stage model refuses per-row positions (packed rows)
    with the flag on, before any kernel runs."""
    from spmdrl.engines.megatron.model import StageModel

    gpt = SimpleNamespace(config=SimpleNamespace(apply_rope_fusion=True), model_type=None, pre_process=False,
                          post_process=False, share_embeddings_and_output_weights=False)
    stage = StageModel(gpt, torch.ones(4), value_head=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="one rotary table per batch"):
        stage(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long), None)


def test_inner_optimizer_is_torch_adam_even_where_megatron_would_pick_fused_adam(monkeypatch):
    """megatron-core 0.16.1 picks TransformerEngine's / apex's FusedAdam at import time when either imports (the
    GPU install has TransformerEngine). Here that import-time choice is replayed with a stand-in class, and
    megatron's optimizer factory is called as the engine calls it (through torch_inner_adam)."""
    from megatron.core import optimizer as mopt
    from megatron.core.optimizer import OptimizerConfig

    from spmdrl.engines.megatron.dist_optim import torch_inner_adam

    class FusedAdamStandIn(torch.optim.Optimizer):
        def __init__(self, params, adam_w_mode=True, **kw):
            super().__init__(params, dict(lr=kw["lr"]))

    monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(mopt, "Adam", FusedAdamStandIn)
    # megatron's FP32Optimizer wrapper allocates on CUDA: return the inner optimizer it is given instead
    monkeypatch.setattr(mopt, "FP32Optimizer", lambda inner, config, init_state_fn: inner)
    cfg = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, use_distributed_optimizer=False)

    def build():
        p = torch.nn.Parameter(torch.zeros(3))
        return mopt._get_megatron_optimizer_based_on_param_groups(cfg, model_chunks=[], param_groups=[{"params": [p]}],
                                                                pg_collection=SimpleNamespace(tp=None))

    assert type(build()) is FusedAdamStandIn  # what megatron builds on its own with TE installed
    with torch_inner_adam():
        inner = build()
    assert type(inner) is torch.optim.AdamW  # decoupled weight decay: AdamW
    assert mopt.USING_PYTORCH_OPTIMIZER is False  # restored


def test_packed_micro_batches_relayout_to_padded_rows_for_transformer_engine():
    """On a GPU with TransformerEngine installed the Megatron backend takes TE's layers, which would need THD
    attention for packed sequences (not wired up): the engine lays a packed micro-batch out as padded rows
    (engines.fsdp.relayout) instead of refusing the default configuration. The relayout is exactly the padded
    batch of the same sequences."""
    from spmdrl.engines.token_batch import pack_sequences, relayout

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g) for n in (4, 7, 2)]
    resps = [torch.randint(3, 100, (n,), generator=g) for n in (5, 1, 9)]
    packed = pack_sequences(prompts, resps, 0, packed=True)
    want = pack_sequences(prompts, resps, 0)
    got = relayout(packed, packed=False)
    assert got.cu_seqlens is None
    for f in ("input_ids", "position_ids", "resp_pos", "resp_ids", "resp_mask"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert torch.equal(got.attention_mask, want.attention_mask)

