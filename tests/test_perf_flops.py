"""perf/*_tflops and perf/mfu_*: the FLOP count against torch's own FLOP counter on a real Qwen2 forward/backward."""
import torch
from torch.utils.flop_counter import FlopCounterMode

from spmdrl.metrics import device_peak_tflops, flops_metrics, forward_flops_per_token
from spmdrl.tiny import build_model


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
    assert abs(m["perf/rollout_tflops"] * 1e12 - fwd) <= 1e-9 * fwd  # attention kernels aside (seq_sq_sum 0)
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
    # causal attention: token t attends to t earlier positions, QK^T and AV cost 2 x 2 x q x t per layer
    attn = sum(4 * cfg.num_hidden_layers * q * t for n in lens for t in range(n))
    fwd = dense * sum(lens) + attn
    assert abs(m["perf/rollout_tflops"] - fwd / 1.0 / 2 / 1e12) / m["perf/rollout_tflops"] < 0.05  # sum t vs n^2/2
    assert abs(m["perf/actor_tflops"] / m["perf/rollout_tflops"] - 3 * 1.0 / 2.0) < 1e-12
    assert abs(m["perf/mfu_actor"] - m["perf/actor_tflops"] / 1e-3) < 1e-12
    assert "perf/mfu_actor" not in flops_metrics(cfg, seq_lens_sum=1, seq_sq_sum=1, head_tokens=1, update_s=1,
                                                 rollout_s=1, devices=1, peak_tflops=0.0)
    assert device_peak_tflops(torch.device("cpu")) == 0.0 and device_peak_tflops(torch.device("cpu"), 50.0) == 50.0
