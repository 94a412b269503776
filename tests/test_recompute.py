"""Activation recompute policies of the FSDP2 engine (spmdrl/engines/recompute.py): every policy gives the
gradient of the un-checkpointed engine, and each reruns exactly what it says in backward, counted by op: full
reruns every checkpointed layer's matmuls, selective reruns none of them (only the elementwise ops between), and
every_n_layers = 2 reruns half the layers."""
import collections

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from spmdrl.config import load_config
from spmdrl.config.validate import validate
from spmdrl.dist.layout import plan_layout
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.engines.fsdp import FSDPEngine
from spmdrl.engines.token_batch import pack_sequences
from spmdrl.errors import ConfigError
from spmdrl.tiny import build_tiny

aten = torch.ops.aten


class OpCounts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from launching import world_of_one

    model = build_tiny(str(tmp_path_factory.mktemp("recompute")), num_layers=4)
    with world_of_one():
        mesh = RoleMeshes(plan_layout(load_config(None, [f"model.path={model}"]).placement, 1), 0, "cpu")["actor"]
        yield model, mesh


def batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g) for n in (5, 9, 3)]
    resps = [torch.randint(3, 200, (n,), generator=g) for n in (7, 2, 11)]
    return pack_sequences(prompts, resps, 0)


def backward_ops(model, mesh, **kw):
    """(gradients, op counts of the backward pass) of one log-prob loss."""
    eng = FSDPEngine(model, mesh, torch.device("cpu"), trainable=True, **kw)
    tb = batch()
    logp, _ = eng.logprobs(tb)
    loss = (logp * tb.resp_mask).sum()
    with OpCounts() as ops:
        loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in eng.hf.named_parameters()}
    return grads, ops.counts


def test_policies_keep_the_gradient_and_rerun_what_they_say(world):
    model, mesh = world
    base_g, base = backward_ops(model, mesh)
    runs = {name: backward_ops(model, mesh, gradient_checkpointing=True, **kw) for name, kw in {
        "full": {}, "selective": {"checkpoint_policy": "selective"}, "every2": {"checkpoint_every_n_layers": 2},
    }.items()}
    for name, (g, _) in runs.items():
        for k in base_g:
            torch.testing.assert_close(g[k], base_g[k], atol=1e-6, rtol=1e-6, msg=lambda m: f"{name} {k}: {m}")
    mm = {name: c["mm"] + c["addmm"] for name, (_, c) in runs.items()}
    mm_base = base["mm"] + base["addmm"]
    # q, k, v, o, gate and up projections of one decoder layer: the recompute stops once every tensor the backward
    # needs is back (torch's checkpoint early stop), and nothing needs the down projection's output
    per_layer = 6
    assert mm["full"] - mm_base == 4 * per_layer, (mm, mm_base)  # the 4 layers' forward matmuls, again
    assert mm["every2"] - mm_base == 2 * per_layer, (mm, mm_base)
    assert mm["selective"] == mm_base, (mm, mm_base)  # no matmul recomputed...
    assert runs["selective"][1]["silu"] == 4 and base["silu"] == 0  # ...but the elementwise ops are


def test_bad_policy_and_megatron_only_options_are_refused(world):
    model, _ = world
    with pytest.raises(ConfigError, match="model.checkpoint_policy"):
        validate(load_config(None, [f"model.path={model}", "model.checkpoint_policy=some"]), 1)
    with pytest.raises(ConfigError, match="model.checkpoint_every_n_layers"):
        validate(load_config(None, [f"model.path={model}", "model.checkpoint_every_n_layers=2",
                                    "trainer.backend=megatron"]), 1)


def test_selective_keeps_the_packed_cuda_attention():
    """On CUDA a packed batch runs attention as torch's varlen custom op (engines/attention.py _varlen_cuda);
    selective recompute must keep its output like SDPA's, or backward would rerun attention. The op is found by
    running the CUDA path's call on meta tensors (the op's fake kernel) under a dispatch mode, as the policy
    sees it."""
    from spmdrl.engines import attention
    from spmdrl.engines.recompute import _kept_ops

    q = torch.empty(10, 4, 8, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(10, 2, 8, device="meta", dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with OpCounts() as seen:
        attention._varlen_cuda(q, kv, kv, cu, 6, None)
    attn = [op for op in seen.ops if "attn" in op.name() or "attention" in op.name()]
    assert attn == [torch.ops.torch_attn._varlen_attn.default], seen.ops
    assert set(attn) <= _kept_ops()
