"""The multi-turn agent loop on real vLLM under torchrun (tests/dist_scripts/multi_turn_rollout.py): rollout
TP=2 and rollout DP=2 over two ranks, with a model that has memorised scripted tool conversations
(tests/tool_agent.py). One launch per layout (module-scoped fixtures)."""
import json
import os

import pytest
import torch

pytest.importorskip("vllm")

from launching import run  # noqa: E402
from spmdrl.rollout.base import sample_seed  # noqa: E402
from spmdrl.rollout.multi_turn import turn_seed  # noqa: E402
from tool_agent import shared_tool_model  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dist_scripts", "multi_turn_rollout.py")


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    return shared_tool_model(tmp_path_factory)


def _launch(model, out, tp):
    run([SCRIPT, "--model", model, "--tp", str(tp), "--out", str(out)], nproc=2)
    return [json.load(open(out / f"rank{r}.json")) for r in range(2)]


@pytest.fixture(scope="module")
def tp2(tool_model, tmp_path_factory):
    return _launch(tool_model, tmp_path_factory.mktemp("mt_tp2"), 2)


@pytest.fixture(scope="module")
def dp2(tool_model, tmp_path_factory):
    return _launch(tool_model, tmp_path_factory.mktemp("mt_dp2"), 1)


def test_dp_groups_take_different_numbers_of_turns(dp2):
    """Rank 0's samples answer after one turn, rank 1's call a tool in every turn up to the limit: each DP
    group's engine runs its own number of turns and the run finishes (the world still all-reduces after)."""
    r0, r1 = (r["uneven"] for r in dp2)
    assert [t["finish"] for t in r0["trajs"]] == ["answer", "answer"] and r0["loop_turns"] == 1
    assert [t["finish"] for t in r1["trajs"]] == ["turn_limit", "turn_limit"] and r1["loop_turns"] == 3
    assert all(r["all_reduce_after"] == 2.0 for r in dp2)


def test_tp_group_ranks_hold_identical_trajectories(tp2):
    a, b = tp2
    for case in ("uneven", "seeded"):
        assert a[case]["trajs"] == b[case]["trajs"]
    assert a["uneven"]["loop_turns"] == 3  # the b samples were done after turn 1 and the group went on


def test_tp2_and_tp1_give_identical_trajectories_with_per_request_seeds(tp2, dp2):
    tp = tp2[0]["seeded"]["trajs"]
    dp = dp2[0]["seeded"]["trajs"] + dp2[1]["seeded"]["trajs"]
    assert [t["ids"] for t in tp] == [t["ids"] for t in dp]
    assert [t["mask"] for t in tp] == [t["mask"] for t in dp]
    assert max(len(t["info"]["turns"]) for t in tp) >= 2  # there were tool turns to agree on
    lp = torch.tensor([x for t in tp for x in t["logprobs"]])
    lp1 = torch.tensor([x for t in dp for x in t["logprobs"]])
    assert torch.allclose(lp, lp1, atol=1e-5, rtol=0)


def test_trained_ids_are_the_sampled_ids(tp2, dp2):
    """The model tokens of every trajectory (and of the batch built from it) are, turn by turn, exactly the ids
    vLLM returned for that trajectory's request of the turn (found by its prompt, the trajectory so far, and its
    seed), which sampled at most what was left of the response budget; the rest of the sequence is glue with
    mask 0."""
    for res in (tp2[0], dp2[0], dp2[1]):
        seeded = res["seeded"]
        trajs = seeded["trajs"]
        assert seeded["batch_responses"] == [t["ids"] for t in trajs]
        assert seeded["batch_mask"] == [[float(m) for m in t["mask"]] for t in trajs]
        requests = [(r["prompt"], r["seed"]) for r in seeded["requests"]]
        for t in trajs:
            sampled, pos = [], 0
            for turn in range(len(t["info"]["turns"])):
                r = seeded["requests"][requests.index((t["prompt"] + t["ids"][:pos],
                                                       sample_seed(turn_seed(t["seed"], t["sample"], turn), 0)))]
                assert r["max_tokens"] == 300 - pos and len(r["ids"]) <= r["max_tokens"]
                assert t["ids"][pos: pos + len(r["ids"])] == r["ids"]
                assert t["mask"][pos: pos + len(r["ids"])] == [1] * len(r["ids"])
                sampled += r["ids"]
                pos += len(r["ids"])
                while pos < len(t["ids"]) and t["mask"][pos] == 0:
                    pos += 1
            assert pos == len(t["ids"]) and sampled == [i for i, m in zip(t["ids"], t["mask"]) if m]
        assert len(requests) == sum(len(t["info"]["turns"]) for t in trajs)  # one request per turn, no other


