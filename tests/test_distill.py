"""On-policy distillation (docs/distillation.md).

Without processes: both modes' per-token terms against float64 references built from the student's and the
teacher's full log-softmax over the vocabulary (the reverse KL and its gradient summed exactly over every token,
not sampled), and the model-tokens-only rule of multi-turn masks.

With processes (torchrun, gloo, in-process vLLM, FSDP2): one RL + distillation step (GRPO advantages plus the
reverse-KL term) of a 4-layer student towards a 6-layer teacher, two ways: colocated with student dp = 2 and
teacher tp = 2 (the batch moved into the teacher's layout and back, the teacher offloaded between uses), and
split placement (rank 0 rolls out, rank 1 trains: student dp = 1, teacher tp = 1). Per-request seeds draw the
same samples in both. The dumped global batch is checked against float64 HF forwards of both models (old and
teacher log-probs, the combined advantages, the distill/* metrics), and both layouts log the same step-1
metrics (one launch fewer than a layout per degree: the suite's time).
The kl_loss mode's gradient at dp 1 vs 2 against a float64 whole-batch reference is in test_objective_layout.py.
Bad input (a teacher of another tokenizer family, a missing teacher, a teacher layout that does not fit) is one
line and exit 2 before launch."""
import json
import os

import pytest
import torch

from spmdrl.algos import DISTILL_MODES, distill_sums

HERE = os.path.dirname(os.path.abspath(__file__))


def _full_log_softmax(seed: int = 0, B: int = 3, T: int = 5, V: int = 11):
    g = torch.Generator().manual_seed(seed)
    # moderate logits: k3's clamp (at 10) stays out of reach, so its expectation is exactly the KL
    student_logits = (0.5 * torch.randn(B, T, V, generator=g, dtype=torch.float64)).requires_grad_()
    teacher_logits = 0.8 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    return student_logits, torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)


def test_modes_match_float64_references_from_full_log_softmax():
    logits, ls, lt = _full_log_softmax()
    B, T, V = ls.shape
    ps = ls.exp().detach()
    exact_kl = (ls.exp() * (ls - lt)).sum(-1)  # KL(student || teacher) per position, over the whole vocabulary
    every = torch.arange(V).expand(B, T, V)  # every token of the vocabulary as "the sampled token"
    s_tok, t_tok = ls.gather(-1, every), lt.gather(-1, every)
    flat = lambda x: x.reshape(B, T * V)  # noqa: E731
    m = torch.ones(B, T * V)
    adv = DISTILL_MODES.get("reverse_kl")(flat(s_tok.detach()), flat(t_tok), m).reshape(B, T, V)
    assert DISTILL_MODES.get("reverse_kl").stage == "advantage" and DISTILL_MODES.get("kl_loss").stage == "loss"
    # E_{a ~ student}[-A] is the reverse KL, and E[A grad log p_s(a)] is minus its gradient (policy gradient)
    torch.testing.assert_close(-(ps * adv).sum(-1), exact_kl.detach(), atol=1e-12, rtol=0)
    (grad_kl,) = torch.autograd.grad(exact_kl.sum(), logits, retain_graph=True)
    (grad_pg,) = torch.autograd.grad(-(ps * adv.detach() * s_tok).sum(), logits, retain_graph=True)
    torch.testing.assert_close(grad_pg, grad_kl, atol=1e-12, rtol=0)
    # kl_loss: k2's expected gradient on the student's samples is the reverse KL's; k1's expected gradient is 0;
    # k1 and k3 have the reverse KL as expected value
    for kl_type, value, grad in (("k2", None, grad_kl), ("k1", exact_kl, torch.zeros_like(grad_kl)),
                                 ("k3", exact_kl, None), ("k1+", exact_kl, grad_kl)):
        term = DISTILL_MODES.get("kl_loss")(flat(s_tok), flat(t_tok), m, kl_type=kl_type).reshape(B, T, V)
        if value is not None:
            torch.testing.assert_close((ps * term).sum(-1), value.detach(), atol=1e-12, rtol=0)
        if grad is not None:
            (got,) = torch.autograd.grad((ps * term).sum(), logits, retain_graph=True)
            torch.testing.assert_close(got, grad, atol=1e-12, rtol=0)


