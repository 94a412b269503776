"""User hooks (spmdrl.hooks, docs/hooks.md): loading, the context, the contract checks, the example hooks in
configs/hooks/, and one real 2-process run in which the examples shape, filter and measure a step and a hook
that raises on one rank stops the run with its name and stage."""
import os
import re
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from spmdrl.batch import Batch
from spmdrl.errors import ConfigError, HookError
from spmdrl.hooks import STAGES, HookContext, HookRunner, hook

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXAMPLES = os.path.join(REPO, "configs", "hooks")
SCRIPTS = os.path.join(HERE, "dist_scripts")


def write(path, body: str) -> str:
    path.write_text(textwrap.dedent(body))
    return str(path)


def ctx_for(stage: str, batch: Batch, **kw) -> HookContext:
    config = SimpleNamespace(data=SimpleNamespace(max_response_length=8))
    return HookContext(stage, 3, config, batch, mesh=None, **kw)


def toy_batch() -> Batch:
    """Two prompts (dataset rows 7 and 9) x 3 samples, prompt-major, as the trainer builds it."""
    texts = ["46", "4 6", "46", "12", "12", "x"]
    B, R = len(texts), 8
    lens = torch.tensor([2, 3, 2, 8, 2, 8])
    return Batch(
        {"responses": torch.zeros(B, R, dtype=torch.long), "response_len": lens,
         "response_mask": (torch.arange(R)[None] < lens[:, None]).float(),
         "index": torch.tensor([7, 7, 7, 9, 9, 9]), "truncated": (lens == 8).float(),
         "scores": torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.5]), "advantages": torch.zeros(B, R)},
        {"response_text": texts, "data_source": ["synthetic/arith"] * B},
    )


# ---- loading --------------------------------------------------------------------------------------------

def test_register_from_file_in_file_then_definition_order(tmp_path):
    a = write(tmp_path / "a.py", """
        from spmdrl.hooks import hook

        @hook("after_reward")
        def first(ctx): ctx.log("order/first", 1)

        @hook("after_step")
        def metric(ctx): pass

        @hook("after_reward")
        def second(ctx): ctx.log("order/second", len(ctx.metrics))
    """)
    b = write(tmp_path / "b.py", """
        from spmdrl.hooks import hook

        @hook("after_reward")
        def third(ctx): ctx.log("order/third", len(ctx.metrics))
    """)
    runner = HookRunner([a, b])
    assert [f.__name__ for f in runner.by_stage["after_reward"]] == ["first", "second", "third"]
    assert [f.__name__ for f in runner.by_stage["after_step"]] == ["metric"]
    assert not runner.by_stage["after_rollout"] and bool(runner)
    assert runner.run("after_reward", ctx_for("after_reward", toy_batch())) == {
        "order/first": 1.0, "order/second": 1.0, "order/third": 2.0}
    assert not HookRunner([])


