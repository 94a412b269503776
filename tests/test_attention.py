"""spmdrl's attention kernels (spmdrl/engines/attention.py) and the packed variable-length layout: the kernel
against an explicit float64 softmax over each sequence alone (grouped-query heads, forward and gradients); the
FSDP2 engine's log-probs, gradients and critic values for packed-varlen, padded and the dense-mask reference
layouts against each sequence alone in float64; the packing metadata itself; no dense mask on the varlen path."""
import pytest
import torch
import torch.distributed as dist

from spmdrl.engines import attention as attn
from spmdrl.engines.fsdp import _LogprobHead
from spmdrl.engines.token_batch import pack_sequences
from spmdrl.errors import ConfigError
from spmdrl.tiny import build_model, build_tiny


def ragged(seed, n, plen=(1, 10), rlen=(1, 24)):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (int(torch.randint(*plen, (1,), generator=g)),), generator=g) for _ in range(n)]
    resps = [torch.randint(3, 300, (int(torch.randint(*rlen, (1,), generator=g)),), generator=g) for _ in range(n)]
    return prompts, resps


def reference_attention(q, k, v, lengths, scale, window=None):
    """Each sequence alone, float64, an explicit softmax over its keys 0..t for query t (t-window+1..t with a
    sliding window); query head h reads key/value head h // (Hq / Hkv)."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start: start + n].double() for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)  # the reference may repeat
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        if window is not None:
            keep &= ~torch.ones(n, n, dtype=torch.bool).tril(-window)
        s = s.masked_fill(~keep, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("lengths, path", [([5, 1, 13, 8, 2], "_varlen_loop"), ([7, 9, 8, 6, 9], "_varlen_batched")],
                         ids=["per-sequence", "one-call"])
@pytest.mark.parametrize("heads, kv_heads, window", [(4, 2, None), (6, 1, None), (2, 2, None), (4, 2, 3)],
                         ids=["gqa", "mqa", "mha", "gqa-window3"])
@pytest.mark.quick
def test_varlen_kernel_equals_float64_reference(heads, kv_heads, window, lengths, path, monkeypatch):
    """Both CPU forms: one SDPA call per sequence (lengths that differ a lot) and one call over rows (similar
    lengths); a sliding window of 3 (Gemma 3's local layers) in both and in the padded form."""
    torch.manual_seed(0)
    D = 16
    ran = []
    real = getattr(attn, path)
    monkeypatch.setattr(attn, path, lambda *a, **k: ran.append(path) or real(*a, **k))
    T = sum(lengths)
    q = torch.randn(T, heads, D, requires_grad=True)
    k = torch.randn(T, kv_heads, D, requires_grad=True)
    v = torch.randn(T, kv_heads, D, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    scale = D ** -0.5
    out = attn.varlen_attention(q, k, v, cu, max(lengths), scale=scale, window=window)
    assert ran == [path]
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference_attention(qd, kd, vd, lengths, scale, window)
    assert out.shape == (T, heads, D) and (out.double() - ref).abs().max().item() < 1e-5
    g = torch.randn(T, heads, D)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), (qd, kd, vd))
    for a, b in zip(grads, ref_grads):
        assert a.shape == b.shape and (a.double() - b).abs().max().item() < 1e-5

    # right-padded rows of the same sequences, garbage after each: causal attention alone is exact on real tokens
    L = max(lengths)
    rows = [torch.randn(len(lengths), L, x.shape[1], D) for x in (q, k, v)]
    start = 0
    for i, n in enumerate(lengths):
        for r, x in zip(rows, (q, k, v)):
            r[i, :n] = x.detach()[start: start + n]
        start += n
    out_rows = attn.padded_causal_attention(*(r.transpose(1, 2) for r in rows), scale=scale,
                                            window=window).transpose(1, 2)
    start = 0
    for i, n in enumerate(lengths):
        assert (out_rows[i, :n].double() - ref[start: start + n]).abs().max().item() < 1e-5
        start += n


@torch.no_grad()
def alone_logprobs(model, prompt, resp):
    ids = torch.cat([prompt, resp])[None]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(-1, resp[:, None])[:, 0]


@pytest.fixture(scope="module")
def varlen_model():
    m = build_model(vocab_size=320, num_kv_heads=2, seed=0).eval()  # 4 query heads, 2 key/value heads
    m.set_attn_implementation(attn.register_hf())
    return m


