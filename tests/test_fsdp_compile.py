"""FSDP2 engine build options: torch.compile per decoder block (model.compile) gives the eager engine's log-probs
and gradients, and the resharding choice (a trainable engine keeps its last block gathered between forward and
backward; forward-only engines reshard every block)."""
import pytest
import torch
from torch.distributed.tensor import DTensor

from spmdrl.config import load_config
from spmdrl.config.validate import validate
from spmdrl.dist.layout import plan_layout
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.engines.fsdp import FSDPEngine
from spmdrl.engines.token_batch import pack_sequences
from spmdrl.errors import ConfigError
from spmdrl.tiny import build_tiny


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from launching import world_of_one

    model = build_tiny(str(tmp_path_factory.mktemp("compile")))
    with world_of_one():
        mesh = RoleMeshes(plan_layout(load_config(None, [f"model.path={model}"]).placement, 1), 0, "cpu")["actor"]
        yield model, mesh


def batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (3, 5):  # two shapes: the dynamic-shape compile serves both without a recompile per length
        prompts = [torch.randint(3, 200, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g) for _ in range(n)]
        resps = [torch.randint(3, 200, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g) for _ in range(n)]
        out.append(pack_sequences(prompts, resps, 0))
    return out


def run(eng, tbs):
    logps, grads = [], {}
    for tb in tbs:
        logp, _ = eng.logprobs(tb)
        (logp * tb.resp_mask).sum().backward()
        logps.append(logp.detach())
    for name, p in eng.hf.named_parameters():
        grads[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    return logps, grads


def test_compiled_blocks_match_eager(world):
    model, mesh = world
    tbs = batches()
    eager = FSDPEngine(model, mesh, torch.device("cpu"), trainable=True)
    compiled = FSDPEngine(model, mesh, torch.device("cpu"), trainable=True, compile=True)
    lp_e, g_e = run(eager, tbs)
    lp_c, g_c = run(compiled, tbs)
    for a, b in zip(lp_e, lp_c):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    assert g_e.keys() == g_c.keys()
    for name in g_e:
        scale = g_e[name].abs().max().clamp_min(1e-3)
        assert ((g_e[name] - g_c[name]).abs().max() / scale) < 1e-4, name
    # the blocks really run compiled: their forward is dynamo's wrapper
    assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in compiled.hf.model.layers)


def test_last_block_stays_gathered_for_backward(world):
    model, mesh = world
    actor = FSDPEngine(model, mesh, torch.device("cpu"), trainable=True)
    ref = FSDPEngine(model, mesh, torch.device("cpu"), trainable=False)
    tb = batches()[0]
    actor.logprobs(tb)  # under grad: activations kept for a backward
    layers = actor.hf.model.layers
    assert not isinstance(layers[-1].mlp.up_proj.weight, DTensor)  # still the gathered parameter
    assert all(isinstance(b.mlp.up_proj.weight, DTensor) for b in layers[:-1])  # resharded after their forward
    with torch.no_grad():
        ref.logprobs(tb)
    assert all(isinstance(b.mlp.up_proj.weight, DTensor) for b in ref.hf.model.layers)


def test_compile_with_megatron_is_refused(world):
    model, _ = world
    cfg = load_config(None, [f"model.path={model}", "model.compile=true", "trainer.backend=megatron"])
    with pytest.raises(ConfigError, match="model.compile"):
        validate(cfg, 1)
