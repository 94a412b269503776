"""What a user does after the quickstart, through the `spmdrl` command on a tiny model (one process, vLLM):
train for an epoch with two weighted reward functions while seeing generations, then evaluate the final
checkpoint with `spmdrl eval`. One training run and one evaluation for the whole module."""
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
REWARDS = '''
def length(data_source, solution_str, ground_truth, extra_info):
    return {"score": float(len(solution_str) % 3) / 2.0, "n_chars": len(solution_str)}


def has_digit(data_source, solution_str, ground_truth, extra_info):
    return float(any(c.isdigit() for c in solution_str))
'''


def weighted(text: str) -> float:
    """The reward the config asks for, computed here from a response's text: 0.5 * length + 2 * has_digit."""
    return 0.5 * (len(text) % 3) / 2.0 + 2.0 * float(any(c.isdigit() for c in text))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    model = build_tiny(str(root / "model"), seed=0)
    data = make_arith(str(root / "data"), n_train=8, n_val=6, seed=0)
    (root / "rewards.py").write_text(REWARDS)
    config = root / "run.toml"
    config.write_text(f'''
[data]
train_files = ["{data['train']}"]
val_files = ["{data['val']}"]
max_prompt_length = 32
max_response_length = 8
train_batch_size = 4
[model]
path = "{model}"
[actor]
lr = 1e-3
micro_batch_size = 4
[rollout]
n = 4
kv_cache_gb = 0.1
[reward]
custom_fns = ["{root / 'rewards.py'}:length", "{root / 'rewards.py'}:has_digit"]
weights = [0.5, 2.0]
[trainer]
total_epochs = 1
device = "cpu"
output_dir = "{root / 'run'}"
[logging]
progress = false
log_generations = 2
dump_rollouts = true
''')
    proc = run(["spmdrl", "train", "--config", str(config)], nproc=None, module=True)
    return root, config, proc


def test_an_epoch_with_weighted_rewards_and_readable_generations(trained):
    root, _, proc = trained
    out = root / "run"
    rows = read_jsonl(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]  # trainer.total_epochs = 1: 8 prompts / 4 per step
    gens = [json.loads(line) for line in open(out / "generations.jsonl")]
    assert [(g["step"], g["split"]) for g in gens] == [(0, "val")] * 2 + [(1, "train")] * 2 + [(2, "train")] * 2 + \
        [(2, "val")] * 2
    for g in gens:
        assert g["prompt"].startswith("user: ") and g["data_source"] == "synthetic/arith"
        assert g["reward"] == pytest.approx(weighted(g["response"]), abs=1e-6)
    for step in (1, 2):  # the dump holds every sample; the step's mean reward and each function's mean agree
        dumped = [json.loads(line) for line in open(out / "rollouts" / f"train_step_{step:06d}_rank0.jsonl")]
        assert len(dumped) == 4 * 4 and dumped[:2] == [g for g in gens if g["step"] == step and g["split"] == "train"]
        metrics = rows[step]
        assert metrics["train/reward_mean"] == pytest.approx(sum(weighted(d["response"]) for d in dumped) / 16, abs=1e-5)
        assert metrics["reward/extra/has_digit"] == pytest.approx(
            sum(any(c.isdigit() for c in d["response"]) for d in dumped) / 16, abs=1e-6)
        assert metrics["reward/extra/length/n_chars"] == pytest.approx(sum(len(d["response"]) for d in dumped) / 16)
    assert len([json.loads(line) for line in open(out / "rollouts" / "val_step_000002_rank0.jsonl")]) == 6
    assert "Traceback" not in proc.stderr and "RuntimeWarning" not in proc.stderr


def test_eval_of_the_final_checkpoint_reproduces_the_runs_last_validation(trained):
    """`spmdrl eval --checkpoint` exports the checkpoint and validates it with no training engine: greedy
    validation of the same weights gives the run's own final accuracy and reward."""
    root, config, _ = trained
    proc = run(["spmdrl", "eval", "--config", str(config), "--checkpoint", str(root / "run"),
                "logging.log_generations=3"], nproc=None, module=True)
    result = json.load(open(root / "run" / "eval" / "eval.json"))
    last = read_jsonl(str(root / "run" / "metrics.jsonl"))[-1]
    for key in ("val/accuracy", "val/source_accuracy/synthetic/arith", "val/reward_mean"):
        assert result["metrics"][key] == pytest.approx(last[key], abs=1e-9), key
    assert f"val/accuracy {last['val/accuracy']:.4f}".split() == \
        next(line for line in proc.stdout.splitlines() if line.startswith("val/accuracy ")).split()
    gens = [json.loads(line) for line in open(root / "run" / "eval" / "generations.jsonl")]
    assert len(gens) == 3 and all(g["split"] == "val" for g in gens)