def test_only_model_tokens_count():
    """A multi-turn trajectory's tool tokens (mask 0) get no distillation term and do not enter the metrics."""
    s = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    t = torch.tensor([[-1.5, -0.5, -9.0, -3.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])  # positions 1-2: a tool result
    adv = DISTILL_MODES.get("reverse_kl")(s, t, mask)
    assert adv.tolist() == [[-0.5, 0.0, 0.0, 1.0]]
    loss = DISTILL_MODES.get("kl_loss")(s, t, mask, kl_type="k2")
    assert loss.tolist() == [[0.125, 0.0, 0.0, 0.5]]
    sums, top = distill_sums(s, t, mask)
    assert sums.tolist() == [0.5 + -1.0, -1.5 + -3.0, -1.0 + -4.0, 2.0] and top.tolist() == [0.5]


# ------------------------------------------------------------------------------------------------ with processes

LAYOUTS = {
    "colocate_teacher_tp2": {"placement.teacher_tp": 2, "memory.teacher_offload": '["params"]'},
    "split_dp1": {"placement.mode": "split", "placement.rollout_ranks": "[0]"},
}
SAME = ["distill/kl_mean", "distill/kl_max", "distill/teacher_logprob_mean", "distill/student_logprob_mean",
        "distill/teacher_adv_share", "train/reward_mean", "train/advantage_mean", "actor/pg_loss", "actor/grad_norm"]


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    pytest.importorskip("vllm")
    from launching import run
    from spmdrl.data.synthetic import make_arith
    from spmdrl.metrics import read_jsonl
    from spmdrl.tiny import build_tiny

    root = tmp_path_factory.mktemp("distill")
    student = build_tiny(str(root / "student"), seed=0)
    teacher = build_tiny(str(root / "teacher"), seed=1, num_layers=6)  # larger than the student
    data = make_arith(str(root / "data"), n_train=64, n_val=8, seed=0)
    out, specs = {}, []
    for name, extra in LAYOUTS.items():
        d = root / name
        d.mkdir()
        o = {
            "model.path": student, "distill.teacher_path": teacher, "distill.coef": 0.5,
            "data.train_files": f'["{data["train"]}"]', "data.max_prompt_length": 32, "data.max_response_length": 8,
            "data.train_batch_size": 4, "rollout.n": 4, "rollout.kv_cache_gb": 0.1, "rollout.per_request_seed": "true",
            "actor.lr": 1e-3, "actor.micro_batch_size": 8, "trainer.total_steps": 1, "trainer.device": "cpu",
            "trainer.output_dir": str(d), "logging.progress": "false", "logging.tensorboard": "false",
            "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
            "hooks.files": f'["{os.path.join(HERE, "dist_scripts", "dump_hook.py")}"]', **extra,
        }
        specs.append({"overrides": [f"{k}={v}" for k, v in o.items()], "env": {"SPMDRL_TEST_DUMP": str(d)}})
    (root / "runs.json").write_text(json.dumps(specs))  # both layouts in one launch (dist_scripts/train_runs.py)
    proc = run([os.path.join(HERE, "dist_scripts", "train_runs.py"), str(root / "runs.json")], nproc=2, timeout=900)
    for name in LAYOUTS:
        d = root / name
        assert (d / "rc").read_text() == "0", proc.stdout[-3000:] + proc.stderr[-6000:]
        (metrics,) = read_jsonl(str(d / "metrics.jsonl"))
        ranks = [1] if name.startswith("split") else [0, 1]
        out[name] = metrics, _global([torch.load(d / f"batch_rank{r}.pt", weights_only=True) for r in ranks])
    return student, teacher, out


def _global(batches):
    res = {}
    for k in batches[0]:
        parts = [b[k] for b in batches]
        if parts[0].dim() == 2:
            w = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, w - p.shape[1])) for p in parts]
        res[k] = torch.cat(parts)
    return res


