"""The FSDP2 engine on the device, single rank, bf16 compute (the CUDA default) with float32 masters.

- A packed varlen micro-batch under each build option (eager, model.compile, selective and full recompute,
  activation offload) against a padded micro-batch in eager mode: log-probs and the gradient of a weighted
  log-prob sum; the padded eager run itself against float64 transformers of each sequence alone. On CUDA the
  packed forward runs torch's fused varlen kernel once per layer; selective recompute reruns none of it in
  backward, full recompute once per layer.
- LoRA in bf16: the optimizer holds the adapters only, the frozen base stays bitwise the model file's weights
  (in bf16) through two updates, the adapters (float32) move.
- The staging of micro-batches (loop/update.py: pinned host memory, non-blocking copies) delivers the host
  batch unchanged.

CPU runs the eager packed case, LoRA and staging; model.compile and the recompute policies have their CPU
forms in tests/test_fsdp_compile.py and tests/test_recompute.py, activation offload is CUDA-only.
"""

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from devices import DEVICES
from test_gpu_attention import VARLEN_OP
from launching import world_of_one
from spmdrl.batch import Batch
from spmdrl.config.schema import PlacementConfig
from spmdrl.dist.layout import plan_layout
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.engines.fsdp import FSDPEngine
from spmdrl.models.lora import LoraSettings, checkpoint_name, is_adapter
from spmdrl.engines.token_batch import pack_sequences
from spmdrl.tiny import build_tiny

LAYERS = 4
LENGTHS = [(5, 40), (30, 3), (12, 77), (2, 19), (50, 50), (7, 1)]  # (prompt, response) tokens
VARIANTS = {
    "eager": {},
    "compile": {"compile": True},
    "selective": {"gradient_checkpointing": True, "checkpoint_policy": "selective"},
    "full": {"gradient_checkpointing": True, "checkpoint_policy": "full"},
    "offload": {"gradient_checkpointing": True, "checkpoint_policy": "full", "checkpoint_offload": True},
}
# what the CPU run of this module leaves to other tests (each already covers it on CPU, in float32)
ON_CPU_ELSEWHERE = {"compile": "CPU form: tests/test_fsdp_compile.py", "selective": "CPU form: tests/test_recompute.py",
                    "full": "CPU form: tests/test_recompute.py", "offload": "activation offload is CUDA-only"}
# bf16 bounds: log-probs in nats; gradients as a fraction of the reference parameter gradient's largest entry
LP_TOL, GRAD_TOL = 0.05, 0.05


@pytest.fixture(scope="module", params=DEVICES)
def world(request, tmp_path_factory):
    device = request.param
    model = build_tiny(str(tmp_path_factory.mktemp(f"fsdp-{device}") / "m"), seed=0, num_layers=LAYERS)
    with world_of_one(device):
        yield device, model, RoleMeshes(plan_layout(PlacementConfig(), 1), 0, device)["actor"], {}


def sequences():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (p,), generator=g) for p, _ in LENGTHS]
    resps = [torch.randint(3, 300, (r,), generator=g) for _, r in LENGTHS]
    return prompts, resps, torch.randn(len(LENGTHS), max(r for _, r in LENGTHS), generator=g)


class VarlenCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.name() == VARLEN_OP
        return func(*args, **(kwargs or {}))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(world, packed: bool, **kw):
    """(log-probs [B, R] float32 on CPU, {name: float32 gradient}, fused varlen calls in forward, in backward)."""
    device, model, mesh, _ = world
    prompts, resps, w = sequences()
    torch.manual_seed(0)
    eng = FSDPEngine(model, mesh, torch.device(device), trainable=True, dtype="bfloat16", **kw)
    tb = pack_sequences(prompts, resps, 0, packed=packed)
    with VarlenCalls() as fwd:
        lp, _ = eng.logprobs(tb)
    with VarlenCalls() as bwd:
        (lp * (w * tb.resp_mask).to(lp.device)).sum().backward()
    grads = {n: _full(p.grad).float().cpu() for n, p in eng.hf.named_parameters()}
    return lp.detach().float().cpu(), grads, fwd.n, bwd.n


def padded_eager(world):
    cache = world[3]
    if "padded" not in cache:
        cache["padded"] = run(world, packed=False)
    return cache["padded"]


