"""Routing of a mixture-of-experts model on the Megatron backend: HF's router formula, routing replay, router counts
and the load-balancing / z-loss terms (the FSDP2 engine's protocol, spmdrl/engines/router_replay.py).

`Router` takes the place of megatron-core's TopKRouter in every MoE layer (model.block_spec). Its gating is
megatron's (logits = x W^T over the router weight [E, H], whole on every rank); its routing is transformers':

    p = softmax(logits) in float32,   own = top-k of p,
    weights w_j = p[e_j] / sum_i p[e_i]   (Qwen3-MoE / Qwen2-MoE with norm_topk_prob, always for Mixtral),
    w_j = p[e_j] otherwise (the released Qwen2-MoE models),

and megatron's dispatcher then sends each token to the chosen experts (no capacity, no dropped tokens). With routes
set for the forward (`Routing.set_batch`) and replay on, a token that has a route uses exactly those experts (e_j =
the route), still weighted by the router's own p, so the router gets a gradient; a token without one (padding, the
last token of a sequence) keeps its own choice.

Tokens. Megatron's router sees the hidden states [s, b, H] flattened sequence-major (token s * b + n); under sequence
parallelism (tp > 1) each tp rank sees only its s / tp positions. The engine lays routes and the real-token mask out
the same way for this rank (engine._stage), so each rank routes, counts and sums only its own tokens.

Counts (moe_counts, engine): over real tokens, per forward except activation recompute during backward (a second
run of the same forward): agree_own / agree_used / routed (the rollout's (token, layer, k) choices found in the
router's own top-k / in the routing used) and load [layers, E]; the engine sums them over tp and pp.

Losses (router_losses): under autograd, per MoE layer over the micro-batch's real tokens T (top-k each, E experts):
    aux = E * sum_e f_e * P_e,  f_e = (choices routed to e) / (T * k),  P_e = mean over tokens of p_e
    z   = mean over tokens of logsumexp(logits)^2
the FSDP2 engine's terms. Under sequence parallelism the per-expert counts, T, sum_t p and sum_t logsumexp^2 are
all-reduced over tp (megatron's reduce_from_tensor_model_parallel_region: identity backward, so each rank's router
weight gets its own tokens' share; finalize_model_grads sums the router weight's gradient over tp, as it is marked
sequence_parallel). The terms are summed over the layers (moe_losses).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.router import TopKRouter

from spmdrl.engines.router_replay import add_route_counts


class Routing:
    """What every Router of one engine shares: the current forward's routes and real tokens, the counts since the
    last take_counts, and the loss terms of the last forward."""

    def __init__(self, num_layers: int, experts: int, top_k: int, norm_topk_prob: bool, *, replay: bool, aux: bool,
                 tp_group=None):
        self.num_layers, self.experts, self.top_k, self.renormalise = num_layers, experts, top_k, norm_topk_prob
        self.replay, self.aux, self.tp_group = replay, aux, tp_group
        self.routes: torch.Tensor | None = None  # [T, layers, top_k] of this rank's tokens, -1 = none
        self.real: torch.Tensor | None = None  # [T] bool: real tokens (not padding); None = all
        self.counts: dict[str, torch.Tensor] = {}
        self.losses: list[tuple[torch.Tensor, torch.Tensor]] = []

    def set_batch(self, routes: torch.Tensor | None, real: torch.Tensor | None) -> None:
        """Routes and real-token mask of the next forward (this rank's tokens, megatron's order); they stay set for
        its backward (activation recompute routes again)."""
        self.routes, self.real, self.losses = routes, real, []

    def take_counts(self) -> dict[str, torch.Tensor]:
        out, self.counts = self.counts, {}
        return out

    def route(self, layer: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] of MoE layer `layer` (global index) -> (weights [T, top_k], experts used [T, top_k])."""
        p = torch.softmax(logits.float(), dim=-1)
        own = torch.topk(p, self.top_k, dim=-1).indices
        used = own
        real = self.real if self.real is not None else torch.ones_like(own[:, 0], dtype=torch.bool)
        with torch.no_grad():
            routed = has = None
            if self.routes is not None:
                routed = self.routes[:, layer]
                has = (routed >= 0).all(-1) & real
                if self.replay:
                    used = torch.where(has[:, None], routed, own)
            if not _in_backward():  # recompute repeats a forward that was counted already
                add_route_counts(self.counts, layer, self.num_layers, self.experts, own, used, real, routed, has)
        w = p.gather(-1, used)
        if self.renormalise:
            w = w / w.sum(-1, keepdim=True)
        if self.aux and torch.is_grad_enabled() and not _in_backward():
            self.losses.append(self._loss_terms(logits, p, used, real))
        return w.to(logits.dtype), used

    def _loss_terms(self, logits, p, used, real):
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_tp

        chosen = used[real]
        counts = torch.bincount(chosen.reshape(-1), minlength=self.experts).float()
        n = real.sum().float()
        psum = p[real].sum(0)
        zsum = torch.logsumexp(logits.float()[real], dim=-1).square().sum()
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:  # sequence parallel: tokens split
            stats = torch.cat([counts, n[None]])
            dist.all_reduce(stats, group=self.tp_group)
            counts, n = stats[:-1], stats[-1]
            psum, zsum = reduce_tp(psum, group=self.tp_group), reduce_tp(zsum, group=self.tp_group)
        n = n.clamp(min=1)
        f = counts / (n * self.top_k)
        return self.experts * (f * (psum / n)).sum(), zsum / n

    def moe_losses(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.losses:
            return None
        return torch.stack([a for a, _ in self.losses]).sum(), torch.stack([z for _, z in self.losses]).sum()


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (megatron's activation recompute runs the forward there)."""
    return torch._C._current_graph_task_id() != -1


class Router(TopKRouter):
    """megatron's TopKRouter with transformers' routing (see the module docstring); `routing` is set to the engine's
    Routing after the model is built. Returns what megatron's dispatcher takes: probs [T, E] (the weights at the
    chosen experts, zero elsewhere) and routing_map [T, E] bool."""

    routing_state: Routing | None = None

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """logits = x W^T in the input's dtype (transformers' router). megatron's own gating moves a CPU weight
        to the GPU, and its router_gating_linear calls TransformerEngine's GEMM by a name that is undefined when TE
        is not installed (megatron-core 0.16.1)."""
        return torch.nn.functional.linear(input, self.weight.to(input.dtype))

    def routing(self, logits: torch.Tensor, padding_mask=None):
        logits = logits.view(-1, self.config.num_moe_experts)
        w, used = self.routing_state.route(self.layer_number - 1, logits)
        probs = torch.zeros_like(logits).scatter(1, used, w)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, used, True)
        return probs, routing_map
