"""Model coverage: the parity check in the Trainer and the sweep over architectures, with real vLLM (rollout TP 2)
and 2 gloo ranks; the in-process engine leaving transformers' classes alone; docs/models.md's generated table.

The suite runs one architecture per behaviour in one shared sweep job (`spmdrl model sweep` runs them all):
  cohere         its logits are scaled by logit_scale, which spmdrl's fused head does not compute: the parity
                 check switches the actor to the model's own head and it trains (gap < 1e-5 after a sync);
  cohere@fused   the same with model.logprob_head = "fused" (a planted mismatch no switch may fix): refused
                 before step 1 in one line;
  gpt_oss        the weight sync misreads its fused expert tensors: agreement before the sync, not after, so the
                 check refuses it before step 1 naming the sync;
  mamba2         transformers cannot build its scaled-down config: unbuildable, with the reason.
"""
import json
import os
import re

import pytest

pytest.importorskip("vllm")

from launching import REPO, run  # noqa: E402

pytestmark = pytest.mark.dist

CASES = ["cohere", "cohere@model.logprob_head=fused", "gpt_oss", "mamba2"]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    from spmdrl.model_sweep import sweep

    root = tmp_path_factory.mktemp("sweep")
    cwd = os.getcwd()
    os.chdir(REPO)  # the sweep's default config path is relative to the repository
    try:
        return {r["arch"]: r for r in sweep(str(root), CASES)}, root
    finally:
        os.chdir(cwd)


def test_a_scaled_head_switches_to_the_models_own_and_trains(swept):
    results, root = swept
    r = results["cohere"]
    assert r["verdict"] == "trains", r
    assert r["compute"] == ["spmdrl", "model"]
    assert r["rollout/logprob_diff_max"] < 1e-5
    assert r["weight_sync/bytes_recv_max"] == r["weight_sync/bytes_lower_bound"]
    rows = [json.loads(line) for line in open(os.path.join(root, "runs", "cohere", "metrics.jsonl"))]
    parity = next(row for row in rows if row.get("step") == 1)  # the check's figures ride on the first step's row
    assert max(parity["parity/actor_vs_rollout"], parity["parity/model_vs_rollout"],
               parity["parity/actor_vs_model"]) < 1e-5  # after the switch, and after one sync
    log = open(os.path.join(root, "job.log")).read()
    assert re.search(r"parity check: spmdrl's fused log-prob head does not compute what CohereForCausalLM .* "
                     r"\(actor vs rollout: 1\.\d+ nats at sample", log), "the switch is said in one line"


def test_a_planted_mismatch_is_refused_before_step_1(swept):
    results, root = swept
    r = results["cohere@model.logprob_head=fused"]
    assert r["verdict"] == "refused", r
    assert "parity check: the actor's log-probs differ from the rollout engine's by up to" in r["why"]
    assert "CohereForCausalLM" in r["why"] and "model.logprob_head = 'auto'" in r["why"]
    run_dir = os.path.join(root, "runs", "cohere+model.logprob_head-fused")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    steps = [json.loads(line).get("step") for line in open(metrics)] if os.path.isfile(metrics) else []
    assert not [s for s in steps if s and s > 0]  # nothing trained


def test_a_sync_that_misplaces_weights_is_refused_before_step_1(swept):
    r = swept[0]["gpt_oss"]
    assert r["verdict"] == "refused", r
    assert "after the weight sync" in r["why"] and "while before it they agreed" in r["why"]


def test_an_architecture_transformers_cannot_build_tiny_is_named(swept):
    r = swept[0]["mamba2"]
    assert r["verdict"] == "unbuildable" and r["why"]


def test_the_vllm_engine_leaves_transformers_classes_unchanged(tmp_path):
    """vLLM 0.32 serves OLMo 2 through its Transformers modeling backend, whose compile decorator changes the
    decoder class in place: a model built before the engine crashed at its next forward (no `do_not_compile`),
    one built after ran vLLM's __init__. With the engine built, the class's own attributes and bases are
    exactly as before, both models forward bitwise as before, and vLLM's log-probs still equal transformers'."""
    from spmdrl.tiny import build_any

    model = build_any(str(tmp_path / "olmo2"), "olmo2")
    run([os.path.join(REPO, "tests", "dist_scripts", "vllm_keeps_classes.py"), model, str(tmp_path)], nproc=None,
        timeout=300)
    result = json.load(open(tmp_path / "result.json"))
    assert result["served"] == "TransformersForCausalLM", result  # the path whose decorator changes classes
    # vLLM's own decoder instance runs a private copy of the class that carries the decorator
    assert result["decorated_copy"] == ["transformers.models.olmo2.modeling_olmo2.Olmo2Model"], result
    assert result["bases_kept"] and result["changed"] == [], result
    assert result.get("before_diff") == 0.0, result
    assert result["after_diff"] == 0.0 and result["after_type"].startswith("transformers."), result
    assert result["vllm_diff"] < 1e-5, result


def test_docs_coverage_table_is_the_sweeps_over_every_architecture():
    """docs/models.md's table is generated (spmdrl model sweep --docs docs/models.md): one row per architecture
    both libraries register, a known verdict each, and the counts line adds up."""
    from spmdrl.model_sweep import BEGIN, END, VERDICTS, architectures

    doc = open(os.path.join(REPO, "docs", "models.md")).read()
    block = doc.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = re.findall(r"^\| ([\w.-]+) \| (\w+) \|", block, re.M)
    rows = [(a, v) for a, v in rows if a != "model"]
    assert sorted(a for a, _ in rows) == sorted(architectures())
    assert {v for _, v in rows} <= set(VERDICTS)
    head = block.strip().split("\n\n")[0]
    assert head.startswith(f"{len(rows)} architectures: ")
    counts = {v: int(n) for n, v in re.findall(r"(\d+) (" + "|".join(VERDICTS) + r")\b", head)}
    assert sum(counts.values()) == len(rows)
    for verdict, n in counts.items():
        assert sum(v == verdict for _, v in rows) == n
