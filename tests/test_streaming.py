"""Streaming rollouts: the engine stepped by spmdrl (admit / step / abort, generate as a drain of it) and partial
rollouts carried across weight updates.

- generate equals vLLM's own batch call (LLM.generate) on the same engine, token for token and log-prob for log-prob,
  in both seeding modes and greedy;
- the request-level interface: admit, step, abort (what was generated so far), re-admit, duplicate ids refused;
- a request carried across a weight update: its tokens carry both versions; in recompute mode the tokens after the
  update have exactly the new model's log-probs given the whole prefix (a float32 transformers forward), in keep
  mode they do not (their prefix's keys and values are the old model's), while the tokens before it have the old
  model's;
- the loss of a mixed-version batch equals a float64 PPO computed from each token's behaviour log-prob;
- decoupled PPO's loss and gradient on a mixed-version batch equal a float64 computation;
- a 4-step GRPO run with rollout.partial = keep and decoupled PPO carries requests over and trains on tokens of two
  versions, and killed at step 3 and resumed it logs bitwise the uninterrupted run's metrics.
"""
import json
import os

import pytest
import torch

pytest.importorskip("vllm")

from launching import run  # noqa: E402
from spmdrl.tiny import build_tiny  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return build_tiny(str(root / "old"), seed=0), build_tiny(str(root / "new"), seed=1)


