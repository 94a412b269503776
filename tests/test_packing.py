"""Packed variable-length micro-batches and token-budget splits: the packed forward equals the padded one,
layouts never change the update, and the entropy metric without autograd equals the differentiable one."""
import pytest
import torch

from spmdrl.algos.token_stats import logprobs_from_hidden
from spmdrl.batch import Batch
from spmdrl.engines.fsdp import _LogprobHead
from spmdrl.engines.token_batch import dense_rows, pack_sequences
from spmdrl.engines.packing import balanced_partition, first_fit_decreasing, micro_batch_count
from spmdrl.errors import ConfigError
from spmdrl.tiny import build_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(vocab_size=320, seed=0)
    m.config._attn_implementation = "sdpa"
    return m.eval()


def ragged(seed, n, plen=(3, 12), rlen=(1, 40)):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (int(torch.randint(*plen, (1,), generator=g)),), generator=g) for _ in range(n)]
    resps = [torch.randint(3, 300, (int(torch.randint(*rlen, (1,), generator=g)),), generator=g) for _ in range(n)]
    return prompts, resps


@torch.no_grad()
def reference_logprobs(model, prompt, resp):
    """One sequence alone, no padding, no mask: log p(response token j | everything before it)."""
    ids = torch.cat([prompt, resp])[None]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(-1, resp[:, None])[:, 0]


