"""Mixtures of experts on the Megatron backend with expert parallelism (spmdrl/engines/megatron: convert.py's expert
pieces, model.py's MoE layers, routing.py), on CPU/gloo with real megatron-core, several processes.

One torchrun run per layout (tests/dist_scripts/megatron_moe.py): EP = 2 at dp 2 on 2 ranks (tiny Qwen3-MoE, then a
tiny Mixtral, then a tiny Qwen2-MoE), EP = 2 x TP = 2 on 4 ranks (Qwen3-MoE, then Qwen2-MoE; expert tensor parallelism
and sequence parallelism), EP = 2 x PP = 2 on 4 ranks (Qwen3-MoE; megatron's pipeline-last rank order, without the
router losses). Qwen2-MoE adds a shared expert (tensor-parallel like a dense MLP, replicated over ep) with
its sigmoid gate (whole on every rank) and top-k weights that are not renormalised. Every
check compares with an independent reference computed here from the unsharded transformers model in float64 (eager
experts): log-probs, the gradient of an objective with log-prob and router-loss terms, the router loss values, and
routing replay against the model's own routing and against a router perturbed on purpose; plus the original
safetensors (export round trip) and the running engine (bitwise resume). The engine runs in float32: 1e-5 is the
tolerance of the dense Megatron tests (tests/test_megatron_engine.py) for the same tiny sizes.
"""
import functools
import os
import sys

import pytest
import torch

from launching import run

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist_scripts"))
from megatron_moe import A, Z, seqs  # noqa: E402
from hf_files import read_safetensors  # noqa: E402

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.dist
SCRIPT = os.path.join(HERE, "dist_scripts", "megatron_moe.py")
DP, MICRO = 2, 2
# (name, models, nproc, tp, pp): ep 2 everywhere, dp = nproc / (tp x pp) = 2
LAYOUTS = [("ep2", ("qwen3_moe", "mixtral", "qwen2_moe"), 2, 1, 1), ("ep2_tp2", ("qwen3_moe", "qwen2_moe"), 4, 2, 1),
           ("ep2_pp2", ("qwen3_moe",), 4, 1, 2)]
PP = {name: pp for name, _, _, _, pp in LAYOUTS}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from spmdrl.tiny import build_tiny

    root = tmp_path_factory.mktemp("moe_models")
    return {arch: build_tiny(str(root / arch), seed=0, arch=arch, num_layers=2) for arch in ("qwen3_moe", "mixtral", "qwen2_moe")}


@functools.lru_cache(maxsize=None)
def _hf(model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64, experts_implementation="eager")


def _own_routes(model_path: str) -> list[torch.Tensor]:
    """The float64 model's own top-k experts of every position of every sequence: [len, layers, top_k]."""
    hf, (prompts, resps, _) = _hf(model_path), seqs()
    k = hf.config.num_experts_per_tok
    with torch.no_grad():
        return [torch.stack([torch.softmax(lg, -1).topk(k, -1).indices for lg in
                             hf(input_ids=torch.cat([p, r])[None], output_router_logits=True).router_logits], 1)
                for p, r in zip(prompts, resps)]


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    out = {}
    for name, archs, nproc, tp, pp in LAYOUTS:
        d = tmp_path_factory.mktemp(name)
        torch.save(_own_routes(models[archs[0]]), d / f"{archs[0]}.routes.pt")
        run([SCRIPT, "--out", str(d), "--tp", str(tp), "--pp", str(pp), "--ep", "2", "--micro", str(MICRO), "--resume",
             "--replay", *[models[a] for a in archs]], nproc=nproc, timeout=900)
        out[name] = {a: (models[a], d, [torch.load(d / f"{a}.rank{r}.pt", weights_only=False) for r in range(nproc)])
                     for a in archs}
    return out


def _terms(logits: torch.Tensor, k: int):
    """(load-balancing loss, z-loss) of one layer's router logits [T, E] (the model's own top-k)."""
    p = torch.softmax(logits, -1)
    E = logits.shape[-1]
    f = torch.nn.functional.one_hot(p.topk(k, -1).indices, E).sum((0, 1)).double() / (logits.shape[0] * k)
    return E * (f * p.mean(0)).sum(), torch.logsumexp(logits, -1).square().mean()


