"""Workarounds that let megatron-core 0.16.1 run on CPU (gloo). Applied by `apply()` only when the engine's
device is the CPU; the GPU path never calls it and runs megatron-core unmodified.

megatron-core assumes CUDA in a few hard-coded places. Each patch below names what it covers and why:

1. `torch` seen by the modules in MODULES: a proxy of the `torch` module whose `torch.cuda.current_device()`
   returns the CPU device, `torch.cuda.synchronize()` is a no-op, and whose tensor factories (zeros, ones,
   empty, full, tensor, arange) map a CUDA device argument (`device="cuda"`, an int index) to the CPU. It is
   installed as the module-global name `torch` of exactly these megatron modules, nothing else:
   - pipeline_parallel.schedules: every schedule allocates `total_num_tokens` with `device="cuda"`;
   - pipeline_parallel.p2p_communication: tensor-shape exchange and receive buffers of the PP send/recv
     (variable sequence lengths) are allocated on `torch.cuda.current_device()`;
   - transformer.utils: the default causal mask is built with `device="cuda"` (only when no mask is given;
     the engine always passes one, this keeps the fallback working);
   - tensor_parallel.layers: sequence-parallel gather buffers and GPU-initialised weights use
     `torch.cuda.current_device()` (the engine builds with use_cpu_initialization on CPU; kept for safety);
   - tensor_parallel.mappings: sequence parallelism's reduce-scatter / all-gather output buffers are
     allocated on `torch.cuda.current_device()`;
   - distributed.param_and_grad_buffer: megatron DDP's contiguous param/grad buffers are allocated on
     `torch.cuda.current_device()`;
   - utils: GlobalMemoryBuffer (the attention's matmul scratch buffer) allocates on
     `torch.cuda.current_device()`;
   - transformer.attention, transformer.dot_product_attention, transformer.transformer_layer,
     models.gpt.gpt_model, models.common.embeddings.rotary_pos_embedding: scratch tensors allocated on
     `torch.cuda.current_device()`.
2. The CUDA RNG tracker (tensor_parallel.random): `get_cuda_rng_tracker().fork()` wraps dropout and
   reads/sets the CUDA generator state, which does not exist on CPU. It is replaced by a tracker whose fork()
   uses the CPU generator unchanged. The engine's models have no dropout (attention and hidden dropout 0, as
   in the HF Llama/Qwen2 configs), so no random numbers are drawn inside fork() anyway. For the same reason
   activation recompute (tensor_parallel.random.CheckpointFunction) saves and restores CUDA generator states
   through `_get_cuda_rng_state` / `_set_cuda_rng_state`: both become no-ops (the CPU generator state is still
   saved and restored by megatron itself).
3. `torch.Tensor.cuda` during model construction only (`cuda_tensors_stay_on_cpu()`): with tied embeddings
   and PP > 1, LanguageModule.setup_embeddings_and_output_layer moves the shared weight with `.cuda()` before
   all-reducing it over the embedding group.

4. Expert parallelism's all-to-all token dispatcher (transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher):
   - its __init__ creates a class-wide `torch.cuda.Stream()` for device-to-host copies of the split sizes unless
     one exists: a placeholder is set on the class first (nothing is ever run on it on CPU);
   - `_maybe_dtoh_and_synchronize` copies the all-to-all split sizes to the host as numpy arrays on that stream and
     waits on a CUDA event; torch.distributed.all_to_all_single (gloo) takes the sizes as Python lists. On CPU
     the sizes are already host tensors: the replacement turns input_splits / output_splits into lists (what
     megatron's all_to_all passes to all_to_all_single and sums for the output size) and leaves the tensors
     it reads with .tolist() / as tensors later (output_splits_tp, tokens_per_expert, the per-expert counts).
5. Uneven gathers over tp (tensor_parallel.mappings `_gather_along_first_dim` / `_reduce_scatter_along_first_dim`
   with split sizes): with expert tensor parallelism the dispatcher all-gathers each tp rank's received tokens (a
   different count per rank) and reduce-scatters their outputs back. megatron calls torch.distributed.all_gather /
   reduce_scatter with tensors of different sizes, which gloo refuses (all_gather) or lacks (reduce_scatter). On
   CPU the split-size form runs as an all_gather of the parts padded to the longest, cut back to the sizes, and as an
   all_reduce of the whole input of which each rank keeps its own part (the same sums). The equal-size form (dense
   sequence parallelism) is megatron's own.
megatron's router gating (which moves a CPU weight with `torch.cuda.current_device()` and calls TE's GEMM under a
name left undefined without TransformerEngine) needs no patch: spmdrl's Router has its own gating (routing.py).

Nothing here changes numerics: every patch only redirects where a tensor is allocated or skips CUDA state.
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch

MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")
_CPU = torch.device("cpu")
_applied = False


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda"
    ):
        return _CPU
    return device


class _CpuCuda:
    """`torch.cuda` as the patched modules see it on CPU."""

    def current_device(self):
        return _CPU

    def synchronize(self, *args, **kwargs):
        return None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """`torch` as the patched modules see it on CPU (see the module docstring, patch 1)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn):
        def wrapped(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        return wrapped

    def __getattr__(self, name):
        return getattr(torch, name)


class _CpuRngTracker:
    """Stands in for megatron's CudaRNGStatesTracker on CPU (patch 2)."""

    def __init__(self):
        self.states_ = {}

    def reset(self):
        self.states_ = {}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        self.states_[name] = seed

    def is_initialized(self):
        return True

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        yield


def apply() -> None:
    """Install patches 1 and 2 (idempotent). Call only when training on the CPU."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron cpu_compat must not be applied in a process that has a GPU")
    proxy = _CpuTorch()
    for name in MODULES:
        importlib.import_module(name).torch = proxy
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # patch 4: never a CUDA stream on CPU
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_split_sizes
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _uneven_gather(mappings._gather_along_first_dim)  # patch 5
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)
    _applied = True


def _uneven_gather(megatron_gather):
    """Patch 5: all-gather along dim 0 with per-rank sizes through equal-size all_gather of padded parts."""
    import torch.distributed as dist

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return megatron_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    return gather


def _uneven_reduce_scatter(megatron_reduce_scatter):
    """Patch 5: reduce-scatter along dim 0 with per-rank sizes as an all_reduce, each rank keeping its part."""
    import torch.distributed as dist

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return megatron_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return list(torch.split(total, [int(n) for n in input_split_sizes], dim=0))[group.rank()].clone()

    return reduce_scatter


def _host_split_sizes(self, point: str, tokens_per_expert=None):
    """Patch 4: MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize on CPU: the all-to-all split sizes as lists."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits"):
            sizes = getattr(self, name, None)
            if torch.is_tensor(sizes):
                setattr(self, name, sizes.tolist())
    return tokens_per_expert


@contextlib.contextmanager
def cuda_tensors_stay_on_cpu():
    """Patch 3: `Tensor.cuda()` returns the tensor itself while megatron builds the model on CPU."""
    orig = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = orig
