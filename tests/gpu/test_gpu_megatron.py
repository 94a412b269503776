"""Checkpoints of the Megatron engine's CUDA path (megatron's distributed optimizer, spmdrl/engines/megatron/
dist_optim.py).

test_flat_ranges_as_hf_blocks runs everywhere: the block arithmetic that turns a dp rank's flat range of a
megatron parameter into blocks of HF tensors, against direct indexing of a reference tensor.
test_gpu_resume_is_bitwise_and_export_reads_it needs one CUDA GPU (world 1: dp = tp = pp = 1, the only layout
one GPU runs; megatron-core carried as a wheel by launch/gpu_tier.sh): torchrun
tests/dist_scripts/megatron_gpu_resume.py on a tiny bf16 Qwen2 with the fusion flags the machine's kernels
allow, then bitwise resume (bf16 params, float32 master weights, step-3 metrics) and `spmdrl export` of the
checkpoint == the engine's own export. Its CPU counterpart is tests/test_megatron_engine.py (torch AdamW, no
distributed optimizer, which rejects CPU tensors).
"""
import os
import sys

import pytest
import torch

from devices import gpu_only
from launching import run
from hf_files import read_safetensors

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(TESTS, "dist_scripts", "megatron_gpu_resume.py")

pytest.importorskip("megatron.core")


def test_flat_ranges_as_hf_blocks():
    """Every element of a flat range lands exactly once, at its HF coordinates, in the blocks hf_rects gives."""
    from spmdrl.engines.megatron.convert import Piece
    from spmdrl.engines.megatron.dist_optim import hf_rects

    g = torch.Generator().manual_seed(0)
    # a [10, 6] local tensor: rows 0-3 = HF "a" rows 4-7 at columns 6-11 (a column-sharded piece), rows 4-8 =
    # HF "b" rows 0-4, row 9 = padding (no HF counterpart)
    pieces = [Piece("a", ((4, 6), (4, 6)), (0, 4)), Piece("b", ((0, 0), (5, 6)), (4, 9))]
    full = {"a": torch.randn(8, 12, generator=g), "b": torch.randn(5, 6, generator=g)}
    local = torch.full((10, 6), float("nan"))
    local[0:4] = full["a"][4:8, 6:12]
    local[4:9] = full["b"]
    flat = local.view(-1)
    for start, end in [(0, 60), (0, 1), (5, 7), (3, 27), (6, 12), (13, 13), (23, 55), (54, 60), (59, 60), (11, 50)]:
        seen = 0
        for pc, off, shape in hf_rects(start, end, (10, 6), pieces):
            (o, s) = pc.block
            n = s[0] * s[1]
            assert tuple(shape) == tuple(s) and 0 <= off and off + n <= end - start
            want = full[pc.hf_name][o[0]: o[0] + s[0], o[1]: o[1] + s[1]]
            assert torch.equal(flat[start + off: start + off + n].view(shape), want), (start, end, pc)
            seen += n
        assert seen == sum(1 for i in range(start, end) if i < 54), (start, end)  # all but the padding row
    # 1-D (norms, biases): one block per piece
    p1 = [Piece("n", ((0,), (7,)), (0, 7))]
    rects = hf_rects(2, 6, (7,), p1)
    assert [(pc.block, off, shape) for pc, off, shape in rects] == [(((2,), (4,)), 0, (4,))]


@gpu_only
def test_gpu_resume_is_bitwise_and_export_reads_it(tmp_path, record_property):
    from spmdrl.export import export_hf
    from spmdrl.tiny import build_tiny

    model = build_tiny(str(tmp_path / "model"), seed=0)
    run([SCRIPT, "--model", model, "--out", str(tmp_path)], nproc=1, timeout=180)  # 52 s on an H100
    res = torch.load(tmp_path / "result.pt", weights_only=False)
    record_property("fusions", res["fusions"])
    assert res["fusions"] == res["fusions_allowed"]  # the engine built with every fusion the kernels here allow

    def same(x, y):
        assert x.keys() == y.keys() and x
        return sorted(n for n in x if any(not torch.equal(bx[1], by[1]) for bx, by in zip(x[n], y[n])))

    for kind in ("params", "main"):
        assert same(res["saved"][kind], res["loaded"][kind]) == [], kind
        assert same(res["after_a"][kind], res["after_b"][kind]) == [], kind
        assert len(same(res["initial"][kind], res["after_a"][kind])) > 10, kind  # the steps moved the weights
    # float32 master weights are not the bf16 params: saving only the bf16 ones would lose them
    assert any(not torch.equal(t.to(torch.bfloat16).float(), t)
               for blocks in res["after_a"]["main"].values() for _, t in blocks)
    assert res["lr_loaded"] == res["lr_saved"]
    assert res["metrics_a"] == res["metrics_b"]
    assert res["metrics_a"]["actor/grad_norm"] > 0

    out = export_hf(res["path"], str(tmp_path / "exported"), dtype="bfloat16")
    got, want = read_safetensors(out), read_safetensors(tmp_path / "export_step2")
    assert got.keys() == want.keys() == read_safetensors(model).keys()
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.bfloat16, k
        assert torch.equal(got[k], want[k]), k


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
