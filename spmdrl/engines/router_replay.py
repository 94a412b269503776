"""Routing replay and router statistics for a transformers mixture-of-experts model (the FSDP2 engine).

transformers 5 gives Qwen3-MoE, Qwen2-MoE and Mixtral one router module per MoE block (`mlp.gate`, beside
`mlp.experts`; Qwen2-MoE's shared expert, also beside them, is not routed): it maps hidden states [T, H] to (router
logits [T, E], top-k weights [T, k], top-k expert ids [T, k]) and the experts run what it chose. `RouterReplay` puts
a forward hook on each of them.

With routes set (`TokenBatch.routes`, the experts the rollout engine chose for each token), a token that has a
route is sent to exactly those experts, weighted by the trainer's own router probabilities of them:

    p = softmax(logits),   w_j = p[e_j] / sum_i p[e_i]  (renormalised when the model renormalises its top-k;
                                                          Qwen3-MoE's / Qwen2-MoE's norm_topk_prob, always for
                                                          Mixtral)

so the gradient still reaches the router through p. A token without a route (padding, the last token of a
sequence, which the rollout engine never computed) keeps the router's own choice.

With `aux` (the actor's load-balancing or z-loss coefficient is set) a forward under autograd also keeps, per
MoE layer, over its real tokens (T of them, top-k choices each, E experts), the load-balancing loss of Switch
Transformer as megatron-core writes it and the router z-loss of ST-MoE:

    aux = E * sum_e f_e * P_e,   f_e = (choices routed to e) / (T * k),   P_e = mean over tokens of p_e
    z   = mean over tokens of logsumexp(logits)^2

summed over the layers (`moe_losses`; f_e counts the choices the forward computed with, replayed or not).

In every forward it also counts, on the device, for the tokens that have a route: how many of the rollout's
(token, layer, k) choices the trainer's own top-k contains (`router_agreement`, measured with or without replay)
and how many the routing actually used contains (`route_agreement`: 1.0 under replay); and per layer the tokens
each expert received. `take_counts` hands the sums over and starts again.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from spmdrl.models.model import decoder_blocks


def moe_routers(hf: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router module) of every MoE block: a `gate` module beside an `experts` module."""
    backbone = getattr(hf, hf.base_model_prefix, hf)
    out = []
    for i, block in enumerate(decoder_blocks(backbone)):
        for module in block.modules():
            gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
            if isinstance(gate, nn.Module) and isinstance(experts, nn.Module) and hasattr(gate, "top_k"):
                out.append((i, gate))
    return out