def test_the_stepped_loop_samples_what_a_turn_by_turn_loop_samples(tp2, dp2):
    """Greedy, and sampled with per-request seeds: the agent loop on the stepped engine gives the trajectories
    (ids, mask, turns, tool results, finish) of a turn-synchronous loop making one generate call per turn for the
    whole batch (the script's by_turns), and their log-probs within 1e-5."""
    for res in (tp2[0], tp2[1], dp2[0], dp2[1]):
        for case in ("uneven", "seeded"):
            got, want = res[case]["trajs"], res["by_turns"][case]
            assert len(got) == len(want) > 0
            for g, w in zip(got, want):
                assert (g["ids"], g["mask"], g["finish"]) == (w["ids"], w["mask"], w["finish"]), case
                for a, b in zip(g["info"]["turns"], w["info"]["turns"]):  # a call's seconds are measured
                    for x in (a, b):
                        x["results"] = [{**r, "seconds": 0} for r in x["results"]]
                assert g["info"] == w["info"], case
                assert torch.allclose(torch.tensor(g["logprobs"]), torch.tensor(w["logprobs"]), atol=1e-5, rtol=0)


def test_a_trajectory_s_next_turn_starts_while_other_first_turns_run(tp2, dp2):
    """A trajectory's next turn is admitted as soon as its tools returned, not when the batch's turn ends: some
    second-turn request was admitted at an engine step before another trajectory's first turn finished (prompt c's
    malformed call is shorter than d's call)."""
    for res in (tp2[0], dp2[1]):
        seeded = res["seeded"]
        first = {tuple(t["prompt"]) for t in seeded["trajs"]}
        firsts = [r for r in seeded["requests"] if tuple(r["prompt"]) in first]
        later = [r for r in seeded["requests"] if tuple(r["prompt"]) not in first]
        assert later and min(r["admitted"] for r in later) < max(r["done"] for r in firsts)


