"""Host reads of device data in the Megatron engine's optimizer step and forward-only pass, one plain process
(world size 1, real megatron-core schedule) on a tiny fp32 Qwen2, with 1 and with 4 micro-batches.

On a GPU every read of a device tensor's value on the host waits for the device to finish its queue. On CPU there
is no device, so the reads are counted where they happen: a TorchDispatchMode records the aten ops that read
values back (_local_scalar_dense: .item() / float() / bool() / int(); nonzero, masked_select and boolean-mask
indexing, whose result size is data) and patched Tensor.tolist / .cpu() / .numpy() record the Python-level copies;
each is attributed to the innermost spmdrl or megatron frame (file:function). Micro-batches are built from the
caller's host tensors (micro_batches, pack_sequences, pack_rows, ResponseIndex.of): reads there are of host
memory and are reported as host:<function>.

Prints one JSON line "SYNCS {...}": per case (train / forward, padded / packed, M = 1 / 4) the sites and counts,
the number of megatron schedule calls, and for the forward pass max |forward_all - per-micro-batch logprobs|;
writes <out>/forward.pt with forward_all's log-probs of the fixed batch (padded and packed, 4 micro-batches)."""
import argparse
import collections
import json
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
ROOTS = (os.sep + "spmdrl" + os.sep, os.sep + "megatron" + os.sep)
# spmdrl functions that build micro-batches from the caller's host tensors (Batch, TokenBatch; the engine's
# _stage lays a host TokenBatch out for the schedule): what they read is host memory, never the device's
HOST_BUILDERS = {"micro_batches", "pack_sequences", "pack_rows", "of", "_stage"}


def site() -> str:
    """host:<builder> inside a HOST_BUILDERS function, else the innermost spmdrl / megatron frame."""
    frames = [fr for fr in traceback.extract_stack()[:-2]
              if any(r in fr.filename for r in ROOTS) and "site-packages" + os.sep + "torch" not in fr.filename]
    for fr in reversed(frames):  # the innermost builder
        if fr.name in HOST_BUILDERS and os.sep + "spmdrl" + os.sep in fr.filename:
            return f"host:{fr.name}"
    if not frames:
        return "other"
    return f"{'/'.join(frames[-1].filename.split(os.sep)[-2:])}:{frames[-1].name}"


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            self.sites[f"{func.__name__}@{site()}"] += 1
        elif func in INDEXING:
            idx = args[1] if len(args) > 1 else []
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (idx or [])):
                self.sites[f"bool_index@{site()}"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        self._patched = {}
        for name in ("tolist", "cpu", "numpy"):
            real = getattr(torch.Tensor, name)
            self._patched[name] = real

            def wrapped(t, *a, _real=real, _name=name, **kw):
                self.sites[f"{_name}@{site()}"] += 1
                return _real(t, *a, **kw)

            setattr(torch.Tensor, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._patched.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)


def sequences(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 300, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g) for _ in range(n)]
    resps = [torch.randint(5, 300, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g) for _ in range(n)]
    return prompts, resps


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ.setdefault("MASTER_PORT", "29537")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from megatron_engine import fixed_batch

    import megatron.core.pipeline_parallel as mpp
    from spmdrl.batch import Batch
    from spmdrl.config import Config
    from spmdrl.dist.init import init_distributed
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine, pack_sequences
    from spmdrl.loop.update import forward_all

    env, device = init_distributed("cpu")
    mesh = RoleMeshes(plan_layout(Config().placement, env.world_size), env.rank, "cpu")["actor"]
    eng = build_train_engine("megatron", args.model, mesh, device, trainable=True,
                             optim=dict(lr=0.0, weight_decay=0.0, grad_clip=1.0))
    calls = [0]
    real_get = mpp.get_forward_backward_func

    def counting_get(*a, **kw):
        fb = real_get(*a, **kw)

        def run(**kw2):
            calls[0] += 1
            return fb(**kw2)

        return run

    mpp.get_forward_backward_func = counting_get

    def loss_fn(tb, e):  # keeps everything on the device, as run_updates' loss should
        lp, ent = e.logprobs(tb, with_entropy=True, chunk_size=4)
        mask = tb.resp_mask.to(lp.device, lp.dtype)
        loss = -(lp * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach(), "entropy": (ent * mask).sum() / mask.sum()}

    prompts, resps = sequences(8, seed=1)
    res = {}
    for packed in (False, True):
        mbs = {m: [pack_sequences(prompts[2 * i: 2 * i + 2], resps[2 * i: 2 * i + 2], 0, packed=packed) for i in range(m)]
               for m in (1, 4)}
        eng.train_step(mbs[1], loss_fn)  # warm-up: one-time work is not per step
        for m, items in mbs.items():
            calls[0] = 0
            with HostReads() as hr:
                out = eng.train_step(items, loss_fn)
            assert all(isinstance(v, float) for v in out.values())
            res[f"train/{'packed' if packed else 'padded'}/M{m}"] = {"sites": dict(hr.sites), "schedules": calls[0]}

    fp, fr = fixed_batch()  # 4 sequences; micro-batches of 4 (M = 1) and 1 (M = 4)
    P, R = max(len(x) for x in fp), max(len(x) for x in fr)
    batch = Batch({"prompts": torch.stack([torch.nn.functional.pad(x, (0, P - len(x))) for x in fp]),
                   "prompt_len": torch.tensor([len(x) for x in fp]),
                   "responses": torch.stack([torch.nn.functional.pad(x, (0, R - len(x))) for x in fr]),
                   "response_len": torch.tensor([len(x) for x in fr])})
    saved = {}
    for packed in (False, True):
        kind = "packed" if packed else "padded"
        forward_all(eng, batch, 4, 0, "logprobs", packed=packed, temperature=0.7)  # warm-up
        for m, size in ((1, 4), (4, 1)):
            calls[0] = 0
            with HostReads() as hr:
                got = forward_all(eng, batch, size, 0, "logprobs", packed=packed, temperature=0.7, chunk_size=3)
            schedules = calls[0]
            per = torch.zeros_like(got)  # one engine.logprobs call per micro-batch, the old way
            for i in range(0, 4, size):
                tb = pack_sequences(fp[i: i + size], fr[i: i + size], 0, packed=packed)
                lp = eng.logprobs(tb, temperature=0.7, chunk_size=3)[0]
                per[i: i + size, : lp.shape[1]] = lp
            res[f"forward/{kind}/M{m}"] = {"sites": dict(hr.sites), "schedules": schedules,
                                           "max_diff_per_call": float((got - per).abs().max())}
            saved[(packed, m)] = got
    torch.save(saved, os.path.join(args.out, "forward.pt"))
    print("SYNCS " + json.dumps(res))
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
