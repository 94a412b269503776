"""Packed variable-length attention on the device (engines/attention.py varlen_attention), forward and backward,
against float64 attention of each sequence alone: bf16, where CUDA takes torch's fused varlen kernel
(`_varlen_cuda`) and CPU SDPA, and float32, which the fused kernels refuse and SDPA answers on both devices.
GQA (8 query heads over 2 key/value heads) and MHA, the default and a custom scale, head size 64."""
import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from devices import DEVICES
from spmdrl.engines.attention import varlen_attention
from test_attention import reference_attention

LENGTHS = [5, 17, 1, 33, 9]
HEADS, D = 8, 64
# error bounds against float64, as a fraction of the reference's largest entry: bf16 inputs carry 2^-8 relative
# rounding, the kernels accumulate in float32
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
VARLEN_OP = "torch_attn::_varlen_attn"  # torch's varlen_attn runs as this custom op


class FusedCalls(TorchDispatchMode):
    """Counts calls of torch's varlen custom op (what _varlen_cuda runs)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.name() == VARLEN_OP  # the forward op only (its backward is another op)
        return func(*args, **(kwargs or {}))


def rel_err(got, want):
    return float((got.detach().double().cpu() - want.detach()).abs().max() / want.detach().abs().max())


@pytest.mark.parametrize("scale", [None, 0.05], ids=["default-scale", "scale0.05"])
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("device", DEVICES)
def test_varlen_attention_against_float64(device, dtype, kv_heads, scale, record_property):
    g = torch.Generator().manual_seed(0)
    T = sum(LENGTHS)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (HEADS, kv_heads, kv_heads))
    grad_out = torch.randn(T, HEADS, D, generator=g)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    x = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    with FusedCalls() as fused:
        out = varlen_attention(*x, cu.to(device), max(LENGTHS), scale=scale)
        grads = torch.autograd.grad(out, x, grad_out.to(device, dtype))
    # the reference takes the inputs as the kernel saw them (rounded to dtype), in float64, on CPU
    xd = [t.detach().double().cpu().requires_grad_() for t in x]
    ref = reference_attention(*xd, LENGTHS, scale if scale is not None else D ** -0.5)
    ref_grads = torch.autograd.grad(ref, xd, grad_out.to(dtype).double())
    errs = {"out": rel_err(out, ref), **{f"d{n}": rel_err(a, b) for n, a, b in zip("qkv", grads, ref_grads)}}
    record_property("max_rel_err", errs)
    assert out.dtype == dtype and out.shape == (T, HEADS, D)
    assert max(errs.values()) < TOL[dtype], errs
    # CUDA: bf16 goes through the fused varlen kernel, float32 does not (the flash kernels take 16-bit floats
    # only); CPU never calls it
    assert fused.n == (1 if device == "cuda" and dtype == torch.bfloat16 else 0), fused.n
    if device == "cuda":
        from torch.nn.attention.varlen import varlen_attn

        record_property("varlen_attn", f"torch {torch.__version__}: varlen_attn{inspect.signature(varlen_attn)}")
