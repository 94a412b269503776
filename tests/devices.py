"""The device a test body runs on. DEVICES parametrises a test over "cpu" (every run of the suite) and "cuda"
(marked `gpu`, skipped without a CUDA device): the one-GPU tier (launch/gpu_tier.sh, `pytest -m gpu`) runs
the cuda cases, CI the cpu ones, so a body the tier needs cannot rot unseen on a machine without a GPU.
Assertions about what only CUDA does (which kernel ran, host waits) are guarded by `device == "cuda"`."""
import pytest
import torch

CUDA = torch.cuda.is_available()
NEEDS_GPU = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the one-GPU tier: launch/gpu_tier.sh)")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, NEEDS_GPU])]


def gpu_only(test):
    """A test with no CPU form (its CPU counterpart is named in its docstring)."""
    return pytest.mark.gpu(NEEDS_GPU(test))
