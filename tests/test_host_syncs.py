"""The update's micro-batch loop never waits for the device.

On CUDA, reading a tensor's value on the host (.item(), float(), bool(), .tolist()) or running an op whose output
shape depends on the data (nonzero, boolean-mask indexing, masked_select) blocks the CPU until the GPU has
caught up, so a read per micro-batch serialises the CPU's kernel launches with the GPU's work. There is no GPU
here; instead a dispatch mode records every such op (they are the same ops on CPU), and the test asserts that a
whole update with 4 micro-batches per optimizer step performs exactly as many as with 1: what is read is read
once per optimizer step (the grad norm, the step's metrics) or once per update, never per micro-batch.

The cuda case (the one-GPU tier, launch/gpu_tier.sh) also counts the host's real waits on the device, under
torch.cuda.set_sync_debug_mode("warn"), and asserts the same of them.
"""
import collections
import traceback
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spmdrl.algos import POLICY_LOSSES
from spmdrl.batch import Batch
from spmdrl.config import load_config
from spmdrl.dist.layout import plan_layout
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.engines.fsdp import FSDPEngine
from spmdrl.loop.update import ActorObjective, run_updates
from spmdrl.tiny import build_tiny

from devices import DEVICES

aten = torch.ops.aten
# ops that synchronise with a CUDA device: a value read on the host, or an output shape that depends on the data
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.is_nonzero.default,
           aten.equal.default, aten.unique_consecutive.default, aten._unique2.default}


class HostReads(TorchDispatchMode):
    """Records each op above (and boolean-mask indexing, which runs nonzero inside the kernel)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _in_optimizer() or _in_host_builder():  # host memory: never a wait for the device
            pass
        elif func in SYNCING or func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or [])):
            self.ops.append(f"{func.__name__} at {_caller()}")
        return func(*args, **kwargs)


def _in_optimizer() -> bool:
    """torch's AdamW reads its host-side step counters (once per step)."""
    return any("/torch/optim/" in f.filename for f in traceback.extract_stack())


def _in_host_builder() -> bool:
    """The response positions are computed from the caller's host TokenBatch (ResponseIndex.of), before it moves."""
    return any(f.filename.endswith("response_index.py") and f.name == "of" for f in traceback.extract_stack())


def _caller() -> str:
    """The innermost spmdrl frame that issued the op."""
    for frame in reversed(traceback.extract_stack()):
        if "/spmdrl/" in frame.filename:
            return f"{frame.filename.split('/spmdrl/')[-1]}:{frame.lineno}"
    return "?"


def engine_reads(eng, waits: list):
    """Run eng.train_step under HostReads; returns the list the reads go to. The batch preparation before it
    (splitting, padding or packing the host-side batch) reads host tensors only and is not counted. On CUDA the
    host's waits for the device during the step (set_sync_debug_mode's warnings) go to `waits`."""
    ops = []
    step = eng.train_step

    def counted(*a, **k):
        cuda = eng.device.type == "cuda"
        with HostReads() as reads, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                out = step(*a, **k)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        ops.extend(reads.ops)
        waits.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message))
        return out

    eng.train_step = counted
    return ops


@pytest.fixture(scope="module", params=DEVICES)
def actor(request, tmp_path_factory):
    from launching import world_of_one

    device = request.param
    model = build_tiny(str(tmp_path_factory.mktemp("syncs")))
    with world_of_one(device):
        cfg = load_config(None, [f"model.path={model}", "actor.loss_agg_mode=token-mean"])
        mesh = RoleMeshes(plan_layout(cfg.placement, 1), 0, device)["actor"]
        eng = FSDPEngine(model, mesh, torch.device(device), trainable=True, optim=dict(lr=1e-4, grad_clip=1.0))
        yield cfg, mesh, eng


def batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(3, 9, (n,), generator=g)
    rlen = torch.randint(1, 12, (n,), generator=g)
    P, R = int(plen.max()), int(rlen.max())
    mask = (torch.arange(R)[None] < rlen[:, None]).float()
    return Batch({
        "prompts": torch.randint(3, 200, (n, P), generator=g), "prompt_len": plen,
        "responses": torch.randint(3, 200, (n, R), generator=g) * mask.long(), "response_len": rlen,
        "response_mask": mask, "advantages": torch.randn(n, R, generator=g) * mask,
        "old_log_probs": -torch.rand(n, R, generator=g) * mask, "ref_log_probs": -torch.rand(n, R, generator=g) * mask,
    })


@pytest.mark.parametrize("packed", [False, True])
def test_fsdp_update_reads_nothing_per_micro_batch(actor, packed, record_property):
    cfg, mesh, eng = actor
    body = ActorObjective(cfg, POLICY_LOSSES.get("ppo"), 1.0)
    b = batch()
    counts, waits = {}, {}
    for micro in (8, 2):  # one optimizer step over 8 samples: 1 micro-batch, then 4
        waits[micro] = []
        counts[micro] = engine_reads(eng, waits[micro])
        try:
            out = run_updates(eng, b, epochs=1, mini_size=8, micro_size=micro, pad_id=0, dp_size=1,
                              dp_group=mesh.group("dp"), objective=body, prefix="actor", packed=packed)
        finally:
            del eng.train_step
        assert out["actor/pg_loss"] == out["actor/pg_loss"] and "actor/grad_norm" in out
    assert counts[2] == counts[8], "\n".join(f"{k}: {collections.Counter(v)}" for k, v in counts.items())
    assert len(counts[8]) <= 2, counts[8]  # the grad norm and the step's metrics
    if eng.device.type == "cuda":  # the host's real waits on the device: as many with 4 micro-batches as with 1
        record_property("cuda_syncs_per_step", {f"{8 // m} micro-batches": len(w) for m, w in waits.items()})
        assert len(waits[2]) == len(waits[8]), waits