class RouterReplay:
    """Hooks on every router of `hf` (moe_routers); `replay` switches the routes applied; `take_counts` the stats."""

    def __init__(self, hf: nn.Module, *, replay: bool, aux: bool = False):
        self.replay = replay  # False: routes only measure agreement, the router routes by itself
        self.aux = aux  # keep the differentiable load-balancing and z-loss terms of each forward
        self.losses: list[tuple[torch.Tensor, torch.Tensor]] = []  # per MoE layer of the last forward
        self.routers = moe_routers(hf)
        self.num_layers = int(hf.config.num_hidden_layers)
        self.num_experts = int(getattr(self.routers[0][1], "num_experts")) if self.routers else 0
        self.routes: torch.Tensor | None = None  # [N * L, layers, top_k] for the current forward, -1 = none
        self.tokens: torch.Tensor | None = None  # [N * L] bool: real tokens (padding excluded), None = all
        self.counts: dict[str, torch.Tensor] = {}
        for layer, gate in self.routers:
            gate.register_forward_hook(self._hook(layer, getattr(gate, "norm_topk_prob", True)))

    def set_batch(self, routes: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """The routes [N, L, layers, top_k] and token mask [N, L] (None: every token) of the next forward; they stay
        set for its backward (activation recompute runs the routers again)."""
        self.routes = None if routes is None else routes.reshape(-1, *routes.shape[2:])
        self.tokens = None if mask is None or mask.dim() != 2 else mask.reshape(-1).bool()
        self.losses = []

    def moe_losses(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(load-balancing loss, z-loss) of the last forward, each summed over the MoE layers; None without `aux`
        or outside autograd."""
        if not self.losses:
            return None
        return torch.stack([a for a, _ in self.losses]).sum(), torch.stack([z for _, z in self.losses]).sum()

    def take_counts(self) -> dict[str, torch.Tensor]:
        """Sums since the last call: agree_own, agree_used, routed (rollout choices compared), load [layers, E]."""
        out, self.counts = self.counts, {}
        return out

    def _hook(self, layer: int, renormalise: bool):
        def hook(module, args, output):
            logits, weights, own = output
            used = own
            with torch.no_grad():
                routed = has = None
                if self.routes is not None:
                    routed = self.routes[:, layer].to(own.device)
                    has = (routed >= 0).all(-1)
                    if self.tokens is not None:
                        has &= self.tokens.to(own.device)
                    if self.replay:
                        used = torch.where(has[:, None], routed, own)
                real = (self.tokens.to(own.device) if self.tokens is not None
                        else torch.ones_like(own[:, 0], dtype=torch.bool))
                add_route_counts(self.counts, layer, self.num_layers, self.num_experts, own, used, real, routed, has)
            if self.aux and torch.is_grad_enabled():
                self.losses.append(_aux_terms(logits, used, real, self.num_experts))
            if used is own:
                return output
            probs = torch.softmax(logits.float(), dim=-1)
            new_weights = probs.gather(-1, used)
            if renormalise:
                new_weights = new_weights / new_weights.sum(-1, keepdim=True)
            return logits, new_weights.to(weights.dtype), used

        return hook


def add_route_counts(counts: dict, layer: int, num_layers: int, experts: int, own: torch.Tensor, used: torch.Tensor,
                     real: torch.Tensor, routed: torch.Tensor | None, has: torch.Tensor | None) -> None:
    """Add one MoE layer's forward to `counts` (float64 device tensors, summed across calls): load [layers, E], the
    real tokens' choices per expert in the routing used; and for the tokens that have a rollout route (`has`, their
    routes `routed` [T, top_k]): agree_own / agree_used, how many of the rollout's choices the router's own top-k
    (`own`) / the routing used (`used`) contains, and routed, how many choices were compared."""
    def add(key: str, value: torch.Tensor) -> None:
        counts[key] = counts[key] + value if key in counts else value

    load = torch.zeros(num_layers, experts, device=own.device, dtype=torch.float64)
    load[layer] = torch.bincount(used[real].reshape(-1), minlength=experts).double()
    add("load", load)
    if routed is not None:
        r = routed[has]
        add("agree_own", (r[:, :, None] == own[has][:, None, :]).any(-1).sum().double())
        add("agree_used", (r[:, :, None] == used[has][:, None, :]).any(-1).sum().double())
        add("routed", torch.tensor(float(r.numel()), device=own.device, dtype=torch.float64))


def _aux_terms(logits: torch.Tensor, used: torch.Tensor, real: torch.Tensor, experts: int):
    """(load-balancing loss, z-loss) of one layer over its real tokens (see the module docstring)."""
    lg = logits.float()[real]
    chosen = used[real]
    f = torch.bincount(chosen.reshape(-1), minlength=experts).to(lg.dtype) / max(chosen.numel(), 1)
    p = torch.softmax(lg, dim=-1).mean(0)
    return experts * (f * p).sum(), torch.logsumexp(lg, dim=-1).square().mean()


def router_metrics(counts: dict[str, torch.Tensor]) -> dict[str, float]:
    """Metrics of summed counts (RouterReplay.take_counts, summed over ranks): moe/router_agreement,
    moe/route_agreement, and per MoE layer moe/expert_load_max_over_mean/layer_<i> (the busiest expert's tokens over
    the mean per expert: 1.0 is perfectly balanced)."""
    m = {}
    if float(counts.get("routed", 0)) > 0:
        m["moe/router_agreement"] = float(counts["agree_own"] / counts["routed"])
        m["moe/route_agreement"] = float(counts["agree_used"] / counts["routed"])
    load = counts.get("load")
    if load is not None:
        for i, row in enumerate(load.double()):
            if float(row.sum()) > 0:
                m[f"moe/expert_load_max_over_mean/layer_{i}"] = float(row.max() / row.mean())
    return m
