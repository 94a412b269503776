"""Each algorithm family runs a full 2-process step on CPU (torchrun, vLLM, FSDP2), and the advantages and
policy loss of that step are recomputed from the dumped batch with the algorithm core's functions."""
import os

import pytest
import torch

pytest.importorskip("vllm")

from launching import run  # noqa: E402
from spmdrl.algos import ADV_ESTIMATORS, agg_loss  # noqa: E402
from spmdrl.data.synthetic import make_arith  # noqa: E402
from spmdrl.metrics import read_jsonl  # noqa: E402
from spmdrl.tiny import build_reward_model, build_tiny  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))

CASES = {
    "grpo_kl_loss": {"algorithm.adv_estimator": "grpo", "actor.use_kl_loss": "true"},
    "drgrpo_gspo": {"algorithm.adv_estimator": "drgrpo", "actor.policy_loss": "gspo",
                    "actor.loss_agg_mode": "seq-mean-token-mean"},
    "rloo_kl_reward_adaptive": {"algorithm.adv_estimator": "rloo", "algorithm.use_kl_in_reward": "true",
                                "algorithm.kl_ctrl": "adaptive", "algorithm.kl_coef": 0.05},
    "reinforce_pp": {"algorithm.adv_estimator": "reinforce_plus_plus", "actor.entropy_coeff": 0.01},
    "reinforce_pp_baseline": {"algorithm.adv_estimator": "reinforce_plus_plus_baseline"},
    "remax": {"algorithm.adv_estimator": "remax", "rollout.n": 2},
    "dapo": {"algorithm.adv_estimator": "grpo", "algorithm.filter_groups": "true", "actor.clip_ratio_high": 0.28,
             "reward.overlong_buffer_len": 4, "algorithm.max_sample_rounds": 3},
    "grpo_reward_model": {"algorithm.adv_estimator": "grpo", "reward.model_path": "<rm>", "reward.model_weight": 0.5},
    "ppo_gae": {"algorithm.adv_estimator": "gae", "critic.enable": "true", "critic.micro_batch_size": 8,
                "algorithm.lam": 0.95, "algorithm.gamma": 1.0},
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("algos")
    build_reward_model(str(root / "rm"), seed=3)
    return build_tiny(str(root / "model"), seed=0), make_arith(str(root / "data"), n_train=64, n_val=8, seed=0)


@pytest.mark.parametrize("case", list(CASES))
def test_algorithm_step(assets, tmp_path, case):
    model, data = assets
    n = int(CASES[case].get("rollout.n", 4))
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.max_prompt_length": 32,
        "data.max_response_length": 8, "data.train_batch_size": 4, "rollout.n": n, "rollout.kv_cache_gb": 0.1,
        "actor.lr": 1e-3, "actor.micro_batch_size": 2 * n, "trainer.total_steps": 1, "trainer.device": "cpu",
        "trainer.output_dir": str(tmp_path), "logging.progress": "false", "logging.tensorboard": "false",
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
        "hooks.files": f'["{os.path.join(HERE, "dist_scripts", "dump_hook.py")}"]',
    }
    o.update({k: (str(os.path.join(os.path.dirname(model), "rm")) if v == "<rm>" else v) for k, v in CASES[case].items()})
    os.environ["SPMDRL_TEST_DUMP"] = str(tmp_path)
    try:
        run(["spmdrl.train", *[f"{k}={v}" for k, v in o.items()]], nproc=2, module=True)
    finally:
        del os.environ["SPMDRL_TEST_DUMP"]
    (m,) = read_jsonl(str(tmp_path / "metrics.jsonl"))
    batches = [torch.load(tmp_path / f"batch_rank{r}.pt", weights_only=True) for r in range(2)]
    cfg_alg = {k.split(".")[1]: v for k, v in o.items() if k.startswith("algorithm.")}
    est = ADV_ESTIMATORS.get(cfg_alg["adv_estimator"])
    losses = []
    for b in batches:
        adv, ret = est(b["token_level_rewards"], b["response_mask"], index=b["index"], values=b.get("values"),
                       baseline_rewards=b.get("baseline_rewards"), gamma=float(cfg_alg.get("gamma", 1.0)),
                       lam=float(cfg_alg.get("lam", 1.0)), epsilon=1e-6, norm_by_std=True)
        torch.testing.assert_close(b["advantages"], adv, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(b["returns"], ret, atol=1e-6, rtol=1e-5)
        assert torch.isfinite(b["advantages"]).all()
        # one mini-batch, one micro-batch per rank, first pass: ratio == 1, so the surrogate is -A aggregated
        mode = o.get("actor.loss_agg_mode", "token-mean")
        losses.append(float(agg_loss(-b["advantages"], b["response_mask"], mode)))
    assert m["actor/pg_loss"] == pytest.approx(sum(losses) / 2, abs=1e-5)
    assert m["actor/grad_norm"] > 0 and m["actor/skipped_step"] == 0
    if case == "ppo_gae":
        assert "critic/vf_loss" in m and m["critic/vf_loss"] > 0
    if case == "dapo":
        assert "train/kept_sample_ratio" in m and "reward/overlong_penalty_mean" in m
    if case == "grpo_reward_model":
        assert "reward/model_score_mean" in m and m["reward/model_score_mean"] != 0
    if case == "rloo_kl_reward_adaptive":
        assert "actor/kl_coef" in m