def test_whole_trajectory_logprobs_equal_vllms_per_turn_logprobs(tp2, tool_model):
    """One fp32 forward of the actor's model over prompt + the whole trajectory (tool tokens included as
    context) gives, at every model token, the log-prob vLLM returned when it sampled it turn by turn."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32).eval()
    worst = 0.0
    for t in tp2[0]["seeded"]["trajs"]:
        ids = torch.tensor([t["prompt"] + t["ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(t["prompt"]) - 1: -1]
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t["ids"])[:, None])[:, 0]
        mask = torch.tensor(t["mask"], dtype=torch.bool)
        worst = max(worst, float((lp[mask] - torch.tensor(t["logprobs"])[mask]).abs().max()))
        assert torch.tensor(t["logprobs"])[~mask].abs().sum() == 0
    assert worst < 1e-5, worst


def test_a_diverging_tp_rank_raises_instead_of_hanging(tp2):
    for r in tp2:
        assert r["diverge_error"] and "disagree" in r["diverge_error"] and "turn 1" in r["diverge_error"]
    assert all(r["all_reduce_after"] == 2.0 for r in tp2)


# ---- GRPO through the Trainer ---------------------------------------------------------------------------------

def _tool_data(root):
    from spmdrl.data import schema

    def row(letter, i):
        answer = {"a": "", "b": "7"}.get(letter, "ok")
        return {schema.DATA_SOURCE: "tooltest", schema.PROMPT: [{"role": "user", "content": letter}],
                schema.ABILITY: "tools", schema.REWARD_MODEL: {"style": "rule", schema.GROUND_TRUTH: answer},
                schema.EXTRA_INFO: {"letter": letter, "index": i}}

    import pyarrow as pa

    info = pa.struct([("letter", pa.string()), ("index", pa.int64())])
    root.mkdir(parents=True, exist_ok=True)
    return {split: schema.write_verl_parquet([row(x, i) for i, x in enumerate(letters)], root / f"{split}.parquet",
                                             extra_info_type=info)
            for split, letters in (("train", "abcdeabcdeabcdea"), ("val", "abcde"))}


def _trainer_overrides(tool_model, tmp_path, data_dir=None, **extra):
    data = _tool_data(data_dir or tmp_path / "data")
    agent = os.path.join(HERE, "tool_agent.py")
    o = {
        "model.path": tool_model, "data.train_files": f'["{data["train"]}"]', "data.val_files": f'["{data["val"]}"]',
        "data.max_prompt_length": 64, "data.max_response_length": 300, "data.train_batch_size": 4,
        "data.shuffle": "false", "rollout.n": 4, "rollout.kv_cache_gb": 0.2, "rollout.temperature": 1.0,
        "rollout.val_temperature": 0.0, "placement.rollout_tp": 2, "actor.lr": 1e-4, "actor.micro_batch_size": 4,
        "actor.ppo_mini_batch_size": 2, "trainer.total_steps": 2, "trainer.device": "cpu",
        "trainer.output_dir": str(tmp_path), "logging.progress": "false",
        "reward.custom_fn": os.path.join(HERE, "dist_scripts", "reward_turns.py") + ":score",
        "hooks.files": f'["{os.path.join(HERE, "dist_scripts", "turns_hook.py")}"]',
        "multi_turn.enable": "true", "multi_turn.max_turns": 3, "multi_turn.tool_timeout_s": 0.5,
        "multi_turn.tools": "[" + ", ".join(f'"{agent}:{f}"' for f in ("ADD", "BOOM", "SLOW")) + "]",
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def test_grpo_with_tools_split_placement_and_bitwise_resume(tool_model, tmp_path, monkeypatch):
    """Split placement with max_staleness 1: rank 0 rolls out multi-turn trajectories with vLLM while rank 1
    trains; the turns travel with the batches (the `trajectory` tensor) and the reward and hooks on the training
    rank get them. A run stopped after its step-1 checkpoint (which holds the in-flight batch of step 2, turns
    included) and resumed logs step 2 exactly as the straight run did."""
    import shutil

    from spmdrl.metrics import read_jsonl

    monkeypatch.setenv("SPMDRL_TEST_DUMP", str(tmp_path))
    split = {"placement.mode": "split", "placement.rollout_ranks": "[0]", "placement.rollout_tp": 1,
             "trainer.max_staleness": 1, "actor.micro_batch_size": 8, "actor.ppo_mini_batch_size": 2,
             "checkpoint.save_freq": 1, "checkpoint.keep_last": 0}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(["spmdrl.train", *_trainer_overrides(tool_model, straight, tmp_path / "data", **split)], nproc=2, module=True)
    rows = read_jsonl(str(straight / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["multi_turn/turns_max"] == 3 and rows[1]["tools/calls"] > 0
    assert rows[1]["timing/turn_generate_s"] > 0  # the rollout rank's loop time reaches the log
    assert rows[2]["train/weight_version_lag"] == 1
    turns = json.load(open(tmp_path / "turns_rank1.json"))
    assert len(turns) == 16 and all(t["turns"] and t["messages"][0]["role"] == "user" for t in turns)

    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_00000002"))
    open(resumed / "metrics.jsonl", "w").writelines(
        line for line in open(straight / "metrics.jsonl") if json.loads(line)["step"] <= 1)
    proc = run(["spmdrl.train", *_trainer_overrides(tool_model, resumed, tmp_path / "data", **split)], nproc=2, module=True)
    assert "resumed from" in proc.stdout + proc.stderr

    def comparable(rows):
        measured = ("timing/", "perf/", "memory/", "tools/seconds")
        return [{k: v for k, v in r.items() if not k.startswith(measured)} for r in rows]

    again = read_jsonl(str(resumed / "metrics.jsonl"), last_per_step=True)
    assert comparable(again) == comparable(read_jsonl(str(straight / "metrics.jsonl"), last_per_step=True))


def test_grpo_with_tools_through_the_trainer(tool_model, tmp_path, monkeypatch):
    """Two steps of GRPO with tools on 2 ranks (rollout TP=2, FSDP2 actor over both): the rollouts are multi-turn
    (tools called, failures counted), the reward function gets the trajectory, the after_rollout hook sees the
    turns, and at step 2 vLLM's per-turn log-probs of the model tokens equal the actor's over the whole
    trajectories (the weights synced after step 1)."""
    from spmdrl.metrics import read_jsonl

    monkeypatch.setenv("SPMDRL_TEST_DUMP", str(tmp_path))
    run([os.path.join(HERE, "dist_scripts", "grpo_step.py"), "--out", str(tmp_path),
         *_trainer_overrides(tool_model, tmp_path)], nproc=2)
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    val, s1, s2 = rows
    assert val["val/accuracy"] > 0.5  # greedy validation runs the same loop: b, c, d, e answer as scripted
    assert s1["multi_turn/turns_max"] == 3 and 1 < s1["multi_turn/turns_mean"] < 3
    both = {k: s1.get(k, 0.0) + s2.get(k, 0.0) for k in {*s1, *s2}}  # step 1: prompts a-d, step 2: e, a, b, c
    assert both["tools/calls/add"] > 0 and both["tools/failures/boom/exception"] > 0
    assert both["tools/failures/slow/timeout"] > 0 and both["tools/failures/_unknown/malformed"] > 0
    assert both["tools/calls"] == sum(both[f"tools/calls/{k}"] for k in ("add", "boom", "slow", "_unknown"))
    assert s1["multi_turn/tool_tokens_mean"] > 0 and s1["timing/turn_tools_s"] > 0
    assert s2["rollout/logprob_diff_mean"] < 1e-5 and s2["rollout/logprob_diff_max"] < 1e-4
    assert s1["actor/grad_norm"] > 0
    documented = open(os.path.join(os.path.dirname(HERE), "docs", "metrics.md")).read()
    generic = {k.replace("/add", "/<tool>").replace("/boom", "/<tool>").replace("/slow", "/<tool>")
               .replace("/_unknown", "/<tool>") for r in rows for k in r}
    generic = {"tools/failures/<tool>/<kind>" if k.startswith("tools/failures/<tool>/") else k for k in generic}
    missing = sorted(k for k in generic if k != "step" and "/tooltest" not in k and f"`{k}`" not in documented)
    assert not missing, f"metrics missing from docs/metrics.md: {missing}"
    turns = [json.load(open(tmp_path / f"turns_rank{r}.json")) for r in range(2)]
    for t in turns[0] + turns[1]:
        mask = torch.tensor(t["mask"])
        assert len(t["turns"]) >= 1 and len(t["messages"]) >= 1 + len(t["turns"])
        if any(turn["appended"] for turn in t["turns"]):
            assert (mask == 0).any() and torch.tensor(t["logprobs"])[mask == 0].abs().sum() == 0
        assert t["response_text"] == t["turns"][-1]["text"].replace("<|im_end|>", "")


PARTIAL = {
    "colocated": {"rollout.partial": "recompute", "rollout.oversample": 1.0, "actor.ppo_mini_batch_size": 4},
    "split": {"rollout.partial": "keep", "rollout.oversample": 1.0, "actor.ppo_mini_batch_size": 4,
              "placement.mode": "split", "placement.rollout_ranks": "[0]", "placement.rollout_tp": 1,
              "trainer.max_staleness": 1, "actor.micro_batch_size": 8},
}


@pytest.mark.parametrize("mode", list(PARTIAL))
def test_grpo_with_tools_under_partial_rollouts(tool_model, tmp_path, monkeypatch, mode):
    """Partial rollouts with tools, two steps of GRPO: colocated (rollout.partial = recompute, rollout TP = 2 over
    both ranks) and asynchronous split (keep; rank 0 rolls out, rank 1 trains, max_staleness 1). A step's batch is
    taken once 4 groups of multi-turn trajectories are complete; the other groups' trajectories stay in the engine
    over the weight update and go on turn by turn, so a later step trains on tokens the previous weights sampled
    (lag 1, never more than the bound). Colocated, step 1's batch was sampled entirely by the weights it trains, so
    vLLM's per-turn log-probs of its model tokens equal the FSDP2 actor's over the whole trajectories within 1e-5
    (one fp32 forward, tool tokens as context). The turns reach the reward and the hooks (which see the tool
    results as mask-0 tokens). Colocated, the step-1 checkpoint holds the trajectories in flight (a turn cut
    mid-way, with its tokens so far, after earlier turns' tool results) and a run resumed from it logs step 2
    exactly as the straight run did."""
    import shutil

    from safetensors.torch import load_file

    from spmdrl.metrics import read_jsonl
    from spmdrl.rollout.trajectory import unpack_texts

    monkeypatch.setenv("SPMDRL_TEST_DUMP", str(tmp_path))
    extra = {**PARTIAL[mode], "rollout.parity_check": "false"}
    if mode == "colocated":
        extra.update({"checkpoint.save_freq": 1, "checkpoint.keep_last": 0})
    straight = tmp_path / "straight"
    run(["spmdrl.train", *_trainer_overrides(tool_model, straight, tmp_path / "data", **extra)], nproc=2, module=True)
    rows = read_jsonl(str(straight / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    _, s1, s2 = rows
    assert s1["rollout/requests_carried_over"] > 0
    assert max(s1["rollout/version_lag_max"], s2["rollout/version_lag_max"]) == 1
    if mode == "colocated":
        assert s1["rollout/version_lag_max"] == 0 and s2["train/weight_version_lag"] > 0
        assert s1["rollout/logprob_diff_mean"] < 1e-5 and s1["rollout/logprob_diff_max"] < 1e-4
    assert max(s1["multi_turn/turns_max"], s2["multi_turn/turns_max"]) == 3
    assert s1["tools/calls"] + s2["tools/calls"] > 0 and s1["actor/grad_norm"] > 0 and s2["actor/grad_norm"] > 0
    turns = sum((json.load(open(f)) for f in tmp_path.glob("turns_rank*.json")), [])
    called = [t for t in turns if any(turn["appended"] for turn in t["turns"])]
    assert called
    for t in called:
        mask = torch.tensor(t["mask"])
        assert (mask == 0).any() and torch.tensor(t["logprobs"])[mask == 0].abs().sum() == 0
    if mode != "colocated":
        return
    # the checkpoint after step 1 holds multi-turn trajectories in flight: a turn suspended with tokens so far
    # (partial/samples: uid, sample, kind 1 = suspended, finish, tokens), one of them after a tool result
    saved = load_file(str(straight / "checkpoints" / "step_00000001" / "rank_tensors" / "rank_0.safetensors"))
    suspended = saved["partial/samples"][saved["partial/samples"][:, 2] == 1]
    assert len(suspended) > 0 and int(suspended[:, 4].max()) > 0
    trajs = [json.loads(x) for x in unpack_texts(saved["partial/trajectories"])]
    in_flight = [t for t in trajs if not t["finish"]]
    assert len(in_flight) == len(suspended)
    assert any(t["turns"] and t["turns"][-1]["appended"] and 0 in t["mask"] for t in in_flight)
    assert len(saved["partial/trajectory_logprobs"]) == sum(len(t["ids"]) for t in trajs)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_00000002"))
    open(resumed / "metrics.jsonl", "w").writelines(
        line for line in open(straight / "metrics.jsonl") if json.loads(line)["step"] <= 1)
    monkeypatch.setenv("SPMDRL_TEST_DUMP", str(resumed))
    proc = run(["spmdrl.train", *_trainer_overrides(tool_model, resumed, tmp_path / "data", **extra)], nproc=2,
               module=True)
    assert "resumed from" in proc.stdout + proc.stderr and "not exact" not in proc.stdout + proc.stderr

    def comparable(rows):
        measured = ("timing/", "perf/", "memory/", "tools/seconds")
        return [{k: v for k, v in r.items() if not k.startswith(measured) and not k.endswith("_per_s")} for r in rows]

    again = read_jsonl(str(resumed / "metrics.jsonl"), last_per_step=True)
    assert comparable(again) == comparable(read_jsonl(str(straight / "metrics.jsonl"), last_per_step=True))
