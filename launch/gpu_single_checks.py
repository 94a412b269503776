"""Single-GPU checks of the CUDA-only attention paths (needs one CUDA device; nothing else to install):

  1. kernel: spmdrl's call of the installed torch's varlen_attn (engines/attention.py _varlen_cuda), bf16, MHA
     and GQA, the default and a custom scale, against float64 attention of each sequence alone;
  2. float32: _varlen_cuda declines float32 and varlen_attention then answers through SDPA, against float64;
  3. engine: FSDP2 log-probs and gradients of a packed varlen micro-batch (eager, model.compile, selective and
     full recompute) against a padded micro-batch in eager mode; selective recompute reruns no varlen
     attention in backward, full recompute reruns it once per layer.

    python launch/gpu_single_checks.py OUT_DIR      # writes OUT_DIR/gpu_single_checks.json, exits 1 on a failure

Tolerances are bf16's (the packed and padded layouts run different kernels in bf16): log-probs within 0.05,
gradients within 5% of the padded run's largest entry, per parameter.
"""
from __future__ import annotations

import collections
import datetime
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

RESULTS: dict = {}


def record(name: str, ok: bool, **figures) -> None:
    RESULTS[name] = {"ok": bool(ok), **figures}
    print(f"{'PASS' if ok else 'FAIL'} {name} {json.dumps(figures)}", flush=True)


def reference(q, k, v, lengths, scale):
    """float64 causal attention of each packed sequence alone; query head h reads kv head h // (Hq / Hkv)."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start: start + n].double().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        s = (qs @ ks.transpose(1, 2)) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def kernel_checks() -> None:
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    from spmdrl.engines import attention

    record("varlen_attn signature", True, torch=torch.__version__,
           params=list(inspect.signature(varlen_attn).parameters))
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [5, 17, 1, 33, 9]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    for kv in (8, 2):
        for scale in (None, 0.05):
            q = torch.randn(sum(lengths), 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(sum(lengths), kv, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(sum(lengths), kv, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            out = attention._varlen_cuda(q, k, v, cu, max(lengths), scale)
            ref = reference(q, k, v, lengths, scale if scale is not None else 64 ** -0.5)
            err = None if out is None else float((out.double() - ref).abs().max())
            record(f"varlen bf16 heads 8/{kv} scale {scale}", out is not None and err < 2e-2, max_abs_err=err)
            q32, k32, v32 = q.float(), k.float(), v.float()
            declined = attention._varlen_cuda(q32, k32, v32, cu, max(lengths), scale) is None
            out32 = attention.varlen_attention(q32, k32, v32, cu, max(lengths), scale=scale)
            err32 = float((out32.double() - reference(q32, k32, v32, lengths,
                                                       scale if scale is not None else 64 ** -0.5)).abs().max())
            record(f"varlen fp32 heads 8/{kv} scale {scale}", declined and err32 < 1e-4, declined=declined,
                   max_abs_err=err32)


class OpCounts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def engine_checks(model_dir: str, device: str = "cuda") -> None:
    from spmdrl.config import load_config
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines.fsdp import FSDPEngine, pack_sequences

    mesh = RoleMeshes(plan_layout(load_config(None, [f"model.path={model_dir}"]).placement, 1), 0, device)["actor"]
    g = torch.Generator().manual_seed(0)
    lengths = [(5, 40), (30, 3), (12, 77), (2, 19), (50, 50), (7, 1)]
    prompts = [torch.randint(3, 300, (p,), generator=g) for p, _ in lengths]
    resps = [torch.randint(3, 300, (r,), generator=g) for _, r in lengths]
    w = torch.randn(len(prompts), max(r for _, r in lengths), generator=g)

    def run(packed: bool, **kw):
        torch.manual_seed(0)
        eng = FSDPEngine(model_dir, mesh, torch.device(device), trainable=True, **kw)
        tb = pack_sequences(prompts, resps, 0, packed=packed)
        lp, _ = eng.logprobs(tb)
        loss = (lp * (w * tb.resp_mask).to(lp.device)).sum()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with OpCounts() as ops:
            loss.backward()
        sync()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
                 for n, p in eng.hf.named_parameters()}
        return lp.float().detach(), grads, ops.counts, time.perf_counter() - t0

    base_lp, base_g, _, _ = run(False)
    variants = {"packed eager": {}, "packed compile": {"compile": True},
                "packed selective": {"gradient_checkpointing": True, "checkpoint_policy": "selective"},
                "packed full": {"gradient_checkpointing": True, "checkpoint_policy": "full"}}
    for name, kw in variants.items():
        lp, grads, counts, seconds = run(True, **kw)
        lp_err = max(float((lp[i, :r] - base_lp[i, :r]).abs().max()) for i, (_, r) in enumerate(lengths))
        g_err = max(float((grads[n] - base_g[n]).abs().max() / base_g[n].abs().max().clamp_min(1e-12))
                    for n in base_g)
        reruns = counts.get("torch_attn._varlen_attn", 0)
        ok = lp_err < 0.05 and g_err < 0.05
        if name == "packed selective":
            ok = ok and reruns == 0
        if name == "packed full":
            ok = ok and reruns > 0
        record(f"engine {name} vs padded eager", ok, logprob_max_abs_err=lp_err, grad_max_rel_err=g_err,
               varlen_attn_in_backward=reruns, backward_s=round(seconds, 4))


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "gpu_single_checks"
    os.makedirs(out_dir, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", 0))
    record("device", True, name=torch.cuda.get_device_name(0), torch=torch.__version__)
    for name, fn in (("kernel", kernel_checks),):
        try:
            fn()
        except Exception as e:  # a check that cannot run is a failure with its reason, the others still run
            record(f"{name} checks raised", False, error=f"{type(e).__name__}: {e}")
    try:
        from spmdrl.tiny import build_tiny

        engine_checks(build_tiny(tempfile.mkdtemp(prefix="gpu-checks-"), seed=0, max_position_embeddings=512))
    except Exception as e:
        record("engine checks raised", False, error=f"{type(e).__name__}: {e}")
    dist.destroy_process_group()
    with open(os.path.join(out_dir, "gpu_single_checks.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    failed = [k for k, v in RESULTS.items() if not v["ok"]]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed" + (f": {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