@functools.lru_cache(maxsize=None)
def _reference(model_path: str, losses: bool = True):
    """Float64: log-probs per sequence, the router terms of every (dp rank, micro-batch) and the gradient of
    L = sum c * logp / C + sum over (rank, micro-batch) (A aux + Z z) / (dp * M) (the script's objective; without
    the router terms when not `losses`)."""
    hf, (prompts, resps, coef) = _hf(model_path), seqs()
    hf.zero_grad()
    k, C = hf.config.num_experts_per_tok, float(sum(c.sum() for c in coef))
    lps, router, loss = [], [], 0.0
    for p, r, c in zip(prompts, resps, coef):
        out = hf(input_ids=torch.cat([p, r])[None], output_router_logits=True)
        lp = torch.log_softmax(out.logits[0, len(p) - 1: len(p) - 1 + len(r)], -1).gather(-1, r[:, None]).squeeze(-1)
        lps.append(lp.detach())
        router.append(out.router_logits)
        loss = loss + (c.double() * lp).sum() / C
    per = len(prompts) // DP
    terms = []
    for d in range(DP):
        for m in range(MICRO):
            ids = range(d * per + m * per // MICRO, d * per + (m + 1) * per // MICRO)
            layers = [_terms(torch.cat([router[i][layer] for i in ids]), k) for layer in range(len(router[0]))]
            aux, z = sum(a for a, _ in layers), sum(z for _, z in layers)
            terms.append((float(aux.detach()), float(z.detach())))
            if losses:
                loss = loss + (A * aux + Z * z) / (DP * MICRO)
    loss.backward()
    return lps, terms, {n: p.grad.clone() for n, p in hf.named_parameters()}


def _assemble(ranks, key, shapes):
    full = {n: torch.full(s, float("nan"), dtype=torch.float64) for n, s in shapes.items()}
    for res in ranks:
        for name, blocks in res[key].items():
            for (offs, shape), t in blocks:
                full[name][tuple(slice(o, o + s) for o, s in zip(offs, shape))] = t.double()
    return full


CASES = [(layout, arch) for layout, archs, _, _, _ in LAYOUTS for arch in archs]


@pytest.mark.parametrize("layout,arch", CASES)
def test_moe_logprobs_gradients_and_router_losses_match_float64(runs, layout, arch):
    """EP (x TP or x PP): log-probs, router loss values and the gradient after one train_step (DDP's dense all-reduce
    and expert-data-parallel all-reduce, 1/dp scaling) equal the unsharded float64 model's; so does the grad norm
    (experts summed over ep, dense parameters counted once; stages summed over pp)."""
    from spmdrl.dist.layout import RoleLayout

    model, _, ranks = runs[layout][arch]
    pp = PP[layout]
    lps, terms, grads = _reference(model, losses=pp == 1)
    lay = RoleLayout("actor", tuple(range(len(ranks))), DP, pp, len(ranks) // (DP * pp), 1, 2)
    for rank, res in enumerate(ranks):
        for packed in (False, True):
            got = res["logprobs"][packed]
            for i, want in enumerate(lps):
                torch.testing.assert_close(got[i, :len(want)].double(), want, atol=1e-5, rtol=0)
        d = lay.coords(rank)[0]
        assert len(res["moe_losses"]) == (MICRO if pp == 1 else 0)
        for (aux, z), (want_aux, want_z) in zip(res["moe_losses"], terms[d * MICRO: (d + 1) * MICRO]):
            assert aux == pytest.approx(want_aux, abs=1e-5) and z == pytest.approx(want_z, abs=1e-5)
        assert res["blocks_ok"]
    got = _assemble(ranks, "grads", {n: tuple(g.shape) for n, g in grads.items()})
    assert got.keys() == grads.keys() and any(".experts.gate_up_proj" in n for n in got)
    for n, g in grads.items():
        torch.testing.assert_close(got[n], g, atol=1e-5, rtol=1e-5, msg=lambda m: f"{layout} {arch} {n}: {m}")
    assert min(float(g.abs().max()) for n, g in grads.items() if "mlp" in n) > 1e-3  # experts and router really move
    norm = float(sum(g.pow(2).sum() for g in grads.values()).sqrt())
    for res in ranks:
        assert res["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)


def _replayed_hf_logprobs(model_path: str, routes, router: dict) -> list[torch.Tensor]:
    """Float64 log-probs with the given router weights, every token sent to its route, weighted by the router's
    softmax at the routed experts renormalised (a forward hook on each transformers router, written here)."""
    import copy

    hf, (prompts, resps, _) = copy.deepcopy(_hf(model_path)), seqs()
    with torch.no_grad():
        for n, w in router.items():
            hf.get_parameter(n).copy_(w)
    current = {}

    def hook(layer):
        def fn(module, args, output):
            logits = output[0]
            used = current["routes"][:, layer]
            w = torch.softmax(logits.double(), -1).gather(-1, used)
            return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), used
        return fn

    for layer, block in enumerate(hf.model.layers):
        block.mlp.gate.register_forward_hook(hook(layer))
    out = []
    with torch.no_grad():
        for p, r, route in zip(prompts, resps, routes):
            current["routes"] = route
            logits = hf(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1: len(p) - 1 + len(r)]
            out.append(torch.log_softmax(logits, -1).gather(-1, r[:, None]).squeeze(-1))
    return out


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_moe_routing_replay(runs, layout):
    """Routes = the float64 model's own routing. Replay on: every choice agrees (router and route agreement 1.0)
    and the log-probs are the model's. Router weights rolled by one expert: without replay the trainer routes
    elsewhere (agreement < 0.5, log-probs off by > 1e-2); with replay the routing used is the routes' again (route
    agreement 1.0 while the router's own still disagrees) and the log-probs equal the float64 model with that
    router, the same routes and its renormalised probabilities of them."""
    model, d, ranks = runs[layout]["qwen3_moe"]
    routes = torch.load(d / f"{os.path.basename(model)}.routes.pt")
    lps, _, _ = _reference(model)
    n_choices = sum(r.numel() for r in routes)
    router = _assemble(ranks, "perturbed_router", {n: tuple(p.shape) for n, p in _hf(model).named_parameters()
                                                   if n.endswith("mlp.gate.weight")})
    perturbed = _replayed_hf_logprobs(model, routes, router)
    for res in ranks:
        own, off, on = (res["replay"][c] for c in ("own", "perturbed_off", "perturbed_on"))
        assert float(own["counts"]["routed"]) == n_choices
        assert float(own["counts"]["agree_own"]) == float(own["counts"]["agree_used"]) == n_choices
        assert float(off["counts"]["agree_used"]) == float(off["counts"]["agree_own"]) < 0.5 * n_choices
        assert float(on["counts"]["agree_used"]) == n_choices and float(on["counts"]["agree_own"]) < 0.5 * n_choices
        assert float(own["counts"]["load"].sum()) == n_choices  # every real token's k choices, counted once
        gap_off = 0.0
        for i, want in enumerate(lps):
            n = len(want)
            torch.testing.assert_close(own["logprobs"][i, :n].double(), want, atol=1e-5, rtol=0)
            torch.testing.assert_close(on["logprobs"][i, :n].double(), perturbed[i], atol=1e-5, rtol=0)
            gap_off = max(gap_off, float((off["logprobs"][i, :n].double() - want).abs().max()))
        assert gap_off > 1e-2


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_moe_checkpoint_resume_is_bitwise_and_export_round_trips(runs, layout):
    """A checkpoint (experts saved once by their first expert-data-parallel holder, broadcast over edp after the
    load) restores parameters and AdamW moments bitwise, and the next step equals the running engine's; export_hf
    writes transformers' in-memory (fused expert) tensors, which load into the original model bitwise."""
    for arch, (model, d, ranks) in runs[layout].items():
        if "resume_equal" in ranks[0]:
            assert all(res["load_equal"] and res["resume_equal"] for res in ranks)
            assert max(res["moved"] for res in ranks) > 1e-4
        export = d / f"{os.path.basename(model)}.export"
        assert read_safetensors(model).keys() != read_safetensors(export).keys()  # per-expert -> fused tensors
        orig, back = (_hf(str(x)).state_dict() if x == model else _load(str(x)) for x in (model, export))
        assert orig.keys() == back.keys() and any(".experts.gate_up_proj" in k for k in orig)
        for k in orig:
            assert torch.equal(orig[k], back[k]), (arch, k)


def _load(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").state_dict()


@pytest.mark.parametrize("layout", [x[0] for x in LAYOUTS])
def test_host_optimizer_steps_float32_masters_and_resumes_bitwise(runs, layout):
    """A bfloat16 engine with the host optimizer (memory.<role>_host_optimizer; spmdrl/engines/megatron/host_optim.py):
    its float32 masters start as the bf16 weights, one step moves them as AdamW does in float64 from the clipped
    float32 gradients (lr 1e-2, weight decay 0.01, clip 0.5), the model weights become the masters rounded to bf16,
    and a checkpoint restores weights, masters and moments bitwise (the next step too)."""
    model, _, ranks = runs[layout]["qwen3_moe"]
    shapes = {n: tuple(p.shape) for n, p in _hf(model).named_parameters()}
    host = [res["host"] for res in ranks]
    before, grads, after, params = (_assemble(host, k, shapes)
                                    for k in ("masters_before", "grads", "masters_after", "params_after"))
    lr, wd, (b1, b2), eps = 1e-2, 0.01, (0.9, 0.999), 1e-8
    norm = float(sum(g.pow(2).sum() for g in grads.values()).sqrt())
    assert host[0]["first_metrics"]["grad_norm"] > 0.5 and norm == pytest.approx(0.5, rel=1e-4)  # clipped
    for n in shapes:
        w, g = before[n], grads[n]
        assert torch.equal(w.to(torch.bfloat16).double(), w)  # masters start as the bf16 weights
        m, v = (1 - b1) * g, (1 - b2) * g * g
        want = w * (1 - lr * wd) - lr * (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + eps)
        torch.testing.assert_close(after[n], want, atol=1e-6, rtol=0, msg=lambda s: f"{layout} {n}: {s}")
        assert torch.equal(params[n], after[n].to(torch.bfloat16).double()), n
    assert all(h["load_equal"] and h["resume_equal"] for h in host)
    assert max(h["moved"] for h in host) > 1e-3
