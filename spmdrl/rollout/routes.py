"""The experts an in-process vLLM routed each token to, per layer and top-k choice (rollout routing replay).

On CPU, vLLM 0.32 cannot return routes itself (`enable_return_routed_experts` needs Model Runner V2, which needs
Triton), so spmdrl records them in the worker that lives in this process:

- every MoE layer's router (vLLM's `BaseRouter`) gets a capture callback, the hook vLLM's own route return
  binds: it is called with the logical top-k expert ids [tokens, top_k] of every forward;
- the model runner's `_model_forward` is wrapped to note, before each forward, which requests the flattened
  tokens belong to (`input_batch.req_ids`, `query_start_loc`) and where each request's tokens start in its
  sequence (`num_computed_tokens`);
- after the forward the routes are filed per request and sequence position.

A request's routes cover every position the engine computed: the prompt, and each sampled token but the last
(which is never fed back). A position computed twice (vLLM preempted the request and prefilled it again, as
`rebuild_kv` makes it do after a weight update) keeps the routes of its first computation (merge_routes). With prefix caching on, a request whose prompt hits the cache would not compute those
positions, so an engine that records routes is built without it (`VLLMEngine(capture_routes=True)`).

vLLM names a request `<id>-<8 random chars>` and the samples of an n > 1 request `<k>_<id>-<random>`; `take`
maps them back to (the caller's request id, sample index).

On CUDA the engine asks vLLM for the routes instead (`enable_return_routed_experts`, a completion's
`routed_experts`); docs/architecture.md's GPU table says what has run. vLLM's CUDA model runner (Model Runner
V2) keeps the routes on the first rank of a TP group only, while every rank's scheduler expects them:
`share_first_rank_routes` hands them to the other ranks.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

NO_ROUTE = -1  # a position the rollout engine never computed (a sequence's last token)


class RouteRecorder:
    """Lives on the vLLM worker (installed by `install`); files each forward's routes by request and position."""

    def __init__(self, num_layers: int, top_k: int):
        self.num_layers, self.top_k = num_layers, top_k
        self.by_request: dict[str, list[tuple[int, np.ndarray]]] = {}  # request id -> (first position, routes)
        self._step: tuple | None = None  # (request ids, query start offsets, first positions) of this forward
        self._layers: dict[int, torch.Tensor] = {}

    def begin(self, req_ids: list[str], query_start: np.ndarray, first_pos: np.ndarray) -> None:
        self._step, self._layers = (req_ids, query_start, first_pos), {}

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._layers[layer] = topk_ids.detach().to("cpu", torch.int16)

    def end(self) -> None:
        if self._step is None or not self._layers:
            return
        req_ids, qs, first = self._step
        n = int(qs[-1])
        routes = np.full((n, self.num_layers, self.top_k), NO_ROUTE, dtype=np.int16)
        for layer, ids in self._layers.items():
            routes[:, layer] = ids[:n].numpy()
        for i, rid in enumerate(req_ids):
            self.by_request.setdefault(rid, []).append((int(first[i]), routes[int(qs[i]): int(qs[i + 1])]))
        self._step = None

    def take(self) -> dict[tuple[str, int], np.ndarray]:
        """{(request id as the caller gave it, sample index): [positions, layers, top_k] int16} of every request
        since the last take, positions 0.. up to the last computed one (NO_ROUTE where a position is missing)."""
        out = {}
        for rid, chunks in self.by_request.items():
            length = max(p + len(r) for p, r in chunks)
            routes = np.full((length, self.num_layers, self.top_k), NO_ROUTE, dtype=np.int16)
            for pos, r in reversed(chunks):  # a position computed again keeps its FIRST routes (merge_routes)
                routes[pos: pos + len(r)] = r
            out[caller_key(rid)] = routes
        self.by_request = {}
        return out


def caller_key(internal_id: str) -> tuple[str, int]:
    """vLLM's internal request id -> (the id the caller gave, sample index): `<k>_<id>-<rand>` for sample k of an
    n > 1 request, `<id>-<rand>` otherwise (spmdrl's request ids are LLM.generate's counters: digits only)."""
    body = internal_id.rsplit("-", 1)[0]
    if "_" in body:
        k, parent = body.split("_", 1)
        return parent.rsplit("-", 1)[0], int(k)
    return body, 0


def merge_routes(old, new):
    """One request's routes recorded in two windows (RouteRecorder.take before and after): `old` wherever it has a
    route, `new` elsewhere, over the longer of the two.

    A position keeps the routes of the forward that first computed it: the token after it was sampled from that
    forward (the routes "as generated"). A request computes a position again when vLLM preempts it and prefills
    it again, which `rebuild_kv` does on purpose after a weight update (rollout.partial = "recompute"): the
    positions before the update keep the old weights' routes, those after get the new weights'."""
    if old is None:
        return new
    out = np.full((max(len(old), len(new)), *new.shape[1:]), NO_ROUTE, dtype=np.int16)
    out[: len(new)] = new
    seen = old != NO_ROUTE
    out[: len(old)][seen] = old[seen]
    return out


