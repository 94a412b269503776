"""VLLMEngine in-process under torchrun (gloo): TP=2 over two ranks, rollout DP=2 (TP=1 per rank), bucketed
weight updates, and the training world surviving vLLM. One real launch per layout (module-scoped fixtures);
the tests read the JSON each rank wrote and check it against a transformers fp32 forward."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from spmdrl.tiny import build_tiny  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "dist_scripts", "vllm_rollout.py")
TOL = 1e-5

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return build_tiny(str(root / "old"), seed=0), build_tiny(str(root / "new"), seed=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(models, out_dir, tp: int, nproc: int | None) -> list[dict]:
    old, new = models
    args = [SCRIPT, "--model", old, "--new-model", new, "--tp", str(tp), "--out", str(out_dir)]
    if nproc is None:  # a plain process, no torchrun
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    if nproc is None:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return [json.load(open(out_dir / f"rank{r}.json")) for r in range(nproc or 1)]


@pytest.fixture(scope="module")
def tp2(models, tmp_path_factory):
    return _launch(models, tmp_path_factory.mktemp("tp2"), tp=2, nproc=2)


@pytest.fixture(scope="module")
def dp2(models, tmp_path_factory):
    return _launch(models, tmp_path_factory.mktemp("dp2"), tp=1, nproc=2)


_hf_cache: dict = {}


def _hf(path):
    if path not in _hf_cache:
        from transformers import AutoModelForCausalLM

        _hf_cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _hf_cache[path]


@torch.no_grad()
def hf_logprobs(path, prompt, response):
    ids = torch.tensor([prompt + response])
    logits = _hf(path)(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def assert_logprobs_match(path, res, key):
    out, n = res[key], len(res[key]["response_ids"]) // len(res["prompts"])
    assert n == 2
    for k, (resp, lps) in enumerate(zip(out["response_ids"], out["logprobs"])):
        assert len(resp) == len(lps) > 0
        ref = hf_logprobs(path, res["prompts"][k // n], resp)
        err = (torch.tensor(lps) - ref).abs().max().item()
        assert err < TOL, f"{key} sample {k}: vLLM vs transformers log-prob error {err}"


# ------------------------------------------------------------------------------------------------------- TP=2


def test_tp2_ranks_get_identical_outputs(tp2):
    r0, r1 = tp2
    assert (r0["tp_rank"], r1["tp_rank"], r0["dp_size"]) == (0, 1, 1)
    assert r0["prompts"] == r1["prompts"] and r0["seeds"] == r1["seeds"]
    for key in ("first", "greedy", "updated", "other_seeds", "per_request"):
        assert r0[key] == r1[key], key


def test_tp2_logprobs_match_transformers(tp2, models):
    assert_logprobs_match(models[0], tp2[0], "first")
    res = tp2[0]
    ref = hf_logprobs(models[0], res["prompts"][0], res["first"]["response_ids"][0])
    assert (torch.tensor(res["compute_logprobs"][0]) - ref).abs().max().item() < TOL


def test_tp2_processed_logprobs_match_the_actor_at_temperature_and_top_p(tp2, models):
    """T = 0.7, top_p = 0.9, fp32: vLLM's log-probs are those of the truncated, renormalised sampling distribution.
    They match, within 1e-5, (a) a float64 reference of that distribution written out in tests/test_rollout_hf.py
    and (b) the actor's log-prob path (spmdrl.algos.token_stats.logprobs_from_hidden with the same temperature
    and top_p, on a transformers forward's hidden states) - and differ from the untruncated ones."""
    from test_rollout_hf import processed_logprobs64

    from spmdrl.algos.token_stats import logprobs_from_hidden

    res = tp2[0]
    out, model = res["processed"], _hf(models[0])
    assert res["processed"] == tp2[1]["processed"]
    renormalised = 0
    for k, (resp, lps) in enumerate(zip(out["response_ids"], out["logprobs"])):
        p = res["prompts"][k // 2]
        with torch.no_grad():
            h = model.model(input_ids=torch.tensor([p + resp])).last_hidden_state[0, len(p) - 1: -1]
            logits = model.lm_head(h)
            actor, _ = logprobs_from_hidden(h, model.lm_head.weight, torch.tensor(resp), temperature=0.7, top_p=0.9,
                                            with_entropy=False)
        ref = processed_logprobs64(logits, 0.7, -1, 0.9).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        got = torch.tensor(lps, dtype=torch.float64)
        assert (got - ref).abs().max().item() < TOL, k
        assert (got - actor.double()).abs().max().item() < TOL, k
        plain = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        renormalised += int(((got - plain) > 1e-3).sum())
    assert renormalised > 0  # the nucleus cut mass off at some steps: the comparison is not vacuous


def test_tp2_output_shape_and_order(tp2):
    out = tp2[0]["first"]
    assert len(out["response_ids"]) == len(out["logprobs"]) == len(out["finish_reason"]) == 3 * 2
    assert set(out["finish_reason"]) <= {"stop", "length"}
    for resp, reason in zip(out["response_ids"], out["finish_reason"]):
        assert reason == "stop" or len(resp) == 24
    # the two samples of a prompt are seeded differently
    assert out["response_ids"][0] != out["response_ids"][1]


def test_tp2_update_weights_in_two_buckets(tp2, models):
    assert tp2[0]["updated"]["response_ids"] != tp2[0]["first"]["response_ids"]
    assert_logprobs_match(models[1], tp2[0], "updated")


def test_tp2_world_collectives_after_vllm(tp2):
    for res in tp2:
        assert res["all_reduce"] == 3.0 and res["all_gather_object_ok"]
        assert res["all_reduce_after_close"] == 2.0
        assert res["rng_preserved"] and res["generate_kept_rng"]


def test_tp2_same_seeds_same_samples(tp2):
    for res in tp2:
        assert res["first"]["response_ids"] == res["again"]["response_ids"]
        assert torch.allclose(torch.tensor(sum(res["first"]["logprobs"], [])),
                              torch.tensor(sum(res["again"]["logprobs"], [])), atol=1e-6)


def test_tp2_model_runner_v2_seeds_follow_the_call_seed(tp2, dp2):
    """The seed vLLM's CUDA runner (Model Runner V2) gives each unseeded request, drawn by V2's own
    SamplingStates.add_request from numpy's global RNG as the request joins the batch (the script runs it beside the
    CPU runner): the same on both TP ranks although their numpy RNGs start apart, the same when the call's seeds
    repeat, others when they change (another step), on both layouts; and numpy's state is training's again after
    generate. Before generate seeded numpy from the call seed, every call drew the same seeds."""
    assert tp2[0]["v2_seeds"] == tp2[1]["v2_seeds"]
    for res in (*tp2, *dp2):
        got = res["v2_seeds"]
        assert len(got["first"]) == 6 and len(set(got["first"])) == 6, got  # 3 prompts x n = 2, each its own seed
        assert got["again"] == got["first"], got
        assert not set(got["other_seeds"]) & set(got["first"]), got
        assert res["generate_kept_numpy_rng"]
    assert not set(dp2[0]["v2_seeds"]["first"]) & set(dp2[1]["v2_seeds"]["first"])  # rollout dp ranks differ


def test_tp2_seeds_drive_the_samples(tp2, models):
    """Default mode (one request per prompt, n samples, engine reseeded from the seeds): other seeds give other
    samples; per-request seeding gives valid samples whose values do not depend on the rest of the batch."""
    res = tp2[0]
    assert res["other_seeds"]["response_ids"] != res["first"]["response_ids"]
    assert_logprobs_match(models[0], res, "per_request")
    assert res["per_request"]["response_ids"][2:4] == res["per_request_alone"]["response_ids"]
    assert res["per_request"]["response_ids"][0] != res["per_request"]["response_ids"][1]


def test_tp2_mismatched_requests_are_caught(tp2):
    for res in tp2:
        assert res["mismatch_error"] and "same request" in res["mismatch_error"]


def test_greedy_matches_hf_engine(tp2, models):
    from spmdrl.rollout import SamplingSpec
    from spmdrl.rollout.hf_engine import HFEngine

    res = tp2[0]
    hf = HFEngine(models[0], max_model_len=128)
    out = hf.generate(res["prompts"], SamplingSpec(n=1, temperature=0.0, max_tokens=16), res["seeds"])
    assert out.response_ids == res["greedy"]["response_ids"]


# ------------------------------------------------------------------------------------------ rollout DP=2, TP=1


def test_dp2_each_rank_its_own_engine(dp2, models):
    r0, r1 = dp2
    assert (r0["dp_rank"], r1["dp_rank"], r0["dp_size"], r0["tp_rank"], r1["tp_rank"]) == (0, 1, 2, 0, 0)
    assert r0["prompts"] != r1["prompts"]
    for res in dp2:
        assert_logprobs_match(models[0], res, "first")
        assert res["first"]["response_ids"] == res["again"]["response_ids"]


def test_dp2_update_weights_in_two_buckets(dp2, models):
    for res in dp2:
        assert_logprobs_match(models[1], res, "updated")


def test_dp2_world_collectives_after_vllm(dp2):
    for res in dp2:
        assert res["all_reduce"] == 3.0 and res["all_gather_object_ok"]
        assert res["all_reduce_after_close"] == 2.0


def test_single_process_without_torchrun(models, tmp_path):
    (res,) = _launch(models, tmp_path, tp=1, nproc=None)
    assert res["world"] == 1 and res["dp_size"] == 1
    assert_logprobs_match(models[0], res, "first")
    assert_logprobs_match(models[1], res, "updated")


def test_scheduler_is_the_synchronous_one(models, monkeypatch):
    """The scheduler vLLM configures from spmdrl's arguments, as a CUDA run resolves it. vLLM 0.32 settles async
    scheduling in VllmConfig.__post_init__ (on by default under external_launcher) before the platform's hook,
    and the CPU platform's hook then turns it off whatever was asked: so the value is read as that hook is
    entered, which is the value a CUDA run keeps."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.core.sched.scheduler import Scheduler

    from spmdrl.rollout.vllm_engine import SCHEDULER_ARGS

    seen = []
    platform = type(current_platform)
    hook = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        seen.append(vllm_config.scheduler_config.async_scheduling)
        return hook(cls, vllm_config)

    monkeypatch.setattr(platform, "check_and_update_config", classmethod(check_and_update_config))
    cfg = EngineArgs(model=models[0], distributed_executor_backend="external_launcher", enforce_eager=True,
                     max_model_len=256, **SCHEDULER_ARGS).create_engine_config()
    assert seen == [False]
    assert cfg.scheduler_config.get_scheduler_cls() is Scheduler
    seen.clear()
    EngineArgs(model=models[0], distributed_executor_backend="external_launcher", enforce_eager=True,
               max_model_len=256).create_engine_config()
    assert seen == [True]  # vLLM's own default, which spmdrl does not take
