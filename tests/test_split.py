"""Split placement and k-step off-policy with real processes: 4 gloo ranks, vLLM TP=2 on ranks 0-1 (built on a
sub-world of the 4), FSDP2 dp=2 on ranks 2-3, GRPO. Four runs shared by the tests below (about 3 minutes on 2
cores): split with max_staleness 0, colocated on 2 ranks with the same seed, split with max_staleness 1 (4
steps, checkpoints at steps 2 and 4), and that run resumed from its step-2 checkpoint. Every run logs its
process-group creations (SPMDRL_GROUP_LOG), checked against NCCL's rules."""
import glob
import json
import os
import shutil
import types

import pytest

pytest.importorskip("vllm")

from launching import free_port, run  # noqa: E402
from spmdrl.data.synthetic import make_arith  # noqa: E402
from spmdrl.metrics import read_jsonl  # noqa: E402
from spmdrl.tiny import build_tiny  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))
SPLIT = {"placement.mode": "split", "placement.rollout_ranks": "[0,1]", "placement.rollout_tp": 2}
# the staleness-0 and colocated runs sample at T = 0.7 with top-p 0.9: vLLM's processed log-probs are compared
# with the actor's under the same temperature and truncation (spmdrl/loop/correction.py)
TRUNCATED = {"rollout.temperature": 0.7, "rollout.top_p": 0.9}


def overrides(model, data, out, **extra):
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.val_files": f'["{data["val"]}"]',
        "data.max_prompt_length": 32, "data.max_response_length": 8, "data.train_batch_size": 4,
        "rollout.n": 4, "rollout.kv_cache_gb": 0.1, "actor.lr": 1e-3, "actor.micro_batch_size": 4,
        # two mini-batches: not on-policy, so the actor's old log-probs are computed and compared with vLLM's
        "actor.ppo_mini_batch_size": 2, "trainer.total_steps": 3, "trainer.device": "cpu",
        "trainer.output_dir": str(out), "logging.progress": "false", "logging.tensorboard": "false",
        "checkpoint.save_freq": -1, "trainer.dist_timeout_s": 120,
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_len.py") + ":score",
        "hooks.files": f'["{os.path.join(HERE, "dist_scripts", "version_hook.py")}"]',
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def train(out, nproc, args, monkeypatch, port=None, check=True):
    dump = out / "dump"
    dump.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("SPMDRL_TEST_DUMP", str(dump))
    monkeypatch.setenv("SPMDRL_GROUP_LOG", str(out / "groups"))  # every process-group creation, per rank
    return run(["spmdrl.train", *args], nproc=nproc, module=True, port=port, check=check)


