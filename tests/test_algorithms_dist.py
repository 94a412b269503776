"""Each algorithm family runs a full 2-process step on CPU (torchrun, vLLM, FSDP2). From the two ranks' dumped
batches (together: the global batch) the advantages, the in-reward KL and the logged policy loss are recomputed
in float64 over the WHOLE global batch with formulas written out here, independently of spmdrl.algos: a
per-rank computation (e.g. whitening each rank's shard) would not match."""
import json
import os

import pytest
import torch

pytest.importorskip("vllm")

from launching import run  # noqa: E402
from spmdrl.data.synthetic import make_arith  # noqa: E402
from spmdrl.metrics import read_jsonl  # noqa: E402
from spmdrl.tiny import build_reward_model, build_tiny  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))

CASES = {
    "grpo_kl_loss": {"algorithm.adv_estimator": "grpo", "actor.use_kl_loss": "true"},
    "drgrpo_norm": {"algorithm.adv_estimator": "drgrpo", "actor.loss_agg_mode": "seq-mean-token-sum-norm",
                    "actor.entropy_coeff": 0.01},
    "rloo_kl_reward_adaptive": {"algorithm.adv_estimator": "rloo", "algorithm.use_kl_in_reward": "true",
                                "algorithm.kl_ctrl": "adaptive", "algorithm.kl_coef": 0.05},
    "reinforce_pp": {"algorithm.adv_estimator": "reinforce_plus_plus", "actor.entropy_coeff": 0.01},
    "reinforce_pp_baseline": {"algorithm.adv_estimator": "reinforce_plus_plus_baseline"},
    "remax": {"algorithm.adv_estimator": "remax", "rollout.n": 2},
    "dapo": {"algorithm.adv_estimator": "grpo", "algorithm.filter_groups": "true", "actor.clip_ratio_high": 0.28,
             "reward.overlong_buffer_len": 4, "algorithm.max_sample_rounds": 3},
    "dapo_no_informative_group": {"algorithm.adv_estimator": "grpo", "algorithm.filter_groups": "true",
                                  "algorithm.max_sample_rounds": 2,
                                  "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_const.py") + ":score"},
    "grpo_reward_model_gspo": {"algorithm.adv_estimator": "grpo", "reward.model_path": "<rm>",
                               "reward.model_weight": 0.5, "actor.policy_loss": "gspo"},
    "ppo_gae": {"algorithm.adv_estimator": "gae", "critic.enable": "true", "critic.micro_batch_size": 8,
                "algorithm.lam": 0.95, "algorithm.gamma": 1.0},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's 1-step run, all in one 2-process launch (tests/dist_scripts/train_runs.py): case -> (its
    output directory, its overrides, the launch's output)."""
    root = tmp_path_factory.mktemp("algos")
    build_reward_model(str(root / "rm"), seed=3)
    model, data = build_tiny(str(root / "model"), seed=0), make_arith(str(root / "data"), n_train=64, n_val=8, seed=0)
    out, specs = {}, []
    for case, extra in CASES.items():
        n = int(extra.get("rollout.n", 4))
        o = {
            "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.max_prompt_length": 32,
            "data.max_response_length": 8, "data.train_batch_size": 4, "rollout.n": n, "rollout.kv_cache_gb": 0.1,
            "actor.lr": 1e-3, "actor.micro_batch_size": 2 * n, "trainer.total_steps": 1, "trainer.device": "cpu",
            "trainer.output_dir": str(root / case), "logging.progress": "false", "logging.tensorboard": "false",
            "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
            "hooks.files": f'["{os.path.join(HERE, "dist_scripts", "dump_hook.py")}"]',
        }
        o.update({k: str(root / "rm") if v == "<rm>" else v for k, v in extra.items()})
        specs.append({"overrides": [f"{k}={v}" for k, v in o.items()], "env": {"SPMDRL_TEST_DUMP": str(root / case)}})
        out[case] = (root / case, o)
    (root / "runs.json").write_text(json.dumps(specs))
    proc = run([os.path.join(HERE, "dist_scripts", "train_runs.py"), str(root / "runs.json")], nproc=2, timeout=900)
    return {case: (d, o, proc.stdout[-3000:] + proc.stderr[-6000:]) for case, (d, o) in out.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_algorithm_step(runs, case):
    tmp_path, o, log = runs[case]
    n = int(o["rollout.n"])
    assert (tmp_path / "rc").read_text() == "0", log
    (m,) = read_jsonl(str(tmp_path / "metrics.jsonl"))
    b = _global([torch.load(tmp_path / f"batch_rank{r}.pt", weights_only=True) for r in range(2)])
    alg = {k.split(".")[1]: v for k, v in o.items() if k.startswith("algorithm.")}
    mask = b["response_mask"].double()
    if case == "rloo_kl_reward_adaptive":  # KL in the reward, coefficient 0.05 at step 1; controller input
        kl = (b["old_log_probs"] - b["ref_log_probs"]).double() * mask
        torch.testing.assert_close(b["token_level_rewards"].double(), b["token_level_scores"].double() - 0.05 * kl,
                                   atol=1e-6, rtol=0)
        assert m["actor/reward_kl"] == pytest.approx(float((kl.sum(-1) / mask.sum(-1)).mean()), abs=1e-6)
    adv, ret = _reference_advantages(b, alg["adv_estimator"], lam=float(alg.get("lam", 1.0)))
    torch.testing.assert_close(b["advantages"].double(), adv, atol=2e-6, rtol=1e-5)
    if ret is not None:
        torch.testing.assert_close(b["returns"].double(), ret, atol=2e-6, rtol=1e-5)
    # one mini-batch, first pass: ratio == 1, so the surrogate is -A, aggregated over the global batch
    mode = o.get("actor.loss_agg_mode", "seq-mean-token-mean" if o.get("actor.policy_loss") == "gspo" else "token-mean")
    pg = -b["advantages"].double() * mask
    want = {"token-mean": pg.sum() / mask.sum(), "seq-mean-token-mean": (pg.sum(-1) / mask.sum(-1)).mean(),
            "seq-mean-token-sum-norm": (pg.sum(-1) / 8).mean()}[mode]  # data.max_response_length = 8
    assert m["actor/pg_loss"] == pytest.approx(float(want), abs=1e-5)
    assert m["actor/skipped_step"] == 0
    if case == "dapo_no_informative_group":  # the step trains on the last round as drawn; no crash
        assert m["train/filter_fallback"] == 1 and m["train/sample_rounds"] == 2 and m["train/kept_sample_ratio"] == 0
        assert len(b["uid"]) == 4 * n and b["advantages"].abs().max() == 0 and m["actor/pg_loss"] == 0
        return
    assert m["actor/grad_norm"] > 0
    if case == "ppo_gae":
        assert "critic/vf_loss" in m and m["critic/vf_loss"] > 0
    if case == "dapo":  # every kept group (one prompt draw) is informative on the rule score, and whole
        assert m["train/filter_fallback"] == 0 and "reward/overlong_penalty_mean" in m
        for u in b["uid"].unique():
            g = b["rule_scores"][b["uid"] == u]
            assert len(g) == n and g.max() > g.min()
    if case == "grpo_reward_model_gspo":
        assert "reward/model_score_mean" in m and m["reward/model_score_mean"] != 0
    if case == "rloo_kl_reward_adaptive":
        assert "actor/kl_coef" in m


def _global(batches):
    """Concatenate the ranks' batches (rank order = global order), right-padding [B, T] tensors."""
    out = {}
    for k in batches[0]:
        parts = [x[k] for x in batches]
        if parts[0].dim() == 2:
            w = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, w - p.shape[1])) for p in parts]
        out[k] = torch.cat(parts)
    return out


