"""perf/*_tflops and perf/mfu_*: the FLOP count against torch's own FLOP counter on a real Qwen2 forward/backward."""
import json
import os

import pytest
import torch
from launching import run
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig

from spmdrl.engines.fsdp import _LogprobHead
from spmdrl.engines.token_batch import pack_sequences
from spmdrl.metrics import device_peak_tflops, executed_forward_flops, flops_metrics, forward_flops_per_token
from spmdrl.tiny import build_model, build_tiny


def _mm_flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    counts = fc.get_flop_counts()["Global"]
    return sum(v for k, v in counts.items() if "mm" in str(k))  # the matmuls (attention kernels aside)


def test_dense_flops_match_torch_counter():
    model = build_model(vocab_size=320, num_kv_heads=2, seed=0)
    T = 37
    ids = torch.randint(0, 300, (2, T))
    fwd = _mm_flops(lambda: model(input_ids=ids))
    assert fwd == forward_flops_per_token(model.config, 0.0) * 2 * T
    train = _mm_flops(lambda: model(input_ids=ids).logits.sum().backward())
    assert train == 3 * fwd  # backward: gradient w.r.t. input and weight of every matmul


def test_lm_head_counted_at_response_positions_only():
    """What the engines run: the transformer over prompt + response, the lm_head at response positions only.
    torch's counter over exactly that computation gives the FLOPs flops_metrics reports."""
    model = build_model(vocab_size=320, num_kv_heads=2, seed=0)
    P, R = 29, 8
    ids = torch.randint(0, 300, (2, P + R))

    def engine_forward():
        hidden = model.model(input_ids=ids).last_hidden_state
        return model.lm_head(hidden[:, P - 1: P - 1 + R])

    fwd = _mm_flops(engine_forward)
    m = flops_metrics(model.config, seq_lens_sum=2 * (P + R), seq_sq_sum=0.0, head_tokens=2 * R, update_s=1.0,
                      rollout_s=1.0, devices=1, peak_tflops=0.0)
    attn = (forward_flops_per_token(model.config, 1.0) - forward_flops_per_token(model.config, 0.0)) * (P + R)
    assert abs(m["perf/rollout_tflops"] * 1e12 - attn - fwd) <= 1e-9 * fwd  # the attention kernels aside (n = 1 pair)
    full = _mm_flops(lambda: model(input_ids=ids))
    assert full > fwd  # the old count (lm_head on every token) was this one


def test_flops_metrics_attention_term_and_mfu():
    model = build_model(vocab_size=320, seed=0)
    cfg = model.config
    lens = [10, 30]
    m = flops_metrics(cfg, seq_lens_sum=sum(lens), seq_sq_sum=sum(n * n for n in lens), head_tokens=sum(lens),
                      update_s=2.0, rollout_s=1.0, devices=2, peak_tflops=1e-3)
    dense = forward_flops_per_token(cfg, 0.0)
    q = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    # causal attention: token t attends to the t + 1 keys up to itself, QK^T and AV cost 2 x 2 x q per key per layer
    attn = sum(4 * cfg.num_hidden_layers * q * (t + 1) for n in lens for t in range(n))
    fwd = dense * sum(lens) + attn
    assert abs(m["perf/rollout_tflops"] - fwd / 1.0 / 2 / 1e12) <= 1e-9 * m["perf/rollout_tflops"]
    assert abs(m["perf/actor_tflops"] / m["perf/rollout_tflops"] - 3 * 1.0 / 2.0) < 1e-12
    assert abs(m["perf/mfu_actor"] - m["perf/actor_tflops"] / 1e-3) < 1e-12
    assert "perf/mfu_actor" not in flops_metrics(cfg, seq_lens_sum=1, seq_sq_sum=1, head_tokens=1, update_s=1,
                                                 rollout_s=1, devices=1, peak_tflops=0.0)
    assert device_peak_tflops(torch.device("cpu")) == 0.0 and device_peak_tflops(torch.device("cpu"), 50.0) == 50.0