def shm_segments(port: int) -> list[str]:
    """The CPU TP communicator's shared-memory segments of a job on `port` (spmdrl/rollout/vllm_engine.py)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"spmdrl{port}e"))


def versions(out, rank):
    return {r["step"]: r for r in map(json.loads, open(out / "dump" / f"versions_rank{rank}.jsonl"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("split")
    model = build_tiny(str(root / "model"), seed=0)
    data = make_arith(str(root / "data"), n_train=64, n_val=16, seed=0)
    s0, col, s1, s1r = (root / n for n in ("s0", "colocated", "s1", "s1_resumed"))
    ports: list[int] = []  # one per run (every run here has rollout TP 2), all different
    while len(ports) < 4:
        ports += [p for p in [free_port()] if p not in ports]
    # a segment a SIGKILLed earlier job on the colocated run's port left (vLLM's create would fail on it: errno 17)
    stale = f"/dev/shm/spmdrl{ports[1]}e1-tp:0-[0-1]-cpushm_0"
    with open(stale, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        train(s0, 4, overrides(model, data, s0, **SPLIT, **TRUNCATED), mp, port=ports[0])
        col_proc = train(col, 2, overrides(model, data, col, **{"placement.rollout_tp": 2}, **TRUNCATED), mp,
                         port=ports[1])
        shm_left = {p: shm_segments(p) for p in ports[:2]}
        # rollout.verify_sync: the rollout ranks check every sync's weights against the actor's (reshard/verify.py)
        s1_args = dict(SPLIT, **{"trainer.max_staleness": 1, "trainer.total_steps": 4, "checkpoint.save_freq": 2,
                                 "checkpoint.keep_last": 0, "rollout.verify_sync": "true"})
        proc = train(s1, 4, overrides(model, data, s1, **s1_args), mp, port=ports[2])
        # the same run, stopped after its step-2 checkpoint: drop what came later, then resume
        shutil.copytree(s1, s1r, ignore=shutil.ignore_patterns("dump", "step_00000004"))
        rows = [line for line in open(s1r / "metrics.jsonl") if json.loads(line)["step"] <= 2]
        open(s1r / "metrics.jsonl", "w").writelines(rows)
        resumed = train(s1r, 4, overrides(model, data, s1r, **s1_args), mp, port=ports[3])
        shm_left.update({p: shm_segments(p) for p in ports[2:]})
    finally:
        mp.undo()
        for p in ports:
            for name in shm_segments(p):  # what a failed run left: not for the next test on this machine
                os.unlink(os.path.join("/dev/shm", name))
    return types.SimpleNamespace(model=model, s0=s0, col=col, s1=s1, s1r=s1r, s1_log=proc.stdout + proc.stderr,
                                 resumed=resumed.stdout + resumed.stderr, shm_left=shm_left, stale=stale,
                                 col_log=col_proc.stdout + col_proc.stderr)


def comparable(rows):
    measured = ("timing/", "perf/", "memory/")
    return [{k: v for k, v in r.items() if not k.startswith(measured)} for r in rows]


def test_staleness0_split_gives_the_colocated_metrics_bitwise(runs):
    split, colocated = (comparable(read_jsonl(str(d / "metrics.jsonl"))) for d in (runs.s0, runs.col))
    assert [r["step"] for r in split] == [0, 1, 2, 3]
    assert split[1]["train/reward_std"] > 0 and split[1]["actor/grad_norm"] > 0  # a real update
    # transfer bookkeeping differs (split moves every byte; colocated holds part); everything else is equal
    layout_keys = ("weight_sync/", "batch_move/", "train/weight_version_lag")
    for a, b in zip(split, colocated):
        shared = {k for k in a.keys() & b.keys() if not k.startswith(layout_keys)}
        assert len(shared) > 15 or a["step"] == 0
        assert {k: a[k] for k in shared} == {k: b[k] for k in shared}, a["step"]
    for rank in (2, 3):  # on-policy: batch k was generated by the weights after step k-1
        assert {s: set(v["versions"]) for s, v in versions(runs.s0, rank).items()} == {1: {0}, 2: {1}, 3: {2}}
    # processed log-probs (T = 0.7, top-p 0.9) match the actor's, split and colocated alike
    for rows in (split, colocated):
        assert all(r["rollout/logprob_diff_max"] < 1e-5 for r in rows[1:])


def test_staleness1_batch_of_step_k_was_generated_by_the_weights_after_step_k_minus_2(runs):
    from safetensors.torch import load_file  # noqa: F401  (the exported model is read by transformers)
    from typer.testing import CliRunner

    from spmdrl.cli import app

    rows = read_jsonl(str(runs.s1 / "metrics.jsonl"), last_per_step=True)
    for rank in (2, 3):
        seen = {s: set(v["versions"]) for s, v in versions(runs.s1, rank).items()}
        assert seen == {1: {0}, 2: {0}, 3: {1}, 4: {2}}
    assert [r["train/weight_version_lag"] for r in rows[1:]] == [0.0, 1.0, 1.0, 1.0]
    # every sync the rollout ranks loaded (the initial one and versions 1-3) passed rollout.verify_sync on rank 0
    assert runs.s1_log.count("rollout.verify_sync: the rollout engine holds the actor's weights exactly") == 4, runs.s1_log
    # the actor (one update ahead) disagrees with the tokens' log-probs from step 2 on
    assert rows[1]["rollout/logprob_diff_mean"] < 1e-5 and all(r["rollout/logprob_diff_mean"] > 1e-3 for r in rows[2:])
    # independent check: batch 4's vLLM log-probs are those of the step-2 checkpoint's weights (transformers,
    # float64 reference), not those of step 4's
    import torch
    from transformers import AutoModelForCausalLM

    logp = {}
    for step in (2, 4):
        out = runs.s1 / f"export{step}"
        res = CliRunner().invoke(app, ["export", "--checkpoint", str(runs.s1 / "checkpoints" / f"step_{step:08d}"),
                                       "--out", str(out)])
        assert res.exit_code == 0, res.output
        model = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float64).eval()
        logp[step] = model
    dumped = versions(runs.s1, 2)[4]["all"]
    worst = {2: 0.0, 4: 0.0}
    prompts = dumped["prompts"]
    for i, resp in enumerate(dumped["responses"]):
        p = prompts[i][: dumped["prompt_len"][i]]
        r = resp[: dumped["response_len"][i]]
        ids = torch.tensor([p + r])
        for step, model in logp.items():
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0, len(p) - 1: -1], -1)
            ref = lp[torch.arange(len(r)), torch.tensor(r)]
            got = torch.tensor(dumped["rollout_log_probs"][i][: len(r)], dtype=torch.float64)
            worst[step] = max(worst[step], float((ref - got).abs().max()))
    assert worst[2] < 1e-4 < 1e-2 < worst[4], worst


def test_transferred_bytes_equal_the_plan(runs):
    from safetensors.torch import load_file

    rows = read_jsonl(str(runs.s0 / "metrics.jsonl"))
    # weights: a rollout rank holds nothing of the actor, so it receives its whole vLLM TP=2 shard in fp32. For
    # this model every matrix and q/k/v bias splits in half (kv heads 2, vocab 320 = 5 x 64), norms are whole
    tensors = {}
    for f in glob.glob(os.path.join(runs.model, "*.safetensors")):
        tensors.update(load_file(f))
    shard = 4 * sum(t.numel() if "norm" in k else t.numel() // 2 for k, t in tensors.items())
    assert [r["weight_sync/bytes_recv_max"] for r in rows[1:]] == [shard] * 3  # each step's update, within the step
    assert rows[1]["weight_sync/bytes_lower_bound"] == shard
    # batches: each training rank receives its 8 samples once, every tensor as float64 columns of its width
    for rank in (2, 3):
        for step, b in versions(runs.s0, rank).items():
            widths = sum(len(v[0]) if isinstance(v[0], list) else 1 for k, v in b["all"].items())
            assert len(b["all"]["uid"]) == 8
            assert rows[step]["batch_move/bytes_recv_max"] == 8 * 8 * widths


def test_resume_keeps_the_in_flight_batch_and_is_bitwise(runs):
    assert "resumed from" in runs.resumed and "step_00000002 at step 2" in runs.resumed
    ckpt = runs.s1 / "checkpoints" / "step_00000002"
    manifest = json.load(open(ckpt / "manifest.json"))
    assert {"rank_tensors/rank_2.safetensors", "rank_tensors/rank_3.safetensors"} <= set(manifest["files"])
    assert "actor" in manifest["engines"]
    straight = comparable(read_jsonl(str(runs.s1 / "metrics.jsonl"), last_per_step=True))
    resumed = comparable(read_jsonl(str(runs.s1r / "metrics.jsonl"), last_per_step=True))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert resumed == straight
    # batch 3 came from the checkpoint (generated before the stop), batch 4 was generated after the resume
    for rank in (2, 3):
        assert versions(runs.s1r, rank)[3]["all"] == versions(runs.s1, rank)[3]["all"]
        assert versions(runs.s1r, rank)[4]["all"] == versions(runs.s1, rank)[4]["all"]


def test_group_creations_follow_nccl_rules(runs):
    """Every process-group creation of the runs (role meshes, transfer groups, vLLM's build), checked against
    the rule of the mode a CUDA run of the same configuration uses (spmdrl.dist.group_log). Split placement
    leaves the default group unbound: vLLM's groups are created by the rollout ranks alone, which a
    device-bound default group (what spmdrl used to do for every run) would hang on. With it unbound, every
    NCCL group connects at its first collective or batched call, which all its members must make: the logged
    first uses follow that rule too."""
    from spmdrl.dist.group_log import check_first_use, check_nccl_rules, read_group_logs

    for out in (runs.s0, runs.s1, runs.s1r):
        logs, bound = read_group_logs(str(out / "groups"))
        assert bound is False
        assert check_nccl_rules(logs, bound) == []
        assert check_first_use(logs, bound) == []
        connected = {row["use"] for r in logs for row in logs[r]
                     if "use" in row and (row["site"] or "").startswith("spmdrl/dist/meshes")}
        assert len(connected) == 3  # the batch, weight and training groups, connected at creation
        made = {r: [g for g in logs[r] if "api" in g] for r in logs}  # the creations
        callers = {r: {g["caller"] for g in made[r]} for r in made}
        assert callers[0] == callers[1] == {"spmdrl", "vllm"} and callers[2] == callers[3] == {"spmdrl"}
        # vLLM's creations are member-local, beneath vllm_world's new_group
        assert all(g["local"] for r in (0, 1) for g in made[r] if g["caller"] == "vllm")
        assert any(g.get("via") == "DeviceMesh" and g["site"].startswith("spmdrl/dist/meshes.py") for g in made[2])
        old = check_nccl_rules(logs, device_bound=True)  # the same creations with the default group device-bound
        assert any(v.startswith("group [0, 1] is created member-local (vllm at vllm/") for v in old), old
        assert any(v.startswith("ranks 0 and 2 differ") and "rank 2 makes no more" in v for v in old), old
    logs, bound = read_group_logs(str(runs.col / "groups"))
    assert bound is True
    assert check_nccl_rules(logs, bound) == []
    callers = [{g["caller"] for g in logs[r] if "api" in g} for r in (0, 1)]
    assert callers[0] == callers[1] == {"spmdrl", "vllm"}


def test_healthy_tp2_runs_leave_no_shared_memory_and_remove_a_stale_segment(runs):
    """Every healthy run with rollout TP 2 left vLLM's two CPU TP communicator segments in /dev/shm (its C++
    side unlinks them in a static destructor, which spmdrl's fast exit skips); the colocated run also found a
    segment of its own name left by a killed job, which made vLLM's create fail. The four runs leave nothing."""
    assert runs.shm_left == {p: [] for p in runs.shm_left}
    assert not os.path.exists(runs.stale)
    assert f"removed {runs.stale}, a shared-memory segment left by an earlier job of this name" in runs.col_log