def _reference_advantages(b, name, lam):
    """Float64 advantages of the whole global batch, written from each estimator's definition."""
    valid = b["response_mask"] != 0
    r = torch.where(valid, b["token_level_rewards"].double(), torch.zeros((), dtype=torch.float64))
    s = r.sum(-1)
    groups = {int(u): (b["uid"] == u) for u in b["uid"].unique()}
    mean = torch.stack([s[groups[int(u)]].mean() for u in b["uid"]])
    std = torch.stack([s[groups[int(u)]].std() for u in b["uid"]])
    size = torch.tensor([float(groups[int(u)].sum()) for u in b["uid"]], dtype=torch.float64)
    tokens = lambda per_seq: per_seq[:, None] * valid  # noqa: E731

    def whiten(x):
        v = x[valid]
        return torch.where(valid, (x - v.mean()) / torch.sqrt(v.var() + 1e-8), torch.zeros_like(x))

    returns = torch.zeros_like(r)  # gamma = 1: sum of the rewards from t on
    for t in reversed(range(r.shape[1])):
        returns[:, t] = r[:, t] + (returns[:, t + 1] if t + 1 < r.shape[1] else 0.0)
    returns = returns * valid
    if name == "grpo":
        a = tokens((s - mean) / (std + 1e-6))
        return a, a
    if name == "drgrpo":
        return tokens(s - mean), tokens(s - mean)
    if name == "rloo":
        a = tokens(size / (size - 1) * (s - mean))
        return a, a
    if name == "reinforce_plus_plus":
        return whiten(returns), returns
    if name == "reinforce_plus_plus_baseline":
        a = whiten(tokens(s - mean))
        return a, a
    if name == "remax":
        return (returns - b["baseline_rewards"].double()[:, None]) * valid, returns
    if name == "gae":  # gamma 1
        v = torch.where(valid, b["values"].double(), torch.zeros((), dtype=torch.float64))
        adv = torch.zeros_like(r)
        for i in range(len(r)):
            T, last = int(valid[i].sum()), 0.0
            for t in reversed(range(T)):
                nxt = v[i, t + 1] if t + 1 < T else 0.0
                last = r[i, t] + nxt - v[i, t] + lam * last
                adv[i, t] = last
        return whiten(adv), (adv + v) * valid
    raise AssertionError(name)
