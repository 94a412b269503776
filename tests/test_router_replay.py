"""Rollout routing replay (R3) on the FSDP2 path: vLLM's routes recorded on CPU, carried in the batch (single- and
multi-turn), replayed in the trainer's forwards (spmdrl/rollout/routes.py, spmdrl/rollout/trajectory.py,
spmdrl/engines/router_replay.py). The Trainer-level run is tests/test_model_families.py's qwen3_moe GRPO test, which
runs with actor.router_replay = "rollout"."""
import json
import os

import pytest
import torch

from launching import run

HERE = os.path.dirname(os.path.abspath(__file__))


def test_caller_keys_of_vllm_request_ids():
    from spmdrl.rollout.routes import caller_key

    assert caller_key("0_3-a025034a") == ("3", 0)
    assert caller_key("1_12-a1532008") == ("12", 1)
    assert caller_key("7-deadbeef") == ("7", 0)


def test_routes_survive_batch_moves_and_every_token_layout():
    """The batch form pads with zeros (Batch.cat, redistribute) and reads them as no route; pack_sequences puts
    sequence b's routes where its tokens are in the padded, packed and row-packed layouts, and relayout keeps them."""
    from spmdrl.batch import Batch
    from spmdrl.engines.token_batch import pack_sequences, relayout
    from spmdrl.rollout.routes import batch_routes, decode_routes

    g = torch.Generator().manual_seed(0)
    lengths, shape = [5, 9, 3], (2, 2)
    seqs = [torch.randint(0, 4, (n - 1, *shape), generator=g).numpy() for n in lengths]  # the last token has none
    a = Batch({"routed_experts": batch_routes(seqs[:2], lengths[:2])})
    b = Batch({"routed_experts": batch_routes(seqs[2:], lengths[2:])})
    both = Batch.cat([b, a])  # b is narrower: zero padded to a's width
    order = [2, 0, 1]
    decoded = [decode_routes(both["routed_experts"][i], lengths[k], shape) for i, k in enumerate(order)]
    for d, k in zip(decoded, order):
        assert torch.equal(d[:-1], torch.from_numpy(seqs[k]).long()) and (d[-1] == -1).all()
    prompts = [torch.arange(2), torch.arange(4), torch.arange(1)]
    resps = [torch.arange(n - len(p)) + 10 for n, p in zip(lengths, prompts)]
    routes = [decode_routes(batch_routes([s], [n])[0], n, shape) for s, n in zip(seqs, lengths)]
    for kw in (dict(), dict(packed=True), dict(packed=True, row_len=10)):
        tb = pack_sequences(prompts, resps, 0, routes=routes, **kw)
        ids, placed = tb.input_ids, tb.routes
        for i, (p, r) in enumerate(zip(prompts, resps)):
            seq = torch.cat([p, r])
            hits = [(row, col) for row in range(ids.shape[0]) for col in range(ids.shape[1] - len(seq) + 1)
                    if torch.equal(ids[row, col: col + len(seq)], seq)]
            row, col = hits[0]
            assert torch.equal(placed[row, col: col + len(seq)], routes[i]), kw
        assert int((placed >= 0).all(-1).all(-1).sum()) == sum(n - 1 for n in lengths), kw  # nothing else
    moved = relayout(pack_sequences(prompts, resps, 0, routes=routes, packed=True), packed=False)
    for i, n in enumerate(lengths):
        assert torch.equal(moved.routes[i, :n], routes[i])


def test_a_trajectory_keeps_the_routes_of_the_first_turn_that_computed_each_position():
    """Turn 1's request computes prompt + its response but the last token; turn 2's recomputes all of that (here
    with one position routed differently, as a prefill over another batch could), the glue and its own response
    but the last token, and ran one token past the response budget. The trajectory keeps turn 1's routes where
    turn 1 computed, turn 2's beyond, nothing past its end; the batch marks the last token NO_ROUTE."""
    import numpy as np

    from spmdrl.loop.generate import trajectories_to_batch
    from spmdrl.rollout.routes import NO_ROUTE, decode_routes
    from spmdrl.rollout.trajectory import Trajectory

    shape = (2, 2)
    t = Trajectory(prompt=[1, 2, 3], messages=[], seed=0, sample=0)
    t.ids += [4, 5, 6]  # turn 1's sampled tokens
    turn1 = np.arange(5 * 4).reshape(5, *shape) % 7  # positions 0..4
    t.add_turn_routes(turn1)
    t.ids += [7, 8] + [9, 10]  # glue, then turn 2's tokens (cut to the budget)
    turn2 = (np.arange(11 * 4).reshape(11, *shape) + 3) % 7  # positions 0..10: one past the trajectory's end
    turn2[:5] = turn1
    turn2[2, 1, 0] = (turn1[2, 1, 0] + 1) % 7  # a recomputed position routed differently
    t.add_turn_routes(turn2)
    assert t.routes.shape == (10, *shape)
    assert np.array_equal(t.routes[:5], turn1) and np.array_equal(t.routes[5:], turn2[5:10])
    batch = trajectories_to_batch([t, Trajectory(prompt=[1], messages=[], seed=0, sample=0, ids=[2])], [0, 1], 1, 0)
    got = decode_routes(batch["routed_experts"][0], 10, shape)
    assert torch.equal(got, torch.from_numpy(t.routes).long())
    assert (decode_routes(batch["routed_experts"][1], 2, shape) == NO_ROUTE).all()  # a trajectory without routes


