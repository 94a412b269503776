"""The GRPO loop end to end with real processes: torchrun with 2 ranks (rollout TP=2, and rollout DP=2) and a
single plain process; in-process vLLM, FSDP2 actor over both ranks, weight sync checked against the actor."""
import json
import os

import pytest

pytest.importorskip("vllm")

from launching import run  # noqa: E402
from spmdrl.data.synthetic import make_arith  # noqa: E402
from spmdrl.metrics import read_jsonl  # noqa: E402
from spmdrl.tiny import build_tiny  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))
REQUIRED = [
    "train/reward_mean", "train/response_length_mean", "val/accuracy", "val/source_accuracy/synthetic/arith",
    "actor/pg_loss", "actor/kl", "actor/entropy", "actor/clipfrac", "actor/grad_norm", "actor/lr",
    "rollout/logprob_diff_mean", "timing/step_s", "timing/rollout_s", "timing/weight_sync_s",
    "timing/update_actor_s", "timing/old_logprob_s", "perf/tokens_per_s", "perf/peak_memory_gb",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    model = build_tiny(str(root / "model"), seed=0)
    data = make_arith(str(root / "data"), n_train=64, n_val=16, seed=0)
    return model, data


def overrides(assets, out, **extra):
    model, data = assets
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.val_files": f'["{data["val"]}"]',
        "data.max_prompt_length": 32, "data.max_response_length": 8, "data.train_batch_size": 4,
        "rollout.n": 4, "rollout.kv_cache_gb": 0.1, "actor.lr": 1e-3, "actor.micro_batch_size": 4,
        "actor.ppo_mini_batch_size": 2, "actor.use_kl_loss": "true", "trainer.total_steps": 2,
        "trainer.device": "cpu", "trainer.output_dir": str(out), "logging.progress": "false",
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def check_run(out, nranks):
    rows = read_jsonl(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]  # validation before training, then two steps
    last = rows[-1]
    missing = [k for k in REQUIRED if k not in last]
    assert not missing, missing
    assert rows[1]["train/reward_std"] > 0  # the custom reward has in-group variance: the update is real
    assert rows[1]["actor/grad_norm"] > 0
    # step 2 samples with weights synced after step 1: vLLM and the actor agree on those tokens
    assert rows[2]["rollout/logprob_diff_mean"] < 1e-5
    # the planned resharding moves no more than the lower bound (bytes of a rank's shard it does not hold)
    assert rows[2]["weight_sync/bytes_recv_max"] <= 1.1 * rows[2]["weight_sync/bytes_lower_bound"]
    assert os.listdir(out / "tensorboard") and os.path.isfile(out / "config.toml")
    documented = open(os.path.join(os.path.dirname(HERE), "docs", "metrics.md")).read()
    undocumented = [k for r in rows for k in r if k != "step" and "/synthetic/" not in k and not k.startswith("reward/extra/") and f"`{k}`" not in documented]
    assert not undocumented, f"metrics missing from docs/metrics.md: {sorted(set(undocumented))}"
    checks = [json.load(open(out / f"check_rank{r}.json")) for r in range(nranks)]
    for c in checks:
        assert c["param_change"] > 0
        assert c["n_tokens"] > 0
        assert c["weight_sync_max_diff"] < 1e-5, c["weight_sync_max_diff"]
    return rows, checks


LAYOUTS = {"rollout_tp2": (2, 1), "rollout_dp2": (1, 1), "actor_tp2_rollout_dp2": (1, 2)}


@pytest.fixture(scope="module")
def layout_runs(assets, tmp_path_factory):
    """The three 2-rank layouts' runs, one after another in one launch (grpo_step.py --runs)."""
    root = tmp_path_factory.mktemp("grpo_layouts")
    reward = os.path.join(HERE, "dist_scripts", "reward_count.py") + ":score"
    specs = []
    for name, (rollout_tp, actor_tp) in LAYOUTS.items():
        out = root / name
        (out / "reward_calls").mkdir(parents=True)
        specs.append({"out": str(out), "env": {"REWARD_CALL_LOG": str(out / "reward_calls")},
                      "overrides": overrides(assets, out, **{"placement.rollout_tp": rollout_tp,
                                                             "placement.actor_tp": actor_tp, "reward.custom_fn": reward})})
    (root / "runs.json").write_text(json.dumps(specs))
    run([os.path.join(HERE, "dist_scripts", "grpo_step.py"), "--runs", str(root / "runs.json")], nproc=2, timeout=900)
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_two_ranks(layout_runs, layout):
    # actor_tp2_rollout_dp2: DTensor TP actor, and the batch moves from the rollout layout (p2p exchange)
    rollout_tp, _ = LAYOUTS[layout]
    tmp_path = layout_runs / layout
    calls = tmp_path / "reward_calls"
    rows, checks = check_run(tmp_path, 2)
    # every sample is scored exactly once, also when both ranks of an actor tp group hold it:
    # 2 steps x 4 prompts x 4 samples, plus 16 validation prompts x 1 sample before training and after the last step
    logged = [line.split() for f in os.listdir(calls) for line in open(calls / f).read().splitlines()]
    assert len(logged) == 2 * 4 * 4 + 2 * 16, len(logged)
    # the extra key the reward returns is logged as reward/extra/n_chars, the mean over each step's samples
    # (each scored on one rank of its tp group): the two steps' means average to the mean over every training call
    train_chars = [int(n) for split, n in logged if split == "train"]
    assert len(train_chars) == 2 * 4 * 4
    steps = {r["step"]: r for r in rows}
    assert abs((steps[1]["reward/extra/n_chars"] + steps[2]["reward/extra/n_chars"]) / 2
               - sum(train_chars) / len(train_chars)) < 1e-9
    assert "reward/extra/n_chars" not in steps[0]  # validation logs no training-reward extras
    if rollout_tp == 2:  # one engine across both ranks: both see the same samples
        assert checks[0]["responses"] == checks[1]["responses"]


def test_grpo_single_process(assets, tmp_path):
    proc = run(["spmdrl.train", *overrides(assets, tmp_path, **{"actor.use_kl_loss": "false"})], nproc=None, module=True)
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "train/reward_mean" in rows[-1] and rows[-1]["actor/grad_norm"] > 0
    assert "Traceback" not in proc.stderr


def test_srun_without_torchrun(assets, tmp_path):
    """Two plain processes with only Slurm's variables (what `srun python -m spmdrl.train` gives): rank, world
    size and the master come from SLURM_PROCID / SLURM_NTASKS / the first host of SLURM_JOB_NODELIST."""
    import subprocess
    import sys

    from launching import REPO, free_port

    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    base.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR", MASTER_PORT=str(free_port()),
                SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="77")
    args = overrides(assets, tmp_path, **{"trainer.total_steps": 1, "data.val_files": "[]"})
    procs = [subprocess.Popen([sys.executable, "-m", "spmdrl.train", *args], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "2 rank(s) via slurm" in outs[0]
    assert "[rank1] rank 1: actor: dp 1/2" in outs[1]
    (row,) = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert row["step"] == 1 and row["actor/grad_norm"] > 0
