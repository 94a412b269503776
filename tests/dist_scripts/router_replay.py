"""Rollout routing replay on tiny MoE models (one after another in one process group), 2 ranks: real vLLM at
rollout TP = 2 records the experts it routes each token to; the batch goes the real way (rollout_to_batch, or with
--multi-turn the agent loop with a real tool and trajectories_to_batch; then redistribute to the actor's dp = 2);
the FSDP2 actor's log-prob passes (forward_all, packed and padded) run without and with replay. Then every trainer
router is perturbed (a hook ahead of the replay hook shifts its top-k choice to other experts) and both passes run
again. Writes OUT/<model dir name>.rank{r}.json with, per case, the router counts summed over the dp ranks and the
largest |actor - vLLM| log-prob gap, overall and per turn (the model tokens between two tool outputs).

The multi-turn model (tests/tool_agent.py, built as a tiny Qwen3-MoE) calls a tool in every turn for prompt "a"
and answers at once for "b". Its result also holds each trajectory's routes checked against a composition made
here from every turn's recorded routes: each position takes the routes of the first turn whose request computed
it ("first"), or of the last ("last"), and how many recomputed positions a later turn routed differently.

torchrun --nproc-per-node 2 router_replay.py OUT MODEL_DIR [MODEL_DIR ...] [--multi-turn TOOL_MODEL_DIR]
"""
import copy
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: tool_agent


def turn_index(mask: torch.Tensor) -> torch.Tensor:
    """[B, R] response mask -> the turn (0, 1, ...) of each model token: a new turn starts after every run of
    mask-0 (tool/glue) tokens."""
    starts = (mask > 0) & torch.cat([torch.ones_like(mask[:, :1], dtype=torch.bool), mask[:, :-1] == 0], 1)
    return starts.long().cumsum(1) - 1


class Measure:
    """The actor's log-prob passes over one batch, with and without replay, router counts summed over dp."""

    def __init__(self, actor, batch, shape, dp, pad_id):
        self.actor, self.batch, self.shape, self.dp, self.pad_id = actor, batch, shape, dp, pad_id

    def case(self, replay: bool, packed: bool) -> dict:
        from spmdrl.dist.collectives import reduce_max, reduce_sum
        from spmdrl.loop.update import forward_all

        batch = self.batch
        self.actor.router.replay = replay
        lp = forward_all(self.actor, batch, 2, self.pad_id, "logprobs", packed=packed, route_shape=self.shape)
        mask = batch["response_mask"].bool()
        diff = (lp - batch["rollout_log_probs"]).abs()
        turns = turn_index(batch["response_mask"])
        turn_gaps = torch.full((4,), -1.0)
        for k in range(4):
            sel = mask & (turns == k)
            if sel.any():
                turn_gaps[k] = float(diff[sel].max())
        counts = self.actor.moe_counts()
        summed = reduce_sum(torch.stack([counts["agree_own"], counts["agree_used"], counts["routed"]]), group=self.dp)
        return {"agree_own": float(summed[0]), "agree_used": float(summed[1]), "routed": float(summed[2]),
                "gap": float(reduce_max(torch.tensor([float(diff[mask].max())]), group=self.dp)[0]),
                "turn_gaps": [float(x) for x in reduce_max(turn_gaps, group=self.dp)]}

    def all_cases(self) -> dict:
        """Every case: replay off / on, packed / padded, with the router as it is, then perturbed."""
        cases = {}
        for prefix in ("", "perturbed,"):
            if prefix:
                self.perturb()
            for replay in (False, True):
                for packed in (True, False):
                    cases[f"{prefix}replay={replay},packed={packed}"] = self.case(replay, packed)
        return cases

    def perturb(self) -> None:
        """From now on every trainer router picks the next experts instead of its own."""
        from spmdrl.engines.router_replay import moe_routers

        experts = self.actor.router.num_experts

        def shift(module, args, output):
            logits, weights, idx = output
            return logits, weights, (idx + 1) % experts

        for _, gate in moe_routers(self.actor.hf):
            gate.register_forward_hook(shift, prepend=True)


def setup(path: str, *, max_model_len: int, kv_cache_gb: float):
    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine
    from spmdrl.rollout import build_engine

    meshes = RoleMeshes(plan_layout(PlacementConfig(rollout_tp=2), 2), dist.get_rank(), "cpu")
    actor = build_train_engine("fsdp", path, meshes["actor"], torch.device("cpu"), trainable=True, router_replay=True)
    rollout = build_engine("vllm", model_path=path, tp_size=2, tp_group=meshes["rollout"].my_tp_group(),
                           max_model_len=max_model_len, seed=0, kv_cache_gb=kv_cache_gb, capture_routes=True)
    return meshes, actor, rollout