def test_bins_and_partitions():
    lengths = [5, 9, 3, 7, 2, 8]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins) and len(bins) == 4  # 34 tokens need >= 4 rows
    parts = balanced_partition(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert sorted(sum(lengths[i] for i in p) for p in parts) == [11, 11, 12]
    assert micro_batch_count(lengths, 12, 0) == 3 and micro_batch_count(lengths, 0, 4) == 2
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        micro_batch_count(lengths, 8, 0)
    with pytest.raises(ConfigError, match="packed row"):
        first_fit_decreasing(lengths, 8)


@pytest.mark.quick
@pytest.mark.parametrize("row_len", [0, 96])
def test_packed_forward_equals_padded_and_unpadded(model, row_len):
    prompts, resps = ragged(1, 9)
    head = _LogprobHead(model)
    padded = pack_sequences(prompts, resps, 0)
    packed = pack_sequences(prompts, resps, 0, packed=True, row_len=row_len)
    assert packed.input_ids.numel() < padded.input_ids.numel()  # padding went away
    with torch.no_grad():
        lp_pad, ent_pad = head(padded, 1.0, True, 64)
        lp_pack, ent_pack = head(packed, 1.0, True, 64)
    assert torch.equal(packed.resp_mask, padded.resp_mask)
    assert (lp_pack - lp_pad).abs().max().item() < 1e-5
    assert (ent_pack - ent_pad).abs().max().item() < 1e-5
    for i, (p, r) in enumerate(zip(prompts, resps)):
        ref = reference_logprobs(model, p, r)
        assert (lp_pack[i, : len(r)].double() - ref).abs().max().item() < 1e-5
        assert lp_pack[i, len(r):].abs().sum() == 0


@pytest.mark.quick
def test_packed_gradients_equal_padded(model):
    prompts, resps = ragged(2, 6)
    head = _LogprobHead(model)
    grads = []
    for packed in (False, True):
        model.zero_grad()
        tb = pack_sequences(prompts, resps, 0, packed=packed)
        lp, _ = head(tb, 0.7, False, 32)
        (lp * tb.resp_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert (grads[0] - grads[1]).abs().max().item() < 1e-5


@pytest.mark.quick
def test_entropy_without_autograd_equals_differentiable():
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    lp1, e1 = logprobs_from_hidden(h, w, y, temperature=0.8, chunk_size=8, with_entropy=True)
    lp2, e2 = logprobs_from_hidden(h, w, y, temperature=0.8, chunk_size=8, with_entropy=True, entropy_grad=False)
    assert e1.requires_grad and not e2.requires_grad
    p = torch.softmax((h.double() @ w.double().T) / 0.8, -1)  # float64 reference
    assert (e2.double() - (-(p * p.log()).sum(-1))).abs().max().item() < 1e-5
    assert torch.equal(lp1, lp2) and torch.equal(e1.detach(), e2)
    g1 = torch.autograd.grad(lp1.sum(), (h, w))
    g2 = torch.autograd.grad(lp2.sum(), (h, w))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.quick
def test_micro_batches_token_budget_cover_the_batch_once():
    from spmdrl.loop.update import micro_batches

    prompts, resps = ragged(3, 12)
    P, R = max(map(len, prompts)), max(map(len, resps))
    batch = Batch({
        "prompts": torch.stack([torch.nn.functional.pad(p, (0, P - len(p))) for p in prompts]),
        "responses": torch.stack([torch.nn.functional.pad(r, (0, R - len(r))) for r in resps]),
        "prompt_len": torch.tensor([len(p) for p in prompts]), "response_len": torch.tensor([len(r) for r in resps]),
        "_row": torch.arange(12),
    })
    total = int((batch["prompt_len"] + batch["response_len"]).sum())
    budget = max(total // 3, int((batch["prompt_len"] + batch["response_len"]).max()))
    mbs = micro_batches(batch, 8, 0, max_tokens=budget, packed=True)
    assert len(mbs) >= 2 and sorted(torch.cat([mb["_row"] for mb, _ in mbs]).tolist()) == list(range(12))
    for mb, tb in mbs:
        assert int((mb["prompt_len"] + mb["response_len"]).sum()) <= budget and len(mb) <= 8
        assert tb.resp_ids.shape[0] == len(mb)


@pytest.mark.dist
def test_update_gradient_is_layout_independent(tmp_path):
    """dp=2 with padded, two-micro-batch, token-budget and packed token-budget micro-batches gives the gradient
    of the token-mean objective over the whole global batch, computed here in float64 on one unsharded model."""
    import importlib.util
    import os

    from launching import REPO, run
    from spmdrl.tiny import build_tiny
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny(str(tmp_path / "m"), seed=0)
    out = tmp_path / "grads.pt"
    run([os.path.join(REPO, "tests", "dist_scripts", "packed_update.py"), model_dir, str(out)], nproc=2)
    grads = torch.load(out)
    spec = importlib.util.spec_from_file_location("packed_update", os.path.join(REPO, "tests", "dist_scripts", "packed_update.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    b = script.global_batch()

    ref = AutoModelForCausalLM.from_pretrained(model_dir).double()
    loss = 0.0
    total = b["response_mask"].sum()
    for i in range(len(b)):  # on-policy PPO at ratio 1: grad of -sum_t A_t log p_t / (all response tokens)
        p, r = b["prompts"][i, : int(b["prompt_len"][i])], b["responses"][i, : int(b["response_len"][i])]
        logits = ref(input_ids=torch.cat([p, r])[None]).logits[0, len(p) - 1: -1]
        logp = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
        loss = loss - (b["advantages"][i, : len(r)].double() * logp).sum() / total
    loss.backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}
    for layout, g in grads.items():
        assert set(g) == set(expected), layout
        err = max(float((g[n].double() - expected[n]).abs().max()) for n in g)
        scale = max(float(expected[n].abs().max()) for n in g)
        assert err < 1e-5 * max(scale, 1.0), f"{layout}: max gradient error {err} (scale {scale})"


@pytest.mark.quick
@pytest.mark.parametrize("row_len", [0, 64])
def test_packed_metadata_restarts_positions_and_masks_each_sequence(row_len):
    """The row-packed reference layout (rows of row_len tokens; 0: dense_rows of a packed varlen batch, rows of
    its longest sequence); the varlen layout's own metadata is tests/test_attention.py's. The packing metadata itself, not the masked outputs (a constant shift of the position ids would leave
    those unchanged on the masked path but breaks varlen kernels, which find boundaries from the position ids):
    each sequence's position ids are 0..n-1 at its own start, a row's tail padding restarts at 0 too, the
    position-id restarts are exactly the sequence boundaries, the mask is the block-diagonal causal mask of
    those spans, and resp_pos points at the hidden state before each response token."""
    prompts, resps = ragged(5, 11)
    tb = pack_sequences(prompts, resps, 0, packed=True, row_len=row_len)
    if not row_len:
        tb = dense_rows(tb)
    lens = [len(p) + len(r) for p, r in zip(prompts, resps)]
    rows, L = tb.input_ids.shape
    assert L == (row_len or max(lens)) and tb.attention_mask.shape == (rows, 1, L, L)
    spans = [[] for _ in range(rows)]  # (start, end) of each sequence, from the token ids alone
    for i, (p, r) in enumerate(zip(prompts, resps)):
        row, start = int(tb.resp_row[i]), int(tb.resp_pos[i, 0]) - len(p) + 1
        assert torch.equal(tb.input_ids[row, start: start + lens[i]], torch.cat([p, r]))
        assert torch.equal(tb.position_ids[row, start: start + lens[i]], torch.arange(lens[i]))
        assert torch.equal(tb.input_ids[row, tb.resp_pos[i, : len(r)] + 1], r)  # hidden at t predicts t + 1
        spans[row].append((start, start + lens[i]))
    expected = torch.zeros(rows, L, L, dtype=torch.bool)
    for row, sp in enumerate(spans):
        sp.sort()
        assert all(a[1] == b[0] for a, b in zip(sp, sp[1:])) and sp[0][0] == 0  # contiguous from column 0
        end = sp[-1][1]
        if end < L:
            sp.append((end, L))  # the tail padding: one block of its own
            assert torch.equal(tb.position_ids[row, end:], torch.arange(L - end))
        starts = torch.nonzero(tb.position_ids[row] == 0).flatten().tolist()
        assert starts == [a for a, _ in sp]  # cu_seqlens, as a varlen kernel derives it
        for a, b in sp:
            expected[row, a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(tb.attention_mask[:, 0], expected)
    assert sum(len(sp) for sp in spans) >= len(lens) and rows < len(lens)  # several sequences share rows