ARCHS = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def replay_runs(tmp_path_factory):
    """One 2-rank launch of tests/dist_scripts/router_replay.py: the tiny Qwen3-MoE and Mixtral single-turn, then
    the multi-turn tool model (tests/tool_agent.py's scripts a and b, memorised by a tiny Qwen3-MoE)."""
    from spmdrl.tiny import build_tiny
    from tool_agent import build_tool_model

    root = tmp_path_factory.mktemp("router_replay")
    models = [build_tiny(str(root / arch), seed=0, arch=arch, num_layers=2) for arch in ARCHS]
    tool_model = build_tool_model(str(root / "tool_moe"), arch="qwen3_moe", letters="ab")
    run([os.path.join(HERE, "dist_scripts", "router_replay.py"), str(root), *models, "--multi-turn", tool_model],
        nproc=2, timeout=600)
    return root


def results(root, name: str) -> dict:
    res = json.load(open(root / f"{name}.rank0.json"))
    assert res == json.load(open(root / f"{name}.rank1.json"))  # summed over the dp ranks: the same on both
    return res


@pytest.mark.dist
def test_replay_makes_the_trainers_routing_vllms(replay_runs):
    """Tiny Qwen3-MoE and Mixtral, 2 ranks, vLLM at rollout TP = 2 recording routes, the FSDP2 actor at dp = 2,
    packed and padded passes:
    - vLLM's routes cover every position it computed (prompt + response - 1 per sample, x layers x top_k);
    - the trainer's own router agrees with them on every (token, layer, k) choice, and its log-probs are vLLM's
      within 1e-5, with and without replay;
    - a trainer router perturbed to pick other experts disagrees (agreement < 0.5, gap > 1e-2) without replay; with
      replay the routing it computes with is vLLM's (route agreement 1.0) and the gap is back under 1e-5 while its
      own router still disagrees."""
    for arch in ARCHS:
        check_cases(arch, results(replay_runs, arch))


@pytest.mark.dist
def test_every_tp_rank_gets_the_routes_on_model_runner_v2(replay_runs):
    """vLLM's CUDA runner (Model Runner V2) keeps the routes on TP rank 0 only while each rank's scheduler asserts
    them; the script builds that configuration on the CPU engine at rollout TP = 2 (as_model_runner_v2) and
    generates 3 prompts x 2 samples: both ranks' completions carry routes, each rank 0's routes of that completion
    over every position vLLM computed. Without share_first_rank_routes, rank 1's scheduler raises AssertionError
    ("auxiliary output worker output is missing") at the first generated token."""
    for arch in ARCHS:
        got = results(replay_runs, arch)["model_runner_v2"]
        assert got == {"completions": 6, "with_routes": 6, "rank0_routes": 6}, (arch, got)


@pytest.mark.dist
def test_a_request_carried_over_a_weight_update_keeps_its_routes_as_generated(replay_runs):
    """Partial rollouts: 3 requests stepped 4 times, new weights (every router's experts reversed) loaded between
    two engine steps, then stepped to the end, in keep and in recompute mode (rebuild_kv: vLLM prefills every
    request again with the new weights). Each request's routes are, position by position, transformers' routing
    as the position was first computed: the old model's before the update, the new model's after (over the old
    model's cache in keep mode, over the whole sequence in recompute mode). Route agreement 1.0, in both modes;
    in recompute mode the new weights route the earlier positions differently when prefilling them again, so
    keeping the second prefill's routes would fail it."""
    for arch in ARCHS:
        carried = results(replay_runs, arch)["carried_over"]
        for mode, c in carried.items():
            assert c["carried"] == 3 and c["agree"] == c["positions"] > c["before_update"] > 0, (arch, mode, c)
        assert carried["recompute"]["prefix_routed_differently"] > 0, (arch, carried)