def test_sliding_window_layers_packed_equal_transformers_alone():
    """A tiny Gemma 3 (alternating sliding-window and full layers, window 16, tied embeddings): spmdrl's attention
    on a packed batch of sequences longer than the window gives the log-probs transformers' own SDPA attention (its
    sliding-window masks) gives each sequence alone, in float64. With the window ignored the first differs."""
    ref_model = build_model(arch="gemma3", vocab_size=320, seed=0).double().eval()
    ours = build_model(arch="gemma3", vocab_size=320, seed=0).double().eval()
    ours.set_attn_implementation(attn.register_hf())
    assert {l.self_attn.sliding_window for l in ours.model.layers} == {16, None}
    prompts, resps = ragged(3, 4, plen=(10, 20), rlen=(10, 24))
    tb = pack_sequences(prompts, resps, 0, packed=True)
    head = _LogprobHead(ours)
    with torch.no_grad():
        logp, _ = head(tb, 1.0, False, 64)
    for i, (p, r) in enumerate(zip(prompts, resps)):
        want = alone_logprobs(ref_model, p, r)
        assert (logp[i, : len(r)].double() - want).abs().max().item() < 1e-5, i  # float32 log-softmax
    for layer in ours.model.layers:  # the same batch with every layer full: the long sequences differ
        layer.self_attn.sliding_window = None
    with torch.no_grad():
        full, _ = head(tb, 1.0, False, 64)
    assert (full - logp).abs().max().item() > 1e-4


def check_varlen_metadata(tb, prompts, resps):
    """The packed layout from its tensors alone: cu_seqlens are the cumulative lengths in batch order; the
    position ids are 0..n-1 over each [cu[i], cu[i+1]) and restart at 0 exactly there; the tokens of each span
    are prompt + response; resp_pos points at the hidden state before each response token; no mask, no padding."""
    lens = [len(p) + len(r) for p, r in zip(prompts, resps)]
    cu = tb.cu_seqlens
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert tb.max_seqlen == max(lens) and tb.mask is None and tb.input_ids.shape == (1, sum(lens))
    pos = tb.position_ids[0]
    assert torch.nonzero(pos == 0).flatten().tolist() == cu[:-1].tolist()
    for i, (p, r) in enumerate(zip(prompts, resps)):
        a, b = int(cu[i]), int(cu[i + 1])
        assert torch.equal(pos[a:b], torch.arange(b - a))
        assert torch.equal(tb.input_ids[0, a:b], torch.cat([p, r]))
        assert int(tb.resp_row[i]) == 0 and torch.equal(tb.input_ids[0, tb.resp_pos[i, : len(r)] + 1], r)


def test_packed_varlen_metadata_and_a_wrong_boundary(varlen_model):
    prompts, resps = ragged(5, 7)
    tb = pack_sequences(prompts, resps, 0, packed=True)
    check_varlen_metadata(tb, prompts, resps)
    head = _LogprobHead(varlen_model)
    with torch.no_grad():
        lp, _ = head(tb, 1.0, False, 64)
    for i, (p, r) in enumerate(zip(prompts, resps)):
        assert (lp[i, : len(r)].double() - alone_logprobs(varlen_model, p, r)).abs().max().item() < 1e-5
    # boundaries shifted by one token: the check refuses them, and they would change the outputs
    shifted = tb.cu_seqlens.clone()
    shifted[1:-1] += 1
    bad = pack_sequences(prompts, resps, 0, packed=True)
    bad.cu_seqlens = shifted
    with pytest.raises(AssertionError):
        check_varlen_metadata(bad, prompts, resps)
    with torch.no_grad():
        lp_bad, _ = head(bad, 1.0, False, 64)
    assert (lp_bad - lp).abs().max().item() > 1e-3
    # position ids shifted by a constant: refused too
    bad = pack_sequences(prompts, resps, 0, packed=True)
    bad.position_ids = bad.position_ids + 1
    with pytest.raises(AssertionError):
        check_varlen_metadata(bad, prompts, resps)


@pytest.mark.quick
def test_varlen_path_builds_no_dense_mask(varlen_model, monkeypatch):
    """A packed batch reaches every attention layer as one row with its boundaries and attention_mask None;
    the block-diagonal mask builder never runs."""
    from transformers import AttentionInterface

    from spmdrl.engines import packing

    seen = []

    def recording(module, query, key, value, attention_mask, **kw):
        seen.append((attention_mask, kw.get("cu_seq_lens_q"), query.shape[1], key.shape[1]))
        return attn.hf_attention(module, query, key, value, attention_mask, **kw)

    def refuse(*a, **k):
        raise AssertionError("block_causal_mask called on the varlen path")

    from transformers.integrations import sdpa_attention
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setitem(AttentionInterface._global_mapping, attn.HF_IMPLEMENTATION, recording)
    monkeypatch.setattr(packing, "block_causal_mask", refuse)
    for mod in (sdpa_attention, modeling_qwen2):  # GQA without repeating key/value heads
        monkeypatch.setattr(mod, "repeat_kv", refuse)
    prompts, resps = ragged(6, 5)
    tb = pack_sequences(prompts, resps, 0, packed=True)
    assert all(not (isinstance(v, torch.Tensor) and v.dim() == 4) for v in vars(tb).values())
    with torch.no_grad():
        _LogprobHead(varlen_model)(tb, 1.0, False, 64)
    assert len(seen) == varlen_model.config.num_hidden_layers
    assert all(m is None and cu is tb.cu_seqlens and (hq, hkv) == (4, 2) for m, cu, hq, hkv in seen)


