"""The RL loop end to end on the Megatron backend: 4 real processes (torchrun, gloo), in-process vLLM at TP=2,
a megatron-core actor at TP=2 x PP=2 and at TP=2 x DP=2 (GRPO), and a megatron-core critic (PPO). Every step's
rollout ran on weights resharded from the Megatron actor (vLLM starts from dummy weights and is synced before
the first step), so vLLM's log-probs of its own samples must equal the actor's (fp32, temperature 1), and the
sync must move no more than the lower bound."""
import os

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from launching import run  # noqa: E402
from spmdrl.config import load_config, to_toml  # noqa: E402
from spmdrl.data.synthetic import make_arith  # noqa: E402
from spmdrl.metrics import read_jsonl  # noqa: E402
from spmdrl.tiny import build_tiny  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_rl")
    return build_tiny(str(root / "model"), seed=0), make_arith(str(root / "data"), n_train=32, n_val=4, seed=0)


def run_config(assets, out, **extra) -> str:
    model, data = assets
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.val_files": "[]",
        "data.max_prompt_length": 32, "data.max_response_length": 8, "data.train_batch_size": 4, "rollout.n": 2,
        "rollout.kv_cache_gb": 0.1, "rollout.temperature": 1.0, "rollout.load_format": "dummy",
        "rollout.weight_sync_bucket_mb": 1, "placement.rollout_tp": 2,
        # two mini-batches per step: the old log-probs are a separate actor forward, compared with vLLM's
        "actor.ppo_mini_batch_size": 2, "actor.micro_batch_size": 2, "actor.lr": 1e-3,
        "trainer.backend": "megatron", "trainer.device": "cpu", "trainer.total_steps": 2,
        "trainer.output_dir": str(out), "logging.progress": "false", "memory.gpus_per_node": 4,
        "checkpoint.save_freq": -1,
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
    }
    o.update(extra)
    path = out / "run.toml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(load_config(None, [f"{k}={v}" for k, v in o.items()])))
    return str(path)


def check_steps(out, steps: int, critic: bool = False) -> list[dict]:
    rows = read_jsonl(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        # vLLM sampled with weights the sync resharded from the Megatron actor: same log-probs (fp32)
        assert r["rollout/logprob_diff_max"] <= 1e-5, (r["step"], r["rollout/logprob_diff_max"])
        assert r["weight_sync/bytes_recv_max"] <= 1.1 * r["weight_sync/bytes_lower_bound"], r["step"]
        assert r["actor/grad_norm"] > 0
        if critic:
            assert r["critic/grad_norm"] > 0 and "critic/vf_loss" in r
    return rows


def test_grpo_megatron_tp2_pp2(assets, tmp_path, monkeypatch):
    """Actor TP=2 x PP=2 on 4 ranks -> vLLM TP=2 x DP=2: each rollout rank holds its own stage's layers and
    receives the other stage's; the bytes equal what `spmdrl plan` computes from config.json alone. Every
    process-group creation (role meshes, megatron-core's parallel state, vLLM's build) follows NCCL's rule for
    a device-bound default group: every rank makes the same creations in the same order."""
    import json
    import subprocess
    import sys

    from launching import REPO
    from spmdrl.dist.group_log import check_nccl_rules, read_group_logs

    cfg = run_config(assets, tmp_path / "run", **{"placement.actor_tp": 2, "placement.actor_pp": 2})
    monkeypatch.setenv("SPMDRL_GROUP_LOG", str(tmp_path / "groups"))
    run(["spmdrl.train", "--config", cfg], nproc=4, module=True, timeout=900)
    logs, bound = read_group_logs(str(tmp_path / "groups"))
    assert bound is True and check_nccl_rules(logs, bound) == []
    for rank, rows in logs.items():
        made = [g for g in rows if "api" in g]  # the creations (the other rows are the groups' first uses)
        assert {g["caller"] for g in made} == {"spmdrl", "megatron", "vllm"}, rank
        assert not any(g["local"] for g in made)
    rows = check_steps(tmp_path / "run", 2)
    assert rows[0]["weight_sync/bytes_recv_max"] > 0
    proc = subprocess.run([sys.executable, "-m", "spmdrl", "plan", "--config", cfg, "--json"], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["roles"]["actor"]["pp"] == 2 and plan["roles"]["actor"]["backend"] == "megatron"
    assert plan["weight_sync"]["bytes_recv_max"] == rows[-1]["weight_sync/bytes_recv_max"]
    assert plan["weight_sync"]["bytes_lower_bound"] == rows[-1]["weight_sync/bytes_lower_bound"]


def test_grpo_megatron_tp2_dp2(assets, tmp_path):
    cfg = run_config(assets, tmp_path / "run", **{"placement.actor_tp": 2})
    run(["spmdrl.train", "--config", cfg], nproc=4, module=True, timeout=900)
    check_steps(tmp_path / "run", 2)


def test_ppo_megatron_critic_tp2_pp2(assets, tmp_path):
    """PPO (GAE) with the critic on Megatron too (the value head on the last pipeline stage): one step."""
    cfg = run_config(assets, tmp_path / "run", **{
        "placement.actor_tp": 2, "placement.actor_pp": 2, "placement.critic_tp": 2, "placement.critic_pp": 2,
        "critic.enable": "true", "critic.micro_batch_size": 2, "critic.lr": 1e-3, "algorithm.adv_estimator": "gae",
        "rollout.n": 1, "trainer.total_steps": 1,
    })
    run(["spmdrl.train", "--config", cfg], nproc=4, module=True, timeout=900)
    check_steps(tmp_path / "run", 1, critic=True)