@pytest.mark.quick
def test_register_from_module_twice_in_one_process(tmp_path, monkeypatch):
    write(tmp_path / "spmdrl_test_hooks_mod.py", """
        from spmdrl.hooks import hook

        @hook("on_validation")
        def val_metric(ctx): ctx.log("custom/n", len(ctx.batch))
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for _ in range(2):  # already imported the second time (as when it also holds the reward fn): still registers
            runner = HookRunner(["spmdrl_test_hooks_mod"])
            assert [f.__name__ for f in runner.by_stage["on_validation"]] == ["val_metric"]
            assert runner.run("on_validation", ctx_for("on_validation", toy_batch())) == {"custom/n": 6.0}
    finally:
        sys.modules.pop("spmdrl_test_hooks_mod", None)


@pytest.mark.quick
def test_unknown_stage_names_it_and_the_stages(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="unknown hook stage 'after_rollot'.*after_rollout, after_reward"):
        hook("after_rollot")
    bad = write(tmp_path / "bad.py", """
        from spmdrl.hooks import hook

        @hook("after_rewards")
        def f(ctx): pass
    """)
    with pytest.raises(ConfigError, match=r"bad\.py.*unknown hook stage 'after_rewards'"):
        HookRunner([bad])
    monkeypatch.syspath_prepend(str(tmp_path))
    try:  # the same from a module: still a one-line ConfigError naming the module
        with pytest.raises(ConfigError, match="importing 'bad' failed: ConfigError: unknown hook stage 'after_rewards'"):
            HookRunner(["bad"])
    finally:
        sys.modules.pop("bad", None)


@pytest.mark.quick
def test_file_that_registers_nothing_or_is_missing(tmp_path):
    empty = write(tmp_path / "empty.py", "def not_a_hook(ctx):\n    pass\n")
    with pytest.raises(ConfigError, match=r"empty\.py' registers no hooks"):
        HookRunner([empty])
    with pytest.raises(ConfigError, match="is not a file"):
        HookRunner([str(tmp_path / "missing.py")])
    with pytest.raises(ConfigError, match="cannot import module 'spmdrl_no_such_hooks'"):
        HookRunner(["spmdrl_no_such_hooks"])
    broken = write(tmp_path / "broken.py", "import spmdrl_no_such_dependency\n")
    with pytest.raises(ConfigError, match=r"importing .*broken\.py' failed: ModuleNotFoundError"):
        HookRunner([broken])


def test_raising_hook_names_function_and_stage_in_one_line(tmp_path):
    path = write(tmp_path / "boom.py", """
        from spmdrl.hooks import hook

        @hook("after_advantage")
        def boom(ctx):
            raise KeyError("no such column\\nin the batch")
    """)
    runner = HookRunner([path])
    with pytest.raises(HookError) as err:
        runner.run("after_advantage", ctx_for("after_advantage", toy_batch()))
    msg = str(err.value)
    assert f"hook {path}:boom failed at stage after_advantage (step 3): KeyError" in msg
    assert "no such column" in msg and "\n" not in msg


# ---- the context --------------------------------------------------------------------------------------

def test_decode_responses_and_prompts():
    from spmdrl.tiny import build_tokenizer

    tok = build_tokenizer()
    prompts, responses = ["12+34=", "5+6="], ["46", "11<|im_end|>"]
    p_ids = [tok.encode(t) for t in prompts]
    r_ids = [tok.encode(t) for t in responses]
    pad = tok.pad_token_id
    P, R = max(map(len, p_ids)), max(map(len, r_ids))
    batch = Batch({
        "prompts": torch.tensor([x + [pad] * (P - len(x)) for x in p_ids]),
        "prompt_len": torch.tensor([len(x) for x in p_ids]),
        "responses": torch.tensor([x + [pad] * (R - len(x)) for x in r_ids]),
        "response_len": torch.tensor([len(x) for x in r_ids]),
    })
    ctx = ctx_for("after_rollout", batch, tokenizer=tok)
    assert ctx.decode() == ["46", "11"]  # padding and special tokens removed
    assert ctx.decode("prompts") == prompts
    with pytest.raises(ValueError, match="only 'responses' and 'prompts'"):
        ctx.decode("response_mask")


def test_keep_filters_tensors_and_meta_in_place():
    batch = toy_batch()
    tensors_before = batch.tensors
    ctx = ctx_for("after_reward", batch)
    ctx.keep(batch["truncated"] == 0)
    assert ctx.batch is batch and len(batch) == 4 and batch.tensors is not tensors_before
    assert batch["index"].tolist() == [7, 7, 7, 9] and batch.meta["response_text"] == ["46", "4 6", "46", "12"]
    assert batch["responses"].shape == (4, 8)
    ctx.keep([0, 3])  # row indices work too
    assert batch.meta["response_text"] == ["46", "12"] and batch["scores"].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="bool mask"):
        ctx.keep(torch.ones(2))
    with pytest.raises(ValueError, match="mask has shape \\[3\\], the batch has 2"):
        ctx.keep(torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("stage", [s for s in STAGES if s not in ("after_rollout", "after_reward")])
def test_dropping_samples_after_reward_is_refused(tmp_path, stage):
    path = write(tmp_path / "late.py", f"""
        from spmdrl.hooks import hook

        @hook("{stage}")
        def late_filter(ctx):
            ctx.keep(ctx.batch["truncated"] == 0)
    """)
    with pytest.raises(HookError, match=f"late_filter failed at stage {stage} .*ctx.keep is allowed at after_rollout "
                                        f"and after_reward only"):
        HookRunner([path]).run(stage, ctx_for(stage, toy_batch()))


@pytest.mark.parametrize("body, stage, problem", [
    ("ctx.batch = ctx.batch.select([0, 1])", "after_reward", "replaced ctx.batch, which the trainer never sees"),
    ("ctx.batch['advantages'] = ctx.batch['advantages'][:, :4]", "after_advantage",
     r"changed the shape of 'advantages' from \[6, 8\] to \[6, 4\]"),
    ("del ctx.batch.tensors['scores']", "before_update", "removed tensor 'scores'"),
    ("ctx.batch.tensors['scores'] = ctx.batch['scores'][:3]", "after_reward",
     "left 'scores' with 3 rows while the batch has 6"),
    ("ctx.batch.meta['response_text'].pop()", "after_rollout", "left 'response_text' with 5 rows"),
    ("ctx.batch.meta['note'] = 'x'", "after_reward", "left 'note' with 1 rows"),
    ("ctx.batch.tensors = {k: v[:3] for k, v in ctx.batch.tensors.items()}", "after_step",
     "changed the number of samples from 6 to 3"),
])
def test_contract_violations_name_the_hook(tmp_path, body, stage, problem):
    path = write(tmp_path / "rude.py", f"""
        from spmdrl.hooks import hook

        @hook("{stage}")
        def rude(ctx):
            {body}
    """)
    with pytest.raises(HookError, match=f"hook .*rude.py:rude at stage {stage} \\(step 3\\) {problem}"):
        HookRunner([path]).run(stage, ctx_for(stage, toy_batch()))


def test_changing_values_and_adding_tensors_is_allowed(tmp_path):
    path = write(tmp_path / "ok.py", """
        import torch
        from spmdrl.hooks import hook

        @hook("after_advantage")
        def clip(ctx):
            ctx.batch["advantages"] = ctx.batch["advantages"].clamp(-1, 1) + 0.5 * ctx.batch["response_mask"]
            ctx.batch["my_flag"] = torch.ones(len(ctx.batch))
            ctx.batch.meta["note"] = ["x"] * len(ctx.batch)
    """)
    batch = toy_batch()
    HookRunner([path]).run("after_advantage", ctx_for("after_advantage", batch))
    assert torch.equal(batch["advantages"], 0.5 * batch["response_mask"]) and "my_flag" in batch


# ---- the examples in configs/hooks, on a hand-made batch ---------------------------------------------------

def test_example_reward_shaping():
    batch = toy_batch()
    ctx = ctx_for("after_reward", batch)
    metrics = HookRunner([os.path.join(EXAMPLES, "reward_shaping.py")]).run("after_reward", ctx)
    bare = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0])  # "4 6" and "x" are not bare integers
    delta = 0.1 * bare - 0.05 * batch["response_len"].float() / 8
    torch.testing.assert_close(batch["scores"], torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.5]) + delta)
    assert metrics["shaping/format_bonus_frac"] == pytest.approx(4 / 6)
    assert metrics["shaping/delta_mean"] == pytest.approx(float(delta.mean()))


def test_example_sample_filter():
    runner = HookRunner([os.path.join(EXAMPLES, "sample_filter.py")])
    batch = toy_batch()
    m = runner.run("after_rollout", ctx_for("after_rollout", batch))
    assert batch["index"].tolist() == [7, 7, 7, 9] and m["filter/truncated_frac"] == pytest.approx(2 / 6)
    m = runner.run("after_reward", ctx_for("after_reward", batch))
    # row 7 scores 1, 0, 1: informative; row 9 has one sample left: a group of one is uniform
    assert batch["index"].tolist() == [7, 7, 7] and batch.meta["response_text"] == ["46", "4 6", "46"]
    assert m["filter/uniform_frac"] == pytest.approx(1 / 4)


@pytest.mark.quick
def test_example_custom_metric():
    runner = HookRunner([os.path.join(EXAMPLES, "custom_metric.py")])
    assert runner.run("after_step", ctx_for("after_step", toy_batch())) == {"custom/digits_only_frac": 4 / 6}
    assert runner.run("on_validation", ctx_for("on_validation", toy_batch())) == {"custom/val_digits_only_frac": 4 / 6}


# ---- a real run: 2 ranks, torchrun, vLLM, FSDP2 ---------------------------------------------------------

def rule_score(text: str) -> float:  # tests/dist_scripts/reward_len.py
    return float(len(text) % 3) / 2.0


def bare_int(text: str) -> bool:
    return re.fullmatch(r"-?\d+", text.strip()) is not None


@pytest.fixture(scope="module")
def hooked_run(tmp_path_factory):
    """One launch for every check: step 1 runs the three examples (and the probe that dumps the batch), step 2
    hits a hook that raises on rank 1 only. Stop tokens on 32 byte values make about half the tiny model's
    responses finish before max_response_length, so the truncation filter has something to keep."""
    pytest.importorskip("vllm")
    from launching import run
    from spmdrl.data.synthetic import make_arith
    from spmdrl.metrics import read_jsonl
    from spmdrl.tiny import build_tiny

    root = tmp_path_factory.mktemp("hooks")
    out = root / "out"
    out.mkdir()
    model, data = build_tiny(str(root / "model"), seed=0), make_arith(str(root / "data"), n_train=64, n_val=4, seed=0)
    files = [os.path.join(SCRIPTS, "hook_probe.py"), *(os.path.join(EXAMPLES, f"{n}.py") for n in
             ("reward_shaping", "sample_filter", "custom_metric")), os.path.join(SCRIPTS, "hook_fail.py")]
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.val_files": f'["{data["val"]}"]',
        "data.max_prompt_length": 32, "data.max_response_length": 8, "data.train_batch_size": 8, "rollout.n": 4,
        "rollout.kv_cache_gb": 0.1, "rollout.stop_token_ids": f"[{','.join(map(str, range(3, 35)))}]",
        "actor.micro_batch_size": 16, "trainer.total_steps": 2, "trainer.test_freq": 1,
        "trainer.val_before_train": "false", "trainer.device": "cpu", "trainer.dist_timeout_s": 60,
        "trainer.output_dir": str(out), "checkpoint.save_freq": -1, "logging.progress": "false",
        "logging.tensorboard": "false", "reward.custom_fn": os.path.join(SCRIPTS, "reward_len.py") + ":score",
        "hooks.files": "[" + ",".join(f'"{f}"' for f in files) + "]",
    }
    os.environ["SPMDRL_TEST_DUMP"] = str(out)
    try:
        args = ["spmdrl.train", *[f"{k}={v}" for k, v in o.items()]]
        proc = run(args, nproc=2, module=True, timeout=400, check=False)
    finally:
        del os.environ["SPMDRL_TEST_DUMP"]

    def load(name):
        return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)]

    metrics = read_jsonl(str(out / "metrics.jsonl")) if (out / "metrics.jsonl").exists() else []
    dumps = {n: load(n) for n in ("rollout", "update", "val") if (out / f"{n}_rank0.pt").exists()}
    return SimpleNamespace(proc=proc, metrics=metrics, dumps=dumps)


def expected_after_hooks(pre: dict) -> tuple[list[int], list[float], dict]:
    """What docs/hooks.md says the examples do to one rank's batch: drop truncated samples (after_rollout),
    shape the rule score (after_reward), drop uniform groups (after_reward). Returns index, scores, means."""
    t, meta = pre["tensors"], pre["meta"]
    rows = [i for i in range(len(t["index"])) if t["truncated"][i] == 0]
    texts = [meta["response_text"][i] for i in rows]
    delta = [0.1 * bare_int(x) - 0.05 * int(t["response_len"][i]) / 8 for i, x in zip(rows, texts)]
    scores = [rule_score(x) + d for x, d in zip(texts, delta)]
    index = [int(t["index"][i]) for i in rows]
    groups = {g: [s for s, h in zip(scores, index) if h == g] for g in set(index)}
    keep = [max(groups[g]) > min(groups[g]) for g in index]
    means = {"truncated_frac": 1 - len(rows) / len(t["index"]), "delta_mean": sum(delta) / len(delta),
             "uniform_frac": 1 - sum(keep) / len(keep)}
    return [g for g, k in zip(index, keep) if k], [s for s, k in zip(scores, keep) if k], means


@pytest.mark.dist
def test_examples_shape_filter_and_measure_a_real_step(hooked_run):
    assert hooked_run.metrics, hooked_run.proc.stdout[-3000:] + hooked_run.proc.stderr[-5000:]
    (m,) = hooked_run.metrics  # step 1; step 2 failed in a hook
    pre, post = hooked_run.dumps["rollout"], hooked_run.dumps["update"]
    expected = [expected_after_hooks(p) for p in pre]
    n = min(len(idx) for idx, _, _ in expected)  # the trainer trims every rank to the smallest count
    assert 0 < n < len(pre[0]["tensors"]["index"]), "the filter dropped nothing (or everything): change the stop tokens"
    for (idx, scores, _), b in zip(expected, post):
        t = b["tensors"]
        assert t["index"].tolist() == idx[:n] and t["truncated"].sum() == 0
        torch.testing.assert_close(t["scores"], torch.tensor(scores[:n]), atol=1e-6, rtol=1e-6)
        # the shaped score is what the estimator saw: token_level_scores are rebuilt from it after the hooks
        torch.testing.assert_close(t["token_level_scores"].sum(-1), t["scores"], atol=1e-6, rtol=1e-6)
        assert all(len(v) == n for v in b["meta"].values()) and len(t["advantages"]) == n
    for key in ("truncated_frac", "delta_mean", "uniform_frac"):  # ctx.log values: averaged over the ranks
        name = ("shaping/" if key == "delta_mean" else "filter/") + key
        assert m[name] == pytest.approx(sum(e[2][key] for e in expected) / 2, abs=1e-6), name

    def digits_frac(dump):
        texts = dump["meta"]["response_text"]
        return sum(re.fullmatch(r"[0-9]+", x.strip()) is not None for x in texts) / len(texts)

    assert m["custom/digits_only_frac"] == pytest.approx(sum(map(digits_frac, post)) / 2)
    assert m["custom/val_digits_only_frac"] == pytest.approx(sum(map(digits_frac, hooked_run.dumps["val"])) / 2)
    assert "val/accuracy" in m and m["actor/grad_norm"] > 0


@pytest.mark.quick
@pytest.mark.dist
def test_a_raising_hook_stops_the_run_naming_it(hooked_run):
    proc = hooked_run.proc
    assert proc.returncode != 0
    line = next((x for x in proc.stderr.splitlines() if x.startswith("error (rank 1)")), None)
    assert line is not None, proc.stderr[-5000:]
    hook_py = os.path.join(SCRIPTS, "hook_fail.py")
    assert f"hook {hook_py}:explode failed at stage after_reward (step 2): " in line
    assert line.endswith("RuntimeError: hook failure on purpose second line")  # one line


@pytest.mark.dist
def test_validation_accuracy_stays_the_rule_score_beside_a_custom_reward(hooked_run):
    """reward.custom_fn (reward_len: partial credit by length) gives the training reward; validation still
    reports the rule scorer of the data_source (synthetic/arith) as val/accuracy and the custom mean apart."""
    from spmdrl.rewards.arith import arith_reward

    (m,) = hooked_run.metrics
    val = [(t, g) for d in hooked_run.dumps["val"] for t, g in zip(d["meta"]["response_text"], d["meta"]["ground_truth"])]
    rule = [arith_reward(t, g) for t, g in val]
    custom = [rule_score(t) for t, _ in val]
    assert sum(rule) / len(val) != sum(custom) / len(val)  # the two would be told apart
    assert m["val/accuracy"] == pytest.approx(sum(rule) / len(val))
    assert m["val/source_accuracy/synthetic/arith"] == m["val/accuracy"]
    assert m["val/reward_mean"] == pytest.approx(sum(custom) / len(val))
    for d in hooked_run.dumps["val"]:  # what on_validation hooks see
        assert d["tensors"]["accuracy"].tolist() == [arith_reward(t, g) for t, g in
                                                     zip(d["meta"]["response_text"], d["meta"]["ground_truth"])]


@pytest.mark.quick
def test_docs_batch_key_table_is_generated_from_batch_keys():
    """docs/hooks.md's "What the batch holds" is spmdrl.batch.BATCH_KEYS rendered, and the table's after_rollout
    tensors are what a rollout batch carries (spmdrl.loop.split.ROLLOUT_KEYS; weight_version is split-only,
    baseline_rewards ReMax-only, routed_experts with routing replay only)."""
    from spmdrl.batch import BATCH_KEYS, batch_key_table
    from spmdrl.loop.split import ROLLOUT_KEYS

    docs = open(os.path.join(REPO, "docs", "hooks.md")).read()
    assert batch_key_table() in docs, ("docs/hooks.md's batch table is stale; paste spmdrl.batch.batch_key_table() "
                                       "under its generated-from comment")
    rollout = {name for name, _, stage, _ in BATCH_KEYS if stage == "after_rollout"}
    assert rollout - {"baseline_rewards", "routed_experts", "versions"} == set(ROLLOUT_KEYS) - {"weight_version"}