@pytest.mark.parametrize("layout", ["padded", "varlen", "rows"])
def test_varlen_implementation_every_layout_equals_each_sequence_alone(varlen_model, layout):
    """Under spmdrl's attention a padded batch (causal SDPA, no mask), a varlen batch and a row-packed batch
    with an explicit 4-D mask (SDPA with that mask) all equal each sequence run alone."""
    prompts, resps = ragged(7, 8)
    tb = pack_sequences(prompts, resps, 0, packed=layout != "padded", row_len=40 if layout == "rows" else 0)
    with torch.no_grad():
        lp, _ = _LogprobHead(varlen_model)(tb, 1.0, False, 64)
    for i, (p, r) in enumerate(zip(prompts, resps)):
        assert (lp[i, : len(r)].double() - alone_logprobs(varlen_model, p, r)).abs().max().item() < 1e-5
        assert lp[i, len(r):].abs().sum() == 0


# ---- through the FSDP2 engine (a world of one, gloo) --------------------------------------------------------

@pytest.fixture(scope="module")
def engine_world(tmp_path_factory):
    from launching import free_port
    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    meshes = RoleMeshes(plan_layout(PlacementConfig(), 1), 0, "cpu")
    yield build_tiny(str(tmp_path_factory.mktemp("attn") / "m"), seed=0), meshes
    if created:
        dist.destroy_process_group()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_engine_packed_varlen_padded_and_dense_equal_each_sequence_alone(engine_world):
    """Log-probs and the gradient of a weighted log-prob sum through FSDPEngine (GQA tiny Qwen2), for a packed
    varlen and a padded micro-batch under attn_implementation "auto" and both layouts under "sdpa" (dense
    masks), against float64 runs of each sequence alone; critic values the same way."""
    from transformers import AutoModelForCausalLM

    from spmdrl.engines.fsdp import FSDPEngine

    model_dir, meshes = engine_world
    prompts, resps = ragged(11, 6)
    w = torch.randn(len(prompts), max(map(len, resps)), generator=torch.Generator().manual_seed(1))

    ref = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").double()
    loss, ref_lp = 0.0, []
    for i, (p, r) in enumerate(zip(prompts, resps)):
        logits = ref(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1: -1]
        lp = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
        ref_lp.append(lp.detach())
        loss = loss + (w[i, : len(r)].double() * lp).sum()
    loss.backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}

    for impl in ("auto", "sdpa"):
        eng = FSDPEngine(model_dir, meshes["actor"], torch.device("cpu"), trainable=True, attn_implementation=impl)
        assert (eng.hf.config._attn_implementation == attn.HF_IMPLEMENTATION) == (impl == "auto")
        for packed in (True, False):
            tb = pack_sequences(prompts, resps, 0, packed=packed)
            eng.module.zero_grad()
            lp, _ = eng.module(tb, 1.0, False, 64)
            (lp * w * tb.resp_mask).sum().backward()
            for i, r in enumerate(resps):
                assert (lp[i, : len(r)].double() - ref_lp[i]).abs().max().item() < 1e-5, (impl, packed)
            grads = {n: _full(p.grad) for n, p in eng.hf.named_parameters()}
            assert set(grads) == set(expected)
            err = max(float((grads[n].double() - expected[n]).abs().max()) for n in grads)
            assert err < 1e-5, (impl, packed, err)

    critic = FSDPEngine(model_dir, meshes["critic"], torch.device("cpu"), trainable=False, value_head=True)
    head = critic.hf.score
    wv, bv = _full(head.weight).double(), None if head.bias is None else _full(head.bias).double()
    with torch.no_grad():
        got = {packed: critic.values(pack_sequences(prompts, resps, 0, packed=packed)) for packed in (True, False)}
        for i, (p, r) in enumerate(zip(prompts, resps)):
            h = ref.model(input_ids=torch.cat([p, r])[None]).last_hidden_state[0, len(p) - 1: len(p) - 1 + len(r)]
            v = (h @ wv.T)[:, 0] + (0 if bv is None else bv[0])
            for packed in (True, False):
                assert (got[packed][i, : len(r)].double() - v).abs().max().item() < 1e-5


