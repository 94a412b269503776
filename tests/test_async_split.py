"""Asynchronous split placement (rollout.partial with placement.mode = "split"): 4 gloo ranks, vLLM TP=2 on ranks 0-1,
FSDP2 dp=2 on ranks 2-3, GRPO, rollout.partial = recompute, trainer.max_staleness 2. Responses end at any of 24 stop
tokens, so their lengths vary and groups carry over weight updates. Two runs of one config, shared by the tests
below: one straight, one killed (rank 0, a rollout rank, at the start of step 3: requests in flight on the rollout
ranks, a batch posted ahead on the training ranks) and resumed from its checkpoint after step 2. The rollout ranks
stream each batch's groups as they complete (several posts per batch)."""
import os
import types

import pytest

pytest.importorskip("vllm")

from launching import free_port  # noqa: E402
from spmdrl.data.synthetic import make_arith  # noqa: E402
from spmdrl.metrics import read_jsonl  # noqa: E402
from spmdrl.tiny import build_tiny  # noqa: E402
from test_split import comparable, overrides, shm_segments, train, versions  # noqa: E402

pytestmark = pytest.mark.dist
STEPS, K = 4, 2
ASYNC = {
    "placement.mode": "split", "placement.rollout_ranks": "[0,1]", "placement.rollout_tp": 2,
    "rollout.partial": "recompute", "rollout.oversample": 1.0, "trainer.max_staleness": K,
    "trainer.total_steps": STEPS, "data.max_response_length": 16, "actor.ppo_mini_batch_size": 4,
    "rollout.stop_token_ids": "[" + ",".join(str(i) for i in range(40, 64)) + "]",
    "rollout.parity_check": "false", "checkpoint.save_freq": 1, "checkpoint.keep_last": 0,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("async_split")
    model = build_tiny(str(root / "model"), seed=0)
    data = make_arith(str(root / "data"), n_train=64, n_val=16, seed=0)
    ports: list[int] = []
    while len(ports) < 3:
        ports += [p for p in [free_port()] if p not in ports]
    outs = [root / "a", root / "b"]
    try:
        train(outs[0], 4, overrides(model, data, outs[0], **ASYNC), mp, port=ports[0])
        mp.setenv("SPMDRL_FAULT_INJECT", "kill:rank=0:step=3")
        killed = train(outs[1], 4, overrides(model, data, outs[1], **ASYNC), mp, port=ports[1], check=False)
        assert killed.returncode != 0 and "rank 0 exits in step 3" in killed.stderr, killed.stderr[-3000:]
        mp.delenv("SPMDRL_FAULT_INJECT")
        train(outs[1], 4, overrides(model, data, outs[1], **ASYNC), mp, port=ports[2])
    finally:
        mp.undo()
        for p in ports:
            for name in shm_segments(p):
                os.unlink(os.path.join("/dev/shm", name))
    return types.SimpleNamespace(model=model, a=outs[0], b=outs[1])


def token_versions(out, rank):
    """Per step: every trained token's (sample, position, version, rollout log-prob) on training rank `rank`."""
    got = {}
    for step, rec in versions(out, rank).items():
        b = rec["all"]
        got[step] = [(i, t, b["versions"][i][t], b["rollout_log_probs"][i][t])
                     for i in range(len(b["uid"])) for t in range(b["response_len"][i])]
    return got


def test_async_split_trains_on_tokens_of_several_versions_within_the_staleness_bound(runs):
    rows = read_jsonl(str(runs.a / "metrics.jsonl"), last_per_step=True)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    mixed = 0
    for rank in (2, 3):
        for step, toks in token_versions(runs.a, rank).items():
            trained_by = step - 1  # the actor version before the update of this step
            lags = {trained_by - v for _, _, v, _ in toks}
            assert min(lags) >= 0 and max(lags) <= K, (step, lags)
            per_sample = {}
            for i, _, v, _ in toks:
                per_sample.setdefault(i, set()).add(v)
            mixed += sum(len(vs) > 1 for vs in per_sample.values())  # one request sampled by two versions
    assert mixed > 0
    for r in rows[1:]:
        assert 0 <= r["rollout/version_lag_min"] <= r["rollout/version_lag_mean"] <= r["rollout/version_lag_max"] <= K
        assert r["actor/grad_norm"] > 0 and 0 <= r["perf/rollout_busy"] <= 1 and 0 < r["perf/train_busy"] <= 1
        assert r["perf/rollout_busy"] > 0 or r["step"] == STEPS  # the last step generates nothing
        assert r["perf/trained_tokens_per_s"] > 0
    assert max(r["rollout/version_lag_max"] for r in rows[1:]) == K  # the bound is reached, and kept
    assert any(r["rollout/requests_carried_over"] > 0 for r in rows[1:])
    # groups are streamed as they complete: batches go out in several posts, groups before the engine step that
    # completes their batch, and a training rank takes its share in several messages (counted where received; a
    # batch whose groups were all held complete from the step before goes out in one post)
    assert sum(r["rollout/stream_sends"] for r in rows[1:STEPS]) > STEPS  # batches 1-4, generated in steps 1-3
    assert max(r["rollout/groups_streamed_early"] for r in rows[1:STEPS]) > 0
    assert max(r["rollout/stream_lead_steps"] for r in rows[1:STEPS]) > 0
    assert all(r["batch_move/messages"] >= 1 for r in rows[1:]) and max(r["batch_move/messages"] for r in rows[1:]) > 1
    # the loss's old policy is each token's behaviour log-prob: where the batch is older than the actor the PPO
    # ratio starts away from 1 (an on-policy loss would take the actor's own log-probs: ppo_kl exactly 0)
    assert abs(rows[1]["actor/ppo_kl"]) < 1e-4
    assert all(abs(r["actor/ppo_kl"]) > 1e-4 for r in rows[2:] if r["rollout/version_lag_mean"] > 0)


def test_each_token_was_sampled_by_the_weights_of_its_version(runs):
    """Independent check (transformers, float64): a token recorded as version v has the log-prob the actor of
    version v gives it (version 0: the initial model; v >= 1: the step-v checkpoint, exported)."""
    import torch
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from spmdrl.cli import app

    models = {0: runs.model}
    for v in range(1, STEPS - 2):  # the tokens trained in 4 steps are of versions 0 and 1
        out = runs.a / f"export{v}"
        res = CliRunner().invoke(app, ["export", "--checkpoint", str(runs.a / "checkpoints" / f"step_{v:08d}"),
                                       "--out", str(out)])
        assert res.exit_code == 0, res.output
        models[v] = str(out)
    models = {v: AutoModelForCausalLM.from_pretrained(p, torch_dtype=torch.float64).eval() for v, p in models.items()}
    worst_own, other, checked = 0.0, [], set()
    for rank in (2, 3):
        for step, rec in versions(runs.a, rank).items():
            b = rec["all"]
            for i in range(len(b["uid"])):
                p = b["prompts"][i][: b["prompt_len"][i]]
                r = b["responses"][i][: b["response_len"][i]]
                vs = b["versions"][i][: len(r)]
                got = torch.tensor(b["rollout_log_probs"][i][: len(r)], dtype=torch.float64)
                ids = torch.tensor([p + r])
                for v, model in models.items():
                    sel = torch.tensor([x == v for x in vs])
                    with torch.no_grad():
                        lp = torch.log_softmax(model(ids).logits[0, len(p) - 1: -1], -1)
                    diff = (lp[torch.arange(len(r)), torch.tensor(r)] - got).abs()
                    if sel.any():
                        worst_own = max(worst_own, float(diff[sel].max()))
                        checked.add(v)
                    if (~sel).any() and set(vs) - {v}:
                        other += diff[~sel].tolist()
    assert checked == {0, 1}
    # a token's own version gives its log-prob; the other version's, on average over those tokens, does not
    assert worst_own < 1e-4 < 1e-3 < sum(other) / len(other), (worst_own, sum(other) / len(other))


def test_same_config_and_seed_give_the_same_metrics_killed_and_resumed(runs):
    """The schedule (when weights are loaded, which groups make a batch) is counted in engine steps, and a
    checkpoint keeps the rollout ranks' requests in flight and the posted batch, so a run of the same config killed
    in step 3 and resumed agrees with the straight one on every metric but the measured ones, and trains on the same
    batches."""
    def rows(out):  # rollout/generated_tokens_per_s is measured too
        return [{k: v for k, v in r.items() if not k.endswith("_per_s")}
                for r in comparable(read_jsonl(str(out), last_per_step=True))]

    a, b = rows(runs.a / "metrics.jsonl"), rows(runs.b / "metrics.jsonl")
    assert len(a) == STEPS + 1 and a == b
    for rank in (2, 3):
        assert versions(runs.a, rank) == versions(runs.b, rank)