def install(worker) -> tuple[int, int]:
    """On the worker (collective_rpc): bind a RouteRecorder to every MoE router of the model and wrap the runner's
    forward. Returns (MoE layers, top_k); (0, 0) when the model has no MoE router vLLM can call back from."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runner = worker.model_runner
    model = runner.get_model()
    moe = [m for m in model.modules() if isinstance(m, MoERunner)]
    if not moe or not all(isinstance(m.router, BaseRouter) for m in moe):
        return 0, 0
    num_layers = worker.vllm_config.model_config.get_total_num_hidden_layers()
    recorder = RouteRecorder(num_layers, int(moe[0].router.top_k))
    for m in moe:
        m.router.set_capture_fn(lambda ids, layer=m.layer_id: recorder.capture(layer, ids))
    forward = runner._model_forward

    def recording_forward(*args, **kwargs):
        n = runner.input_batch.num_reqs
        recorder.begin(list(runner.input_batch.req_ids[:n]), runner.query_start_loc.cpu[: n + 1].numpy().copy(),
                       runner.input_batch.num_computed_tokens_cpu[:n].copy())
        out = forward(*args, **kwargs)
        recorder.end()
        return out

    runner._model_forward = recording_forward
    worker.spmdrl_routes = recorder
    return num_layers, recorder.top_k


def share_first_rank_routes(llm) -> bool:
    """Give every rank of the engine's TP group the routes its first rank collected; True when installed.

    vLLM 0.32's Model Runner V2 buffers the routed experts on TP rank 0 only (its worker connector returns before
    building a buffer on the others: vllm/distributed/aux_output_connector/worker.py:110-112). Under
    external_launcher every TP rank runs its own scheduler, and each one takes every emitting request's routes out of
    its own step output and asserts that they are there (connector.py:112, called from
    v1/core/sched/scheduler.py:2203-2205): ranks 1.. would raise at the first generated token. The scheduler's
    `update_from_output` is wrapped so that each step first broadcasts rank 0's routes of that step
    (ModelRunnerOutput.aux_output_connector_output) over vLLM's TP group and files them in the step output of the
    others. All ranks of the group run the same scheduler steps with the same batch in the same order
    (external_launcher's premise, which tensor parallelism needs anyway), so they all make the broadcast at the same
    step and a request's position in the batch names it on every rank (its id does not: vLLM appends 8 random
    characters per process, v1/engine/input_processor.py:371). Every rank's completions then carry rank 0's routes.

    Not installed (False) for a TP group of one, or an engine that does not return routes."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    if group.world_size == 1 or getattr(scheduler, "aux_output_connector", None) is None:
        return False
    update = scheduler.update_from_output

    def update_from_output(scheduler_output, model_runner_output):
        first = group.is_first_rank
        mine = getattr(model_runner_output, "aux_output_connector_output", None) if first else None
        if mine is not None:  # by position in the step's batch: vLLM's request ids end in random characters per rank
            where = {rid: i for i, rid in enumerate(model_runner_output.req_ids)}
            mine = {where[rid]: out for rid, out in mine.items()}
        routes = group.broadcast_object(mine, src=0)
        if not first and routes is not None:
            model_runner_output = copy.copy(model_runner_output)  # may be vLLM's shared empty output
            model_runner_output.aux_output_connector_output = {model_runner_output.req_ids[i]: out
                                                               for i, out in routes.items()}
        return update(scheduler_output, model_runner_output)

    scheduler.update_from_output = update_from_output
    return True


def take(worker) -> dict[tuple[str, int], np.ndarray]:
    """On the worker (collective_rpc): the routes recorded since the last call."""
    return worker.spmdrl_routes.take()


def batch_routes(routed: list, lengths: list[int]) -> torch.Tensor:
    """The `routed_experts` batch tensor (encode_routes) of a rollout's per-sample routes (RolloutOutput.routed_experts:
    [positions, layers, top_k] arrays, None where the engine returned none) over each sample's prompt + response
    `lengths`: NO_ROUTE beyond what the engine computed (the last token)."""
    shape = next((np.asarray(r).shape[1:] for r in routed if r is not None), None)
    if shape is None:
        return torch.zeros(len(lengths), 0, dtype=torch.int16)
    seqs = []
    for r, length in zip(routed, lengths):
        out = torch.full((length, *shape), NO_ROUTE, dtype=torch.int16)
        if r is not None:
            n = min(length, len(r))
            out[:n] = torch.from_numpy(np.ascontiguousarray(np.asarray(r)[:n]).astype(np.int16))
        seqs.append(out)
    return encode_routes(seqs)


def encode_routes(seqs: list[torch.Tensor]) -> torch.Tensor:
    """The batch form of per-sample routes ([S_i, layers, top_k] each, NO_ROUTE where none): int16 [B, W], row i
    the sample's routes flattened position-major, stored as expert id + 1 so that the zero padding every batch
    move adds (Batch.cat, redistribute, split transfers) reads as "no route"."""
    flat = [(s.to(torch.int16) + 1).reshape(-1) for s in seqs]
    out = torch.zeros(len(flat), max([f.numel() for f in flat], default=0), dtype=torch.int16)
    for i, f in enumerate(flat):
        out[i, : f.numel()] = f
    return out


def decode_routes(row: torch.Tensor, length: int, shape: tuple[int, int]) -> torch.Tensor:
    """One sample's routes back from its batch row: int64 [length, layers, top_k], NO_ROUTE where none."""
    layers, top_k = shape
    n = length * layers * top_k
    flat = torch.zeros(n, dtype=torch.long)
    flat[: min(n, row.numel())] = row[:n].long()
    return (flat - 1).view(length, layers, top_k)


def route_shape(hf_config) -> tuple[int, int] | None:
    """(layers, top_k) of a mixture-of-experts config's routes (every decoder layer counts, dense ones carry
    none); None for a dense model."""
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not top_k or not experts:
        return None
    return int(hf_config.num_hidden_layers), int(top_k)