@pytest.fixture(scope="module")
def engine_run(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("streaming")
    run([os.path.join(HERE, "dist_scripts", "streaming_engine.py"), "--model", models[0], "--new-model", models[1],
         "--out", str(out)], nproc=None, timeout=300)
    return json.load(open(out / "result.json"))


def test_generate_is_a_drain_equal_to_vllms_batch_call(engine_run):
    for name in ("shared", "per_request", "greedy"):
        drain, batch = engine_run[f"drain_{name}"], engine_run[f"batch_{name}"]
        assert drain["response_ids"] == batch["response_ids"], name
        assert drain["logprobs"] == batch["logprobs"], name  # bit for bit
        assert drain["finish_reason"] == batch["finish_reason"], name
    shared = engine_run["drain_shared"]["response_ids"]
    assert len(shared) == 12 and len({tuple(r) for r in shared}) > 1


def test_admit_step_abort_readmit(engine_run):
    r = engine_run
    assert r["in_flight_admitted"] == 3 and r["early"] == []  # 20 tokens take more than 3 steps
    taken = r["aborted"]
    assert taken["id"] == "b" and taken["finish_reason"] == "abort" and 1 <= len(taken["token_ids"]) <= 3
    assert taken["versions"] == [0] * len(taken["token_ids"]) and len(taken["logprobs"]) == len(taken["token_ids"])
    assert r["in_flight_after_abort"] == 2 and "already in flight" in r["duplicate_error"]
    rest = r["rest"]
    assert len(rest["b"]["token_ids"]) == 20 - len(taken["token_ids"])
    assert [len(rest[k]["token_ids"]) for k in "ac"] == [20, 20] and r["in_flight_end"] == 0
    # a request seeded with sample_seed(seed, 0) draws what generate's per-request mode draws for that sample
    assert rest["a"]["token_ids"] == r["drain_per_request"]["response_ids"][0]


def _logprobs(path, prompt, response):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_requests_carried_across_a_weight_update_keep_and_recompute(engine_run, models):
    prompts = engine_run["prompts"][2:4]
    gaps = {}
    for mode in ("keep", "recompute"):
        for i, prompt in enumerate(prompts):
            c = engine_run[mode][f"{mode}{i}"]
            v = torch.tensor(c["versions"])
            assert v[:4].eq(0).all() and v[4:].eq(1).all() and len(v) == 24  # four steps of the old weights
            got = torch.tensor(c["logprobs"])
            old = _logprobs(models[0], prompt, c["token_ids"])
            new = _logprobs(models[1], prompt, c["token_ids"])
            assert (got[:4] - old[:4]).abs().max() < 1e-4
            gaps.setdefault(mode, []).append(float((got[4:] - new[4:]).abs().max()))
    assert max(gaps["recompute"]) < 1e-4, gaps  # the whole prefix recomputed with the new weights
    assert min(gaps["keep"]) > 1e-3, gaps  # the old weights' keys and values kept


@pytest.mark.quick
def test_mixed_version_loss_is_ppo_on_behaviour_logprobs_float64():
    from spmdrl.algos import POLICY_LOSSES
    from spmdrl.batch import Batch
    from spmdrl.config import Config
    from spmdrl.loop.update import ActorObjective

    cfg = Config()
    cfg.rollout.partial, cfg.actor.entropy_metric, cfg.data.max_response_length = "keep", False, 4
    g = torch.Generator().manual_seed(0)
    B, R = 3, 4
    behaviour = -torch.rand(B, R, generator=g) * 2  # each token's rollout log-prob, at its own version
    versions = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    adv = torch.randn(B, R, generator=g)
    logp = (behaviour + 0.4 * torch.randn(B, R, generator=g)).requires_grad_()  # ratios inside and outside the clip

    class Engine:
        def logprobs(self, tb, **kw):
            return logp, None

        def moe_losses(self):
            return None

    mb = Batch({"response_mask": mask, "rollout_log_probs": behaviour, "advantages": adv, "versions": versions})
    objective = ActorObjective(cfg, POLICY_LOSSES.get(cfg.actor.policy_loss), 1.0)
    loss, _, _ = objective(mb, None, Engine())
    loss.backward()
    lp = logp.detach().double().requires_grad_()
    ratio = (lp - behaviour.double()).exp()
    lo, hi = 1 - cfg.actor.clip_ratio_low, 1 + cfg.actor.clip_ratio_high
    pg = torch.maximum(-adv.double() * ratio, -adv.double() * ratio.clamp(lo, hi))
    ref = (pg * mask.double()).sum() / mask.double().sum()
    ref.backward()
    assert abs(float(loss.detach()) - float(ref)) < 1e-6
    assert (logp.grad.double() - lp.grad).abs().max() < 1e-6
    on_policy = ActorObjective(Config(), POLICY_LOSSES.get(cfg.actor.policy_loss), 1.0)(mb, None, Engine())[0]
    assert abs(float(on_policy) - float(ref)) > 1e-3  # without rollout.partial the ratio would be 1


@pytest.mark.quick
def test_decoupled_ppo_loss_and_gradient_float64_on_a_mixed_version_batch():
    """rollout_correction.decoupled: the ratio and clip use the proximal policy (the actor before the update), each
    token weighted by min(pi_prox / pi_behav, C), pi_behav the engine's log-prob at the token's own version."""
    from spmdrl.algos import POLICY_LOSSES
    from spmdrl.batch import Batch
    from spmdrl.config import Config
    from spmdrl.loop.correction import correct_rollout
    from spmdrl.loop.update import ActorObjective

    cfg = Config()
    cfg.rollout.partial, cfg.actor.entropy_metric, cfg.data.max_response_length = "keep", False, 5
    cfg.rollout_correction.decoupled, cfg.rollout_correction.decoupled_cap = True, 1.5
    g = torch.Generator().manual_seed(1)
    B, R = 4, 5
    versions = torch.tensor([[0, 0, 1, 1, 2], [2, 2, 2, 2, 2], [0, 1, 2, 2, 2], [1, 1, 1, 0, 0]])
    behaviour = -torch.rand(B, R, generator=g) * 2 - 0.1 * versions  # each token's rollout log-prob, at its version
    prox = behaviour + 0.5 * (2 - versions) * torch.randn(B, R, generator=g)  # the actor before the update (version 2)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    adv = torch.randn(B, R, generator=g)
    logp = (prox + 0.3 * torch.randn(B, R, generator=g)).requires_grad_()  # ratios inside and outside the clip

    class Engine:
        def logprobs(self, tb, **kw):
            return logp, None

        def moe_losses(self):
            return None

    batch = Batch({"response_mask": mask, "rollout_log_probs": behaviour, "advantages": adv, "versions": versions})
    mb, metrics = correct_rollout(cfg, None, batch, lambda engine, b: prox.clone(), None, None)  # on-policy: one pass
    loss, _, _ = ActorObjective(cfg, POLICY_LOSSES.get(cfg.actor.policy_loss), 1.0)(mb, None, Engine())
    loss.backward()
    lp, A, m = logp.detach().double().requires_grad_(), adv.double(), mask.double()
    w = (prox.double() - behaviour.double()).exp().clamp(max=1.5)
    rho = (lp - prox.double()).exp()
    lo, hi, c = 1 - cfg.actor.clip_ratio_low, 1 + cfg.actor.clip_ratio_high, cfg.actor.clip_ratio_c
    pg = torch.maximum(-A * rho, -A * rho.clamp(lo, hi))
    pg = torch.where(A < 0, torch.minimum(pg, -A * c), pg)  # the dual clip
    ref = (w * pg * m).sum() / m.sum()
    ref.backward()
    assert abs(float(loss.detach()) - float(ref)) < 1e-6
    assert (logp.grad.double() - lp.grad).abs().max() < 1e-6
    sel = m > 0
    assert abs(metrics["decoupled/weight_max"] - 1.5) < 1e-12 and 0 < metrics["decoupled/capped_fraction"] < 1
    assert abs(metrics["decoupled/weight_mean"] - float(w[sel].mean())) < 1e-9
    assert abs(metrics["decoupled/weight_min"] - float(w[sel].min())) < 1e-9
    # against what it replaces: PPO on the behaviour log-probs (no decoupling) is another loss
    plain = ActorObjective(Config(), POLICY_LOSSES.get(cfg.actor.policy_loss), 1.0)
    plain.behaviour_old = True
    assert abs(float(plain(batch, None, Engine())[0]) - float(ref)) > 1e-3


def test_partial_rollouts_carry_requests_over_and_resume_exactly_after_kill(tmp_path, monkeypatch):
    """A 4-step GRPO run with rollout.partial = keep and decoupled PPO carries requests over and trains on tokens of
    two versions; the same run killed (os._exit) at the start of step 2, with requests in flight, and relaunched
    resumes from the checkpoint after step 1 and logs bitwise the uninterrupted run's metrics."""
    from safetensors.torch import load_file

    from spmdrl.data.synthetic import make_arith
    from spmdrl.metrics import read_jsonl

    model = build_tiny(str(tmp_path / "model"), seed=0)
    data = make_arith(str(tmp_path / "data"), n_train=64, n_val=4, seed=0)

    def train(out, check=True):
        o = {
            "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.max_prompt_length": 32,
            "data.max_response_length": 16, "data.train_batch_size": 2, "rollout.n": 2, "rollout.kv_cache_gb": 0.1,
            "rollout.partial": "keep", "rollout.oversample": 1.0, "rollout.max_version_lag": 1, "actor.lr": 1e-3,
            "actor.micro_batch_size": 4, "trainer.total_steps": 4, "trainer.device": "cpu",
            "trainer.output_dir": str(out), "logging.progress": "false", "rollout.parity_check": "false",
            "checkpoint.save_freq": 1, "rollout_correction.decoupled": "true",
            "rollout.stop_token_ids": "[" + ",".join(str(i) for i in range(40, 53)) + "]",  # lengths vary: a long tail
            "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
        }
        return run(["spmdrl.train", *[f"{k}={v}" for k, v in o.items()]], nproc=None, module=True, check=check)

    def rows(out):
        measured = ("timing/", "perf/", "memory/")
        return [{k: v for k, v in r.items() if not k.startswith(measured) and not k.endswith("_per_s")}
                for r in read_jsonl(str(out / "metrics.jsonl"), last_per_step=True) if r["step"] >= 1]

    train(tmp_path / "a")
    monkeypatch.setenv("SPMDRL_FAULT_INJECT", "kill:rank=0:step=2")
    killed = train(tmp_path / "b", check=False)
    assert killed.returncode != 0 and "exits in step 2" in killed.stderr
    monkeypatch.delenv("SPMDRL_FAULT_INJECT")
    # the checkpoint the resume starts from holds requests in flight: tokens so far of unfinished samples
    saved = load_file(str(tmp_path / "b" / "checkpoints" / "step_00000001" / "rank_tensors" / "rank_0.safetensors"))
    suspended = saved["partial/samples"][saved["partial/samples"][:, 2] == 1]
    assert len(suspended) > 0 and int(suspended[:, 4].sum()) > 0
    resumed = train(tmp_path / "b")
    assert "resumed from" in resumed.stderr + resumed.stdout
    straight = rows(tmp_path / "a")
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    assert all(r["rollout/requests_carried_over"] > 0 for r in straight)
    assert straight[0]["rollout/version_lag_max"] == 0 and straight[0]["decoupled/weight_max"] < 1.001
    assert max(r["rollout/version_lag_max"] for r in straight[1:]) == 1  # trained on tokens of the previous weights
    assert max(r["decoupled/weight_max"] - r["decoupled/weight_min"] for r in straight[1:]) > 1e-3  # pi_prox != pi_behav
    assert sum(r["actor/grad_norm"] > 0 for r in straight) >= 3
    assert rows(tmp_path / "b") == straight  # bitwise: step 1 before the kill, 2-4 after the resume


def test_partial_rollouts_refuse_what_they_cannot_do_in_one_line():
    from spmdrl.config import Config
    from spmdrl.config.validate import validate_partial
    from spmdrl.errors import ConfigError

    def cfg(**kw):
        c = Config()
        c.rollout.partial, c.trainer.device = "keep", "cpu"
        for key, value in kw.items():
            section, name = key.split("__")
            setattr(getattr(c, section), name, value)
        return c

    validate_partial(cfg())
    for kw, words in (({"placement__mode": "split"}, "trainer.max_staleness >= 1"),
                      ({"algorithm__filter_groups": True}, "algorithm.filter_groups"),
                      ({"rollout__top_p": 0.9}, "top_p = 0.9"),
                      ({"trainer__device": "cuda"}, "enable_sleep_mode"),
                      ({"actor__ppo_epochs": 2}, "rollout_correction.decoupled = true"),
                      ({"rollout__max_version_lag": -1}, "rollout.max_version_lag")):
        with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")) as e:
            validate_partial(cfg(**kw))
        assert "\n" not in str(e.value)
    validate_partial(cfg(multi_turn__enable=True))  # the agent loop on the stepped engine
    validate_partial(cfg(actor__ppo_epochs=2, rollout_correction__rollout_is="token"))
    validate_partial(cfg(actor__ppo_epochs=2, rollout_correction__decoupled=True))
    from spmdrl.config.validate import validate_rollout_correction

    validate_rollout_correction(cfg(rollout_correction__decoupled=True, rollout_correction__decoupled_cap=2.0))
    for kw, words in (({"rollout_correction__decoupled": True, "rollout_correction__rollout_is": "token"},
                       "rollout_is = 'none'"),
                      ({"rollout_correction__decoupled": True, "rollout_correction__decoupled_cap": 0.5}, ">= 1"),
                      ({"rollout_correction__decoupled_cap": 2.0}, "decoupled = true")):
        with pytest.raises(ConfigError, match=words) as e:
            validate_rollout_correction(cfg(**kw))
        assert "\n" not in str(e.value)
    validate_partial(cfg(trainer__device="cuda", rollout__enable_sleep_mode=False))
    validate_partial(cfg(placement__mode="split", trainer__max_staleness=1, trainer__device="cuda"))  # asynchronous split