@pytest.mark.dist
def test_multi_turn_trajectories_replay_the_routes_of_every_turn(replay_runs):
    """A multi-turn rollout on real vLLM (TP = 2, routes recorded) with a real tool: prompt a calls the tool in each
    of its 3 turns (two tool outputs go into the sequence), prompt b answers at once. Each trajectory's routes
    (trajectories_to_batch's routed_experts) are, position by position, those of the first turn whose request
    computed the position (a composition made in the script from every turn's recorded routes) and cover every
    position some turn computed: all but the last token. The FSDP2 actor at dp = 2 then gives vLLM's log-prob
    within 1e-5 on every model token of every turn, with and without replay; with its routers perturbed the gap
    is > 1e-2 in every turn without replay and back under 1e-5 in every turn with it.

    The later turns recompute the history with the same weights and tokens: the script counts the recomputed
    positions they routed differently from the turn before (none, on CPU in fp32), so here the first and the
    last turn's routes coincide; Trajectory.add_turn_routes says why the first is the one to keep."""
    res = results(replay_runs, "tool_moe")
    assert res["finish"] == ["turn_limit", "answer"] and res["tool_turns"] == [2, 0], res["finish"]
    assert res["recomputed_positions"] > 0 and res["recomputed_differ"] == 0
    for t in res["trajs"]:
        assert t["equals_first"], t
        assert t["routed_positions"] == t["computed"] == t["length"] - 1 and t["unrouted_positions"] == 1, t
    assert [t["requests"] for t in res["trajs"]] == [3, 1]
    check_cases("tool_moe", res)
    for name, c in res["cases"].items():
        turns = [g for g in c["turn_gaps"] if g >= 0]
        assert len(turns) == 3, (name, c)
        if name.startswith("perturbed") and "replay=False" in name:
            assert min(turns) > 1e-2, (name, c)
        else:
            assert max(turns) < 1e-5, (name, c)


def check_cases(arch: str, res: dict) -> None:
    for name, c in res["cases"].items():
        label = (arch, name, c)
        assert c["routed"] == res["routed_expected"] > 0, label
        if not name.startswith("perturbed"):
            assert c["agree_own"] == c["agree_used"] == c["routed"], label
            assert c["gap"] < 1e-5, label
        elif "replay=False" in name:
            assert c["agree_own"] == c["agree_used"] < 0.5 * c["routed"], label
            assert c["gap"] > 1e-2, label
        else:
            assert c["agree_used"] == c["routed"] and c["agree_own"] < 0.5 * c["routed"], label
            assert c["gap"] < 1e-5, label


def test_router_losses_equal_a_float64_reference_in_value_and_gradient(tmp_path):
    """The FSDP2 engine's load-balancing and z-loss of a packed batch (summed over the MoE layers), and the router
    weights' gradient of 0.5 * aux + 2 * z, against the same formulas in float64 on transformers' own router logits
    (output_router_logits) of an unsharded float64 copy, computed over the real tokens of a padded batch."""
    from transformers import AutoModelForCausalLM

    from launching import world_of_one
    from spmdrl.config import load_config
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines.fsdp import FSDPEngine
    from spmdrl.engines.router_replay import moe_routers
    from spmdrl.engines.token_batch import pack_sequences
    from spmdrl.tiny import build_tiny

    model = build_tiny(str(tmp_path / "qwen3_moe"), seed=0, arch="qwen3_moe", num_layers=2)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 300, (n,), generator=g) for n in (7, 12, 4)]
    with world_of_one():
        mesh = RoleMeshes(plan_layout(load_config(None, [f"model.path={model}"]).placement, 1), 0, "cpu")["actor"]
        engine = FSDPEngine(model, mesh, torch.device("cpu"), trainable=True, router_losses=True)
        engine.module.train()
        tb = pack_sequences([s[:2] for s in seqs], [s[2:] for s in seqs], 0, packed=True)
        engine.logprobs(tb)
        aux_t, z_t = engine.moe_losses()
        (0.5 * aux_t + 2 * z_t).backward()
        aux, z = float(aux_t.detach()), float(z_t.detach())
        grads = [gate.weight.grad.full_tensor().double() for _, gate in moe_routers(engine.hf)]

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64, experts_implementation="eager")
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    out = ref(input_ids=ids, attention_mask=mask, output_router_logits=True)
    real = mask.reshape(-1).bool()
    E, k = ref.config.num_experts, ref.config.num_experts_per_tok
    ref_aux = ref_z = 0.0
    for logits in out.router_logits:
        lg = logits[real]
        p = torch.softmax(lg, dim=-1)
        f = torch.nn.functional.one_hot(p.topk(k, dim=-1).indices, E).sum((0, 1)).double() / (lg.shape[0] * k)
        ref_aux = ref_aux + E * (f * p.mean(0)).sum()
        ref_z = ref_z + torch.logsumexp(lg, dim=-1).square().mean()
    (0.5 * ref_aux + 2 * ref_z).backward()
    ref_aux, ref_z = ref_aux.detach(), ref_z.detach()
    assert abs(aux - float(ref_aux)) < 1e-5 * float(ref_aux) and abs(z - float(ref_z)) < 1e-5 * float(ref_z)
    for got, (_, gate) in zip(grads, moe_routers(ref)):
        assert torch.allclose(got, gate.weight.grad, rtol=1e-4, atol=1e-7), float((got - gate.weight.grad).abs().max())