def write(out: str, path: str, result: dict) -> None:
    with open(os.path.join(out, f"{os.path.basename(path)}.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


def one_model(path: str, out: str) -> None:
    from spmdrl.dist.collectives import redistribute
    from spmdrl.loop.generate import rollout_to_batch
    from spmdrl.rollout import SamplingSpec
    from spmdrl.rollout.routes import route_shape

    meshes, actor, rollout = setup(path, max_model_len=128, kv_cache_gb=0.05)
    prompts = [[5, 40, 77, 12, 9], [6, 43, 77], [7, 8, 9, 10, 11, 12, 13]]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=10)
    res = rollout.generate(prompts, spec, [11, 12, 13])
    batch = rollout_to_batch(prompts, [0, 1, 2], res, spec.n, 0)
    computed = sum(len(prompts[i // spec.n]) + len(r) - 1 for i, r in enumerate(res.response_ids))  # positions vLLM ran
    batch = redistribute(batch, meshes["rollout"], meshes["actor"])
    shape = route_shape(actor.hf_config())
    m = Measure(actor, batch, shape, meshes["actor"].group("dp"), 0)
    result = {"routed_expected": computed * shape[0] * shape[1], "top_k": shape[1]}
    result["cases"] = m.all_cases()
    result["carried_over"] = {mode: carried_over_routes(rollout, path, prompts, mode) for mode in ("keep", "recompute")}
    result["model_runner_v2"] = routes_as_on_cuda(rollout, prompts)
    write(out, path, result)
    rollout.close()


def hf_routes(model, ids: list[int], top_k: int, past=None) -> tuple[np.ndarray, object]:
    """transformers' own routing of `ids` (after the cached `past`, if any): the top-k experts of every layer's
    router logits, sorted, int [positions, layers, top_k]; and the cache after them."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True, output_router_logits=True)
    routes = np.stack([lg.topk(top_k, dim=-1).indices.sort(-1).values.numpy() for lg in out.router_logits], 1)
    return routes, out.past_key_values


def carried_over_routes(rollout, path: str, prompts, mode: str) -> dict:
    """Requests carried over a weight update (rollout.partial = `mode`): 3 requests admitted and stepped 4 times
    with the checkpoint's weights (version 0), then new weights loaded between two engine steps (every router's
    expert rows reversed: other experts) as version 1, with `rebuild_kv` in recompute mode, then stepped to the
    end. Each position's routes vLLM returned are compared with transformers' routing of the same tokens as each
    position was computed: positions computed before the update (prompt + version-0 tokens but the last) by the
    old model; the rest by the new model, after the old model's cache of the earlier positions (keep: vLLM kept
    their keys and values) or over the whole sequence (recompute: vLLM prefilled it again with the new weights).
    `prefix_routed_differently`: earlier positions whose routes the new weights change (what a recomputed
    request would show, were the routes of its second prefill kept)."""
    from transformers import AutoModelForCausalLM

    from spmdrl.engines.router_replay import moe_routers
    from spmdrl.rollout import SamplingSpec

    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    new = copy.deepcopy(old)
    with torch.no_grad():
        for _, gate in moe_routers(new):
            gate.weight.copy_(gate.weight.flip(0))
    top_k = int(old.config.num_experts_per_tok)
    rollout.update_weights(old.state_dict().items())  # version 0: the checkpoint's (again, for the second mode)
    rollout.finish_weight_update()
    rollout.weight_version = 0
    ids = [f"carry-{mode}/{i}" for i in range(len(prompts))]
    rollout.admit(ids, prompts, SamplingSpec(n=1, temperature=1.0, max_tokens=12), [31 + i for i in range(len(prompts))])
    done = {}
    for _ in range(4):
        done.update({c.id: c for c in rollout.step()})
    rollout.update_weights(new.state_dict().items())
    rollout.finish_weight_update()
    rollout.weight_version = 1
    if mode == "recompute":
        rollout.rebuild_kv()
    while rollout.in_flight:
        done.update({c.id: c for c in rollout.step()})
    res = {"carried": 0, "positions": 0, "agree": 0, "before_update": 0, "prefix_routed_differently": 0}
    for rid, p in zip(ids, prompts):
        c = done[rid]
        seq = list(p) + c.token_ids
        u = len(p) + c.versions.count(0) - 1  # positions computed before the update
        if c.versions.count(0) == 0 or c.versions.count(1) == 0:
            continue
        res["carried"] += 1
        ref_old, past = hf_routes(old, seq[:u], top_k)
        if mode == "keep":
            ref_new, _ = hf_routes(new, seq[u:-1], top_k, past)
        else:
            full, _ = hf_routes(new, seq[:-1], top_k)
            ref_new = full[u:]
            res["prefix_routed_differently"] += int((full[:u] != ref_old).any(-1).any(-1).sum())
        want = np.concatenate([ref_old, ref_new])
        got = np.sort(np.asarray(c.routes)[: len(seq) - 1], -1)
        res["positions"] += len(want)
        res["before_update"] += u
        res["agree"] += int((got == want).all(-1).all(-1).sum()) if got.shape == want.shape else 0
    return res


def as_model_runner_v2(rollout) -> None:
    """The route path of vLLM's CUDA runner (Model Runner V2), built on this CPU engine at TP = 2: every rank's
    scheduler gets the route connector vLLM gives it when routes are returned (v1/core/sched/scheduler.py:423-426),
    the engine shares rank 0's routes as it does on CUDA (share_first_rank_routes), and only TP rank 0's step output
    carries routes (aux_output_connector/worker.py:110-112), each step's as V2's worker connector emits them for a
    request that sampled: the rows from its emit cursor to its last computed position, taken here from this rank's
    CPU route recorder."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector, AuxRequestOutput

    from spmdrl.rollout.routes import NO_ROUTE, share_first_rank_routes

    scheduler = rollout.llm.llm_engine.engine_core.engine_core.scheduler
    scheduler.aux_output_connector = AuxOutputSchedulerConnector()
    assert share_first_rank_routes(rollout.llm)
    if rollout.tp_rank != 0:
        return
    recorder = rollout.llm.collective_rpc(lambda worker: worker.spmdrl_routes)[0]
    update, emitted = scheduler.update_from_output, {}

    def update_from_output(scheduler_output, model_runner_output):
        aux = {}
        for rid, sampled in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            chunks = recorder.by_request.get(rid, [])
            end = max((p + len(r) for p, r in chunks), default=0)
            if not sampled or not end:
                continue
            rows = np.full((end, recorder.num_layers, recorder.top_k), NO_ROUTE, dtype=np.int16)
            for p, r in chunks:
                rows[p: p + len(r)] = r
            start = emitted.get(rid, 0)
            aux[rid], emitted[rid] = AuxRequestOutput(start, rows[start:]), end
        if aux:
            model_runner_output = copy.copy(model_runner_output)  # may be vLLM's shared empty output
            model_runner_output.aux_output_connector_output = aux
        return update(scheduler_output, model_runner_output)

    scheduler.update_from_output = update_from_output


def routes_as_on_cuda(rollout, prompts) -> dict:
    """One sampled generate through the Model Runner V2 route path (as_model_runner_v2): per completion, whether this
    rank's completion carries routes, and whether they are rank 0's recorded routes of that completion, position by
    position over every position vLLM computed (prompt + response - 1)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    as_model_runner_v2(rollout)
    torch.manual_seed(5)  # the same draws on both ranks
    outs = rollout.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                SamplingParams(n=2, temperature=1.0, max_tokens=6), use_tqdm=False)
    from spmdrl.rollout import routes

    # this rank's CPU recorder, read directly (the engine keeps only its own admitted requests' routes; these
    # requests went to LLM.generate around it): {(caller id, sample): routes}
    recorded = rollout.llm.collective_rpc(routes.take)[0]
    reference = [recorded] if rollout.tp_rank == 0 else [None]
    dist.broadcast_object_list(reference, src=dist.get_global_rank(dist.group.WORLD, 0))
    got = {"completions": 0, "with_routes": 0, "rank0_routes": 0}
    for out, p in zip(outs, prompts):
        for c in out.outputs:
            got["completions"] += 1
            mine = c.routed_experts
            if mine is None:
                continue
            got["with_routes"] += 1
            want = reference[0][(str(out.request_id), int(c.index))]
            n = len(p) + len(c.token_ids) - 1
            got["rank0_routes"] += int(len(mine) == len(want) == n and np.array_equal(np.asarray(mine), want))
    return got


class Recording:
    """The rollout engine, with each request's prompt and recorded routes kept (in the order they finished)."""

    def __init__(self, engine):
        self.engine, self.requests, self._prompts = engine, [], {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def admit(self, ids, prompts, spec, seeds):
        self.engine.admit(ids, prompts, spec, seeds)
        self._prompts.update({i: list(p) for i, p in zip(ids, prompts)})

    def step(self):
        out = self.engine.step()
        self.requests += [(self._prompts.pop(c.id), None if c.routes is None else np.asarray(c.routes).copy())
                          for c in out]
        return out


def composed(traj, requests, length, shape, first: bool) -> tuple[np.ndarray, list[np.ndarray]]:
    """The reference routes of one trajectory, each position taking the routes of the first (or last) of its
    requests that computed it, and those requests' routes in turn order (its requests: those whose prompt is
    the trajectory's prompt and a part of what followed; the two test prompts differ)."""
    out = np.full((length, *shape), -1, dtype=np.int64)
    seq = traj.prompt + traj.ids
    mine = [r for p, r in sorted((x for x in requests if x[0] == seq[: len(x[0])] and len(x[0]) >= len(traj.prompt)),
                                 key=lambda x: len(x[0]))]
    for r in (reversed(mine) if first else mine):
        n = min(length, len(r))
        out[:n] = r[:n]
    return out, mine


def multi_turn_model(path: str, out: str) -> None:
    from spmdrl.dist.collectives import redistribute
    from spmdrl.loop.generate import trajectories_to_batch
    from spmdrl.rollout import SamplingSpec
    from spmdrl.rollout.chat import ChatGlue
    from spmdrl.rollout.multi_turn import AgentLoop, TurnLimits
    from spmdrl.rollout.routes import decode_routes, route_shape
    from tool_agent import SCHEMAS, prompt_messages, runner

    meshes, actor, rollout = setup(path, max_model_len=512, kv_cache_gb=0.2)
    tok = rollout.tokenizer
    shape = route_shape(actor.hf_config())
    letters = ["a", "b"]
    msgs = [prompt_messages(x) for x in letters]
    ids = [tok.encode(tok.apply_chat_template(m, tools=SCHEMAS, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False) for m in msgs]
    engine = Recording(rollout)
    loop = AgentLoop(engine, ChatGlue(tok, SCHEMAS), runner(), TurnLimits(max_turns=3, max_response_tokens=300),
                     tp_group=dist.group.WORLD)
    # greedy: the scripts play out whenever the memorised token is the most likely one; the log-probs are then
    # the raw ones (temperature 1), what the actor's pass computes
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=300, stop_token_ids=[tok.eos_token_id])
    trajs = loop.run(ids, msgs, [21, 22], spec)
    batch = trajectories_to_batch(trajs, [0, 1], spec.n, tok.pad_token_id)
    result = {"finish": [t.finish for t in trajs], "tool_turns": [sum(t.appended for t in t.turns) for t in trajs],
              "top_k": shape[1], "trajs": [], "cases": {}}
    recomputed = differ = 0
    for i, t in enumerate(trajs):
        length = len(t.prompt) + len(t.ids)
        got = decode_routes(batch["routed_experts"][i], length, shape).numpy()
        first, requests = composed(t, engine.requests, length, shape, True)
        last, _ = composed(t, engine.requests, length, shape, False)
        for k, r in enumerate(requests[1:], 1):  # positions a later request computed again
            n = min(len(r), len(requests[k - 1]), length)
            recomputed += n
            differ += int((r[:n] != np.asarray(requests[k - 1])[:n]).any(-1).any(-1).sum())
        computed = min(length, max(len(r) for r in requests))
        result["trajs"].append({
            "length": length, "computed": computed, "requests": len(requests),
            "routed_positions": int((got >= 0).all(-1).all(-1).sum()),
            "unrouted_positions": int((got < 0).all(-1).all(-1).sum()),
            "equals_first": bool((got == first).all()), "equals_last": bool((got == last).all())})
    result["recomputed_positions"], result["recomputed_differ"] = recomputed, differ
    result["routed_expected"] = sum(x["computed"] for x in result["trajs"]) * shape[0] * shape[1]
    batch = redistribute(batch, meshes["rollout"], meshes["actor"])
    m = Measure(actor, batch, shape, meshes["actor"].group("dp"), tok.pad_token_id)
    result["cases"] = m.all_cases()
    write(out, path, result)
    rollout.close()


def main(out: str, *args: str) -> int:
    paths = list(args)
    tool_model = None
    if "--multi-turn" in paths:
        k = paths.index("--multi-turn")
        tool_model = paths.pop(k + 1)
        paths.pop(k)
    dist.init_process_group("gloo")
    for path in paths:
        one_model(path, out)
        dist.barrier()
    if tool_model is not None:
        multi_turn_model(tool_model, out)
        dist.barrier()
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main(*sys.argv[1:]))