def test_bad_attn_implementation_is_one_line_config_error():
    from spmdrl.engines.fsdp import model_attention

    with pytest.raises(ConfigError) as info:
        model_attention("flash")
    msg = str(info.value)
    assert "model.attn_implementation = 'flash'" in msg and "auto, spmdrl, sdpa, eager" in msg and "\n" not in msg


# ---- the CUDA call, against each signature torch's varlen_attn has had ------------------------------------------
def first_release(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch.nn.attention.varlen.varlen_attn as first released: no scale, causal as a flag."""
    CALLS.append(dict(query=query, is_causal=is_causal))
    return torch.empty_like(query)


def intermediate(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), k_cache=None, v_cache=None, cache_seqlens=None, cache_batch_idx=None,
                 page_table=None, seqused_k=None):
    """The release after: keyword-only scale and window_size (causal = (-1, 0)), no enable_gqa."""
    CALLS.append(dict(query=query, scale=scale, window_size=window_size))
    return torch.empty_like(query)


CALLS: list[dict] = []
TORCH_VARLEN_ATTN = __import__("torch.nn.attention.varlen", fromlist=["varlen_attn"]).varlen_attn


def cuda_call(monkeypatch, kernel, heads, kv_heads, scale, dtype=torch.bfloat16):
    """What spmdrl's CUDA varlen call passes `kernel` (a stand-in for varlen_attn's signature only; the
    tensors are on the meta device), or the op arguments torch 2.13's own varlen_attn gives its custom op
    when kernel is None."""
    import torch.nn.attention.varlen as varlen

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.torch_attn._varlen_attn.default:
                CALLS.append(dict(op_args=args))
            return func(*args, **(kwargs or {}))

    CALLS.clear()
    monkeypatch.setattr(varlen, "varlen_attn", kernel or TORCH_VARLEN_ATTN)
    q = torch.empty(12, heads, 16, device="meta", dtype=dtype)
    kv = torch.empty(12, kv_heads, 16, device="meta", dtype=dtype)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device="meta")
    with Ops():
        out = attn._varlen_cuda(q, kv, kv, cu, 7, scale)
    return q, out, list(CALLS)


@pytest.mark.quick
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("scale", [None, 16 ** -0.5, 0.1], ids=["none", "default", "custom"])
def test_cuda_varlen_call_fits_each_signature(kv_heads, scale, monkeypatch):
    """Each form of varlen_attn gets only keywords it has: the first release no scale (a custom scale goes into
    q instead, the default one is left to the kernel), the later one scale and window_size, torch 2.13 also
    enable_gqa for grouped heads; every form is called once, causal, for MHA and GQA alike."""
    q, out, calls = cuda_call(monkeypatch, first_release, 4, kv_heads, scale)
    assert len(calls) == 1 and calls[0]["is_causal"] is True and out.shape == q.shape
    assert (calls[0]["query"] is q) == (scale != 0.1)  # only a scale other than 1/sqrt(D) is folded into q
    q, out, calls = cuda_call(monkeypatch, intermediate, 4, kv_heads, scale)
    assert calls == [dict(query=q, scale=scale, window_size=(-1, 0))]
    # torch 2.13's own varlen_attn (this venv's), run to its custom op on the meta device
    q, out, calls = cuda_call(monkeypatch, None, 4, kv_heads, scale)
    assert len(calls) == 1 and out.shape == q.shape
    args = calls[0]["op_args"]  # (q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, window_size, enable_gqa, ...)
    enable_gqa = args[10] if len(args) > 10 else False  # a default left out of the dispatched arguments
    assert args[0] is q and args[7:10] == (True, scale, [-1, 0]) and enable_gqa == (kv_heads != 4), args


@pytest.mark.quick
def test_cuda_varlen_folds_a_custom_scale_into_q_exactly():
    """Without a scale keyword, q * scale * sqrt(D) under the kernel's default 1/sqrt(D) is attention with
    `scale` (checked on CPU through SDPA, the same arithmetic the kernel does)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 16, generator=g, dtype=torch.float64) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)
    got = torch.nn.functional.scaled_dot_product_attention(q * (0.1 * 16 ** 0.5), k, v, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.quick
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("kernel", [first_release, intermediate, None], ids=["first", "intermediate", "2.13"])
def test_cuda_varlen_leaves_float32_to_sdpa(kernel, kv_heads, monkeypatch):
    """The flash kernels take float16 and bfloat16 only: float32 (model.dtype = float32 on CUDA) is not sent to
    them; the caller then runs SDPA, which takes it."""
    q, out, calls = cuda_call(monkeypatch, kernel, 4, kv_heads, None, dtype=torch.float32)
    assert out is None and calls == []
