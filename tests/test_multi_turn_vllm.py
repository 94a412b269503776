"""The multi-turn agent loop on real vLLM under torchrun (tests/dist_scripts/multi_turn_rollout.py): rollout
TP=2 and rollout DP=2 over two ranks, with a model that has memorised scripted tool conversations
(tests/tool_agent.py). One launch per layout (module-scoped fixtures)."""
import json
import os

import pytest
import torch

pytest.importorskip("vllm")

from launching import run  # noqa: E402
from spmdrl.rollout.multi_turn import turn_seed  # noqa: E402
from tool_agent import build_tool_model  # noqa: E402

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dist_scripts", "multi_turn_rollout.py")


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    return build_tool_model(str(tmp_path_factory.getbasetemp() / "tool_model"))


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
    vLLM returned for that trajectory's requests; the rest of the sequence is glue with mask 0."""
    for res in (tp2[0], dp2[0], dp2[1]):
        seeded = res["seeded"]
        trajs = seeded["trajs"]
        assert seeded["batch_responses"] == [t["ids"] for t in trajs]
        assert seeded["batch_mask"] == [[float(m) for m in t["mask"]] for t in trajs]
        for t in trajs:
            sampled, pos = [], 0
            for turn, call in enumerate(seeded["generate_calls"]):
                request = (t["prompt"] + t["ids"][:pos], turn_seed(t["seed"], t["sample"], turn))
                requests = list(zip(call["prompts"], call["seeds"]))
                if request in requests:  # this trajectory's request in that turn
                    ids = call["ids"][requests.index(request)][: 300 - pos]
                    assert t["ids"][pos: pos + len(ids)] == ids
                    assert t["mask"][pos: pos + len(ids)] == [1] * len(ids)
                    sampled += ids
                    pos += len(ids)
                    while pos < len(t["ids"]) and t["mask"][pos] == 0:
                        pos += 1
            assert pos == len(t["ids"]) and sampled == [i for i, m in zip(t["ids"], t["mask"]) if m]


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