def max_errors(lp, grads, ref_lp, ref_grads):
    lp_err = max(float((lp[i, :r] - ref_lp[i, :r]).abs().max()) for i, (_, r) in enumerate(LENGTHS))
    g_err = max(float((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max()) for n in ref_grads)
    return lp_err, g_err


def test_padded_eager_bf16_against_float64_alone(world, record_property):
    """The reference the variants are held to, itself against float64 transformers runs of each sequence."""
    from transformers import AutoModelForCausalLM

    lp, grads, fwd, _ = padded_eager(world)
    ref = AutoModelForCausalLM.from_pretrained(world[1], attn_implementation="eager").double()
    prompts, resps, w = sequences()
    ref_lp = torch.zeros_like(lp, dtype=torch.float64)
    loss = 0.0
    for i, (p, r) in enumerate(zip(prompts, resps)):
        logits = ref(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1: -1]
        lps = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
        ref_lp[i, : len(r)] = lps.detach()
        loss = loss + (w[i, : len(r)].double() * lps).sum()
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    lp_err, g_err = max_errors(lp.double(), {n: g.double() for n, g in grads.items()}, ref_lp, ref_grads)
    record_property("errors", {"logprob_max_abs": lp_err, "grad_max_rel": g_err})
    assert fwd == 0  # padded rows: SDPA, never the varlen kernel
    assert lp_err < LP_TOL and g_err < GRAD_TOL, (lp_err, g_err)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_variant_against_padded_eager(world, variant, record_property):
    device = world[0]
    if device == "cpu" and variant in ON_CPU_ELSEWHERE:
        pytest.skip(ON_CPU_ELSEWHERE[variant])
    ref_lp, ref_grads, _, _ = padded_eager(world)
    lp, grads, fwd, bwd = run(world, packed=True, **VARIANTS[variant])
    lp_err, g_err = max_errors(lp, grads, ref_lp, ref_grads)
    record_property("errors", {"logprob_max_abs": lp_err, "grad_max_rel": g_err, "varlen_calls_forward": fwd,
                               "varlen_calls_backward": bwd})
    assert lp_err < LP_TOL and g_err < GRAD_TOL, (lp_err, g_err)
    for i, (_, r) in enumerate(LENGTHS):
        assert lp[i, r:].abs().sum() == 0  # nothing past each response
    if device == "cuda" and variant != "compile":  # compiled blocks call the kernel from generated code
        assert fwd == LAYERS, fwd  # the fused varlen kernel, once per layer
        assert bwd == {"selective": 0, "full": LAYERS, "offload": LAYERS}.get(variant, 0), bwd
    if device == "cpu":
        assert fwd == bwd == 0


def test_lora_bf16_trains_adapters_only_and_keeps_the_base(world, record_property):
    device, model, mesh, _ = world
    eng = FSDPEngine(model, mesh, torch.device(device), trainable=True, dtype="bfloat16", optim=dict(lr=1e-2),
                     lora=LoraSettings(rank=4, alpha=8, seed=3))
    named = dict(eng.hf.named_parameters())
    in_optimizer = {id(p) for group in eng.optimizer.param_groups for p in group["params"]}
    adapters = {n for n in named if is_adapter(n)}
    assert adapters and {n for n, p in named.items() if id(p) in in_optimizer} == adapters
    assert {str(named[n].dtype) for n in adapters} == {"torch.float32"}
    assert {str(p.dtype) for n, p in named.items() if n not in adapters} == {"torch.bfloat16"}
    start = {n: _full(named[n]).detach().cpu().clone() for n in adapters}

    prompts, resps, w = sequences()
    tb = pack_sequences(prompts, resps, 0, packed=True)

    def loss_fn(mb, e):
        lp, _ = e.logprobs(mb)
        return -(lp * (w * mb.resp_mask).to(lp.device)).sum() / mb.resp_mask.sum(), {}

    for _ in range(2):
        eng.train_step([tb], loss_fn)
    on_file = load_file(f"{model}/model.safetensors")
    changed = [n for n, p in named.items() if n not in adapters
               and not torch.equal(_full(p).detach().cpu(), on_file[checkpoint_name(n)].to(torch.bfloat16))]
    assert changed == []  # the frozen base: bitwise the file's weights in bf16, after two updates
    moved = max(float((_full(named[n]).detach().cpu() - start[n]).abs().max()) for n in adapters)
    record_property("adapter_max_change", moved)
    assert moved > 1e-3


def test_staged_micro_batch_is_the_host_batch(world):
    """loop/update.py _staged: pinned host copies sent without blocking; read back after the stream has run."""
    from spmdrl.loop.update import _staged

    device = world[0]
    g = torch.Generator().manual_seed(0)
    host = Batch({"ids": torch.randint(0, 1000, (64, 300), generator=g), "mask": torch.rand(64, 300, generator=g)})
    staged = _staged(host, torch.device(device))
    if device == "cuda":
        torch.cuda.synchronize()
    for k, v in host.tensors.items():
        assert staged[k].device.type == device and torch.equal(staged[k].cpu(), v), k