def _logprobs64(path, b):
    """log p(response token) of every sample from an HF float64 forward: the full log-softmax, gathered."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64)
    out = torch.zeros(b["responses"].shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(len(b["responses"])):
            p, r = int(b["prompt_len"][i]), int(b["response_len"][i])
            ids = torch.cat([b["prompts"][i, :p], b["responses"][i, :r]])[None]
            lsm = torch.log_softmax(model(input_ids=ids).logits[0, p - 1: p - 1 + r], -1)
            out[i, :r] = lsm.gather(-1, b["responses"][i, :r, None]).squeeze(-1)
    return out


@pytest.mark.dist
def test_step_matches_float64_reference(steps):
    student, teacher, out = steps
    m, b = out["colocate_teacher_tp2"]
    mask = b["response_mask"].double()
    s64, t64 = _logprobs64(student, b) * mask, _logprobs64(teacher, b) * mask
    torch.testing.assert_close(b["old_log_probs"].double() * mask, s64, atol=2e-5, rtol=0)
    torch.testing.assert_close(b["teacher_log_probs"].double() * mask, t64, atol=2e-5, rtol=0)
    # GRPO's advantage of each group (written out) plus coef x (log p_teacher - log p_student), model tokens only
    scores = b["scores"].double()
    grpo = torch.zeros_like(scores)
    for u in b["uid"].unique():
        g = b["uid"] == u
        grpo[g] = (scores[g] - scores[g].mean()) / (scores[g].std() + 1e-6)
    task = grpo[:, None] * mask
    term = 0.5 * (t64 - s64) * mask
    torch.testing.assert_close(b["advantages"].double() * mask, task + term, atol=2e-5, rtol=0)
    n = mask.sum()
    assert task.abs().sum() > 0 and term.abs().sum() > 0  # both sources are at work
    assert m["distill/kl_mean"] == pytest.approx(float(((s64 - t64) * mask).sum() / n), abs=2e-6)
    assert m["distill/kl_max"] == pytest.approx(float((s64 - t64)[mask > 0].max()), abs=2e-5)
    assert m["distill/teacher_logprob_mean"] == pytest.approx(float(t64.sum() / n), abs=2e-6)
    share = term.abs().sum() / (task.abs().sum() + term.abs().sum())
    assert m["distill/teacher_adv_share"] == pytest.approx(float(share), abs=2e-6)
    # one mini-batch, first pass: ratio 1, so the policy loss is -mean(advantage) over the global batch's tokens
    assert m["actor/pg_loss"] == pytest.approx(float(-(task + term).sum() / n), abs=2e-6)
    assert m["timing/teacher_logprob_s"] > 0 and m["actor/grad_norm"] > 0


@pytest.mark.dist
def test_layouts_give_the_same_step(steps):
    _, _, out = steps
    (ref, rb), (got, gb) = out["colocate_teacher_tp2"], out["split_dp1"]
    assert torch.equal(rb["responses"], gb["responses"])  # the same samples (per-request seeds)
    for k in SAME:
        assert got[k] == pytest.approx(ref[k], abs=2e-6, rel=1e-5), k


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from spmdrl.tiny import build_tiny

    root = tmp_path_factory.mktemp("distill_bad")
    student = build_tiny(str(root / "student"), seed=0)
    other = build_tiny(str(root / "other_family"), seed=1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<think>"])  # one token more: another vocabulary
    tok.save_pretrained(other)
    # the student's tokenizer and vocabulary, an embedding of fewer rows than the student's 320 (ids 259..319 unused
    # by the tokenizer, but the student can sample them): it passed every check and died in teacher_logprob
    build_tiny(str(root / "small_embedding"), seed=2, vocab_size=len(tok) - 1)
    return student, other, root


@pytest.mark.parametrize("case", ["vocabulary", "missing", "layout", "embedding"])
def test_bad_teacher_is_one_line_before_launch(tiny, tmp_path, case):
    from test_cli import GRPO, assert_user_error, run as cli

    student, other, root = tiny
    teacher, extra, needle = {
        "vocabulary": (other, [], "vocabulary differs"),
        "missing": (str(root / "no_such_teacher"), [], "no such directory"),
        "layout": (student, ["placement.teacher_tp=3"], "teacher has 8 ranks"),
        "embedding": (str(root / "small_embedding"), [], "the teacher's embedding has 259 rows (vocab_size in its "
                      "config.json) and the student"),
    }[case]
    assert_user_error(cli("train", "--config", GRPO, "--dry-run", "--nproc", 8, f"model.path={student}",
                          f"trainer.output_dir={tmp_path}", "data.max_prompt_length=256", "data.max_response_length=256",
                          f"distill.teacher_path={teacher}", *extra), "distill.teacher_path" if case != "layout"
                      else "placement", needle)


def test_plan_has_the_teacher_forward_and_its_memory():
    """`spmdrl plan` (no GPU, no weights): the teacher's mesh at its own tp, its forward phase, and its weights on
    the GPU only in that phase when memory.teacher_offload parks them."""
    from spmdrl.config import load_config
    from spmdrl.plan import build_plan

    cfg = load_config(os.path.join(os.path.dirname(HERE), "configs", "grpo.toml"), [
        "model.path=Qwen/Qwen2.5-0.5B-Instruct", "distill.teacher_path=Qwen/Qwen2.5-1.5B-Instruct",
        "placement.teacher_tp=2", 'memory.teacher_offload=["params"]'])
    p = build_plan(cfg)
    assert (p["roles"]["teacher"]["tp"], p["roles"]["teacher"]["dp"]) == (2, 4)
    phases = p["memory"]
    assert "teacher_params" in phases["teacher_forward"]["gpu"] and "teacher_activations" in phases["teacher_forward"]["gpu"]
    assert "teacher_params" not in phases["train_actor"]["gpu"] and "teacher_params" in phases["train_actor"]["host_per_rank"]
    # 1.54B parameters over tp 2 x dp 4 in bf16: about 0.36 GiB per rank
    assert 0.3 < phases["teacher_forward"]["gpu"]["teacher_params"] < 0.45