@pytest.mark.parametrize("layout", ["padded", "rows", "varlen"])
def test_engine_update_flops_match_torch_counter(layout):
    """The FSDP2 engine's root module (backbone + chunked log-prob head at response positions) on a batch of
    varied lengths, forward + backward under torch's FLOP counter. The counter does not see inside CPU SDPA's
    fused kernel: padded and row-packed batches run eager attention (the same dense masked QK^T / AV matmuls),
    the packed varlen batch runs spmdrl's attention with SDPA held to its math kernel (each sequence's own
    n x n matmuls, the causal mask applied to them). The counter's total (every op, attention included) matches
    3 x executed_forward_flops + the head's recompute in backward within 2%; the model FLOPs flops_metrics
    reports are the same terms over real tokens and the query-key pairs the engine's own mask allows."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from spmdrl.engines.attention import register_hf

    packed = layout != "padded"
    model = build_model(vocab_size=320, num_kv_heads=2, seed=0)
    model.config._attn_implementation = register_hf() if layout == "varlen" else "eager"
    g = torch.Generator().manual_seed(3)
    plens, rlens = [5, 12, 7, 30, 2, 9], [20, 3, 40, 9, 1, 17]
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in plens]
    resps = [torch.randint(3, 300, (n,), generator=g) for n in rlens]
    tb = pack_sequences(prompts, resps, 0, packed=packed, row_len=64 if layout == "rows" else 0)
    rows, width = tb.input_ids.shape
    with FlopCounterMode(display=False) as fc, sdpa_kernel(SDPBackend.MATH):
        lp, _ = _LogprobHead(model)(tb, 1.0, True, 16)
        (lp * tb.resp_mask).sum().backward()
    counted = fc.get_total_flops()
    heads = sum(rlens)
    lm_head = forward_flops_per_token(model.config, 0.0) - forward_flops_per_token(model.config, 0.0, head=False)
    lens = [p + r for p, r in zip(plens, rlens)]
    sq = sum(n * n for n in lens) if layout == "varlen" else None
    executed = 3 * executed_forward_flops(model.config, rows=rows, width=width, head_tokens=heads, seq_sq_sum=sq) + lm_head * heads
    assert abs(counted - executed) <= 0.02 * counted, (counted, executed)
    if layout == "varlen":
        assert rows == 1 and width == sum(lens) and tb.mask is None
        assert executed < 3 * executed_forward_flops(model.config, rows=rows, width=width, head_tokens=heads) + lm_head * heads

    # model FLOPs: the same terms over what the batch holds, from the mask the engine ran with
    if layout == "varlen":
        mask = tb.attention_mask[0, 0]  # the dense form of its boundaries, for counting only
        pairs, tokens = int(mask.sum()), width
    elif packed:
        real = torch.zeros(rows, width, dtype=torch.bool)  # a row's tail padding is a masked block of its own
        for i, (p, n) in enumerate(zip(plens, lens)):
            start = int(tb.resp_pos[i, 0]) - p + 1
            real[int(tb.resp_row[i]), start: start + n] = True
        pairs = int((tb.attention_mask[:, 0] & real[:, :, None]).sum())  # block-diagonal causal [rows, 1, L, L]
        tokens = int(real.sum())
    else:
        valid = tb.attention_mask.bool()
        pairs = int((valid[:, :, None] & valid[:, None, :] & torch.ones(width, width, dtype=torch.bool).tril()).sum())
        tokens = int(valid.sum())
    assert tokens == sum(lens) and pairs == sum(n * (n + 1) // 2 for n in lens)
    m = flops_metrics(model.config, seq_lens_sum=sum(lens), seq_sq_sum=sum(n * n for n in lens), head_tokens=heads,
                      update_s=1.0, rollout_s=0.0, devices=1, peak_tflops=0.0)
    body = forward_flops_per_token(model.config, 0.0, head=False)
    attn_pair = forward_flops_per_token(model.config, 1.0) - forward_flops_per_token(model.config, 0.0)
    model_flops = 3 * (body * tokens + lm_head * heads + attn_pair * pairs)
    assert abs(m["perf/actor_tflops"] * 1e12 - model_flops) <= 1e-9 * model_flops
    assert model_flops < executed  # padding, masked pairs and the head's recompute are not model FLOPs


def test_megatron_update_flops_match_torch_counter(tmp_path):
    """The Megatron engine's actor update (one plain process, megatron's own attention so the counter sees the
    attention matmuls; tests/dist_scripts/megatron_flops.py), padded and packed: the counter's total matches
    3 x executed_forward_flops + the head's recompute within 2%. The remainder is exactly the vocabulary padding
    megatron adds (to a multiple of 128), whose rows the lm_head computes in each of its four passes."""
    model = build_tiny(str(tmp_path / "m"), seed=0)
    script = os.path.join(os.path.dirname(__file__), "dist_scripts", "megatron_flops.py")
    proc = run([script, "--model", model], nproc=None, timeout=600)
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("FLOPS "))[len("FLOPS "):])
    cfg = AutoConfig.from_pretrained(model)
    lm_head = forward_flops_per_token(cfg, 0.0) - forward_flops_per_token(cfg, 0.0, head=False)
    padded_vocab = -(-cfg.vocab_size // 128) * 128
    for layout in ("padded", "packed"):
        r = res[layout]
        heads = sum(r["response_lengths"])
        executed = 3 * executed_forward_flops(cfg, rows=r["rows"], width=r["width"], head_tokens=heads) + lm_head * heads
        assert abs(r["flops"] - executed) <= 0.02 * r["flops"], (layout, r["flops"], executed)
        assert r["flops"] == executed + 4 * 2 * (padded_vocab - cfg.vocab_size) * cfg.hidden_size * heads
    assert res["packed"]["rows"] < res["padded"]["rows"]
