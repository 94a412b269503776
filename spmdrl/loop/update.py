"""Actor and critic updates: epochs x mini-batches x micro-batches, with the loss normalised over the whole
mini-batch across data-parallel ranks.

A micro-batch's loss is agg(L, mask, mode) over its own rows. FSDP averages gradients over the dp ranks, so
each micro-batch's loss is multiplied by
    dp * units(micro-batch) / units(mini-batch, all ranks)
with units = valid tokens (token-mean) or non-empty sequences (seq-mean modes; `agg_units`). The sum over
micro-batches and ranks is then exactly agg over the whole mini-batch on one rank: the same gradient for
any dp size and micro-batch split. seq-mean-token-sum-norm divides by a constant (actor.loss_agg_norm, default
data.max_response_length), never by a micro-batch's padded width.

Logged losses are that same weighted sum: the objective that was differentiated (per optimizer step, then
averaged over the steps of the update); token statistics (clip fractions, ppo_kl) are weighted by tokens.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from spmdrl.algos import agg_loss, kl_penalty, masked_mean
from spmdrl.algos.agg import agg_units
from spmdrl.algos.losses import resolve_agg_mode, value_loss
from spmdrl.batch import Batch
from spmdrl.dist.collectives import reduce_max, reduce_sum
from spmdrl.engines import TokenBatch, TrainEngine, pack_sequences
from spmdrl.engines.packing import balanced_partition, micro_batch_count
from spmdrl.rollout.routes import decode_routes




class MicroBatch(NamedTuple):
    """One micro-batch of an optimizer step, as the engine's train_step hands it to the loss (a tuple whose
    second item is the TokenBatch: the Megatron engine stages item[1])."""
    samples: Batch  # the micro-batch's rows of the mini-batch, on the engine's device
    tokens: TokenBatch  # their token ids, packed or padded for the engine
    unit_share: float  # its share of the mini-batch's units (tokens or sequences, per the aggregation mode)
    token_share: float  # its share of the mini-batch's valid tokens (weights the token statistics)


def micro_batches(
    batch: Batch, size: int, pad_id: int, *, max_tokens: int = 0, packed: bool = False, group=None,
    route_shape: tuple[int, int] | None = None,
) -> list[tuple[Batch, TokenBatch]]:
    """(samples, TokenBatch) pairs covering `batch` once.

    Without a token budget: consecutive chunks of `size` samples. With `max_tokens` > 0: k micro-batches of
    near-equal token counts (longest first into the lightest), k the smallest count that keeps every
    micro-batch within max_tokens tokens and `size` samples, maximised over the ranks of `group` (one
    all-reduce) because every rank must run as many forwards as the others under FSDP. `packed` packs each
    micro-batch's sequences into rows (spmdrl.engines.packing) instead of padding them. The split never
    changes the objective: run_updates weights each micro-batch by its share of the mini-batch's tokens.
    route_shape: (layers, top_k) of the batch's `routed_experts` when the forwards replay them (TokenBatch.routes);
    None ignores them.
    """
    if max_tokens > 0:
        lengths = (batch["prompt_len"] + batch["response_len"]).tolist()
        k = micro_batch_count(lengths, max_tokens, size)
        if group is not None and dist.is_initialized():
            k = int(reduce_max(torch.tensor([k]), group)[0])
        parts = [batch.select(idx) for idx in balanced_partition(lengths, k, size)] if len(batch) else []
    else:
        parts = batch.split(size)
    out = []
    for mb in parts:
        prompts = [mb["prompts"][i, : int(mb["prompt_len"][i])] for i in range(len(mb))]
        resps = [mb["responses"][i, : int(mb["response_len"][i])] for i in range(len(mb))]
        routes = None
        if route_shape is not None and "routed_experts" in mb:
            routes = [decode_routes(mb["routed_experts"][i], len(p) + len(r), route_shape)
                      for i, (p, r) in enumerate(zip(prompts, resps))]
        out.append((mb, pack_sequences(prompts, resps, pad_id, packed=packed, routes=routes,
                                       vision=mb.meta.get("vision"))))
    return out


def run_updates(
    engine: TrainEngine, batch: Batch, *, epochs: int, mini_size: int, micro_size: int, pad_id: int,
    dp_size: int, dp_group, objective: "ActorObjective | CriticObjective", prefix: str, max_tokens: int = 0,
    packed: bool = False, route_shape: tuple[int, int] | None = None,
) -> dict[str, float]:
    """Optimizer steps over `batch`.

    objective(mb, tb, engine) -> (loss, terms, stats): `loss` aggregated over the micro-batch with
    `objective.agg_mode`; `terms` the loss's parts aggregated the same way (logged weighted like the loss);
    `stats` token means (logged weighted by tokens). Returns the mean over optimizer steps of the
    global (all dp ranks) values, the same on every rank, plus the engine's grad_norm / lr / skipped_step.
    """
    mode = objective.agg_mode
    local: dict = {}  # this rank's share of each step's global objective, summed over steps (on the device)
    engine_sums: dict[str, float] = {}
    steps = 0
    minis = batch.split(mini_size)  # fixed order: the same config and seed give the same updates
    # every mini-batch's global (unit, token) totals in one all-reduce: the split is the same in every epoch
    all_totals = reduce_sum(torch.stack([
        torch.stack([agg_units(mini["response_mask"], mode), agg_units(mini["response_mask"], "token-mean")])
        for mini in minis
    ]).float(), group=dp_group) if minis else None

    def loss_fn(item: MicroBatch, eng):
        loss, terms, stats = objective(item.samples, item.tokens, eng)
        # metrics stay tensors on the loss's device: read once per update, never per micro-batch
        for k, v in terms.items():
            local[k] = local.get(k, 0.0) + _detached(v) * item.unit_share
        for k, v in stats.items():
            local[k] = local.get(k, 0.0) + _detached(v) * item.token_share
        return loss * (item.unit_share * dp_size), {}

    dev = getattr(engine, "device", torch.device("cpu"))
    for _ in range(epochs):
        for i, mini in enumerate(minis):
            unit_total, token_total = all_totals[i].tolist()
            mbs = micro_batches(mini, micro_size, pad_id, max_tokens=max_tokens, packed=packed, group=dp_group,
                                route_shape=route_shape)
            # each micro-batch's share of the mini-batch's units and tokens, from the host-side masks
            shares = torch.stack([torch.stack([agg_units(mb["response_mask"], mode),
                                               agg_units(mb["response_mask"], "token-mean")]) for mb, _ in mbs])
            shares = (shares / torch.tensor([unit_total or 1.0, token_total or 1.0], dtype=torch.float64)).tolist()
            out = engine.train_step([MicroBatch(_staged(mb, dev), tb, w[0], w[1]) for (mb, tb), w in zip(mbs, shares)],
                                    loss_fn)
            for k, v in out.items():
                engine_sums[k] = engine_sums.get(k, 0.0) + v
            steps += 1
    keys = sorted(local)  # every rank has the same keys: they depend on the config only
    summed = reduce_sum(_stacked([local[k] for k in keys]), group=dp_group).tolist() if keys else []
    res = {k: float(v) / max(steps, 1) for k, v in zip(keys, summed)}
    res.update({f"{prefix}/{k}": v / max(steps, 1) for k, v in engine_sums.items()})
    return res


def _staged(mb: Batch, device: torch.device) -> Batch:
    """The micro-batch's tensors on the engine's device, copied from pinned memory without blocking the host, so
    that the loss's `.to(device)` reads cost no wait on the device queue per micro-batch."""
    if device.type == "cpu":
        return mb
    return Batch({k: v.pin_memory().to(device, non_blocking=True) for k, v in mb.tensors.items()}, mb.meta)


def _detached(v):
    return v.detach().double() if torch.is_tensor(v) else float(v)


def _stacked(values: list) -> torch.Tensor:
    """A float64 vector of scalars (0-dim tensors on one device, or floats), built without reading any of them."""
    dev = next((v.device for v in values if torch.is_tensor(v)), torch.device("cpu"))
    return torch.stack([v.to(dev, torch.float64).reshape(()) if torch.is_tensor(v)
                        else torch.tensor(v, dtype=torch.float64, device=dev) for v in values])


class ActorObjective:
    """The policy objective for one micro-batch: policy loss - entropy bonus (+ KL to the ref) (+ distill.coef x
    the distillation KL to the teacher, distill.mode = kl_loss), every term aggregated with the same mode
    (`agg_mode`) and constant norm.

    With rollout.partial the on-policy old log-probs are the rollout's (`rollout_log_probs`), token by token.

    keep_logprobs: on-policy runs (no old-log-prob pass) keep each micro-batch's own log-probs of the sampled
    tokens with its rollout log-probs and mask in `own_logprobs`, for the mismatch diagnostic
    (loop/correction.py's `logprob_diff`): before the one optimizer step they are the old log-probs."""

    def __init__(self, cfg, loss_fn: Callable, temperature: float, keep_logprobs: bool = False,
                 distill_fn: Callable | None = None):
        a = self.actor = cfg.actor
        # on-policy distillation's loss-stage term (algos/distill.py), times distill.coef; None otherwise
        self.distill = distill_fn if getattr(distill_fn, "stage", None) == "loss" else None
        self.distill_coef, self.distill_kl_type = cfg.distill.coef, cfg.distill.kl_type
        self.loss_fn, self.temperature = loss_fn, temperature
        self.agg_mode = resolve_agg_mode(a.policy_loss, a.loss_agg_mode)
        self.norm = a.loss_agg_norm or float(cfg.data.max_response_length)
        self.loss_kw = dict(
            clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
            sapo_tau_pos=a.sapo_tau_pos, sapo_tau_neg=a.sapo_tau_neg, clip_cov_ratio=a.clip_cov_ratio,
            clip_cov_lb=a.clip_cov_lb, clip_cov_ub=a.clip_cov_ub, kl_cov_ratio=a.kl_cov_ratio,
            kl_cov_coef=a.kl_cov_coef,
        )
        # the entropy enters the gradient only with a bonus; otherwise it is a metric computed without autograd,
        # or not computed at all (actor.entropy_metric = false)
        self.entropy_mode = True if a.entropy_coeff != 0 else ("detached" if a.entropy_metric else False)
        self.keep_logprobs = keep_logprobs
        # rollout.partial: a batch mixes tokens of several weight versions, so no one set of weights is the old
        # policy; the ratio's denominator is each token's behaviour log-prob, the engine's (config/validate.py
        # refuses the combinations where that is not the sampled distribution or an old-log-prob pass replaces it)
        self.behaviour_old = getattr(cfg.rollout, "partial", "off") != "off"
        self.own_logprobs: list = []  # (log-probs, rollout log-probs, mask) per micro-batch, with keep_logprobs

    def agg(self, x, mask):
        return agg_loss(x, mask, self.agg_mode, norm=self.norm)

    def __call__(self, mb: Batch, tb: TokenBatch, engine: TrainEngine):
        a = self.actor
        logp, ent = engine.logprobs(tb, temperature=self.temperature, with_entropy=self.entropy_mode,
                                    chunk_size=a.logprob_chunk_size)
        R = logp.shape[1]
        dev = logp.device
        mask = mb["response_mask"][:, :R].to(dev)
        stats = {}
        if "old_log_probs" in mb:
            old = mb["old_log_probs"][:, :R].to(dev)
        else:  # on-policy: the parameters have not moved since the rollout, so these are the old log-probs
            old = own = logp.detach()
            if self.behaviour_old:  # partial rollouts: each token's old policy is the weight version that sampled it
                old = mb["rollout_log_probs"][:, :R].to(dev)
            if self.keep_logprobs:
                self.own_logprobs.append((own, mb["rollout_log_probs"][:, :R].to(dev), mask))
        kw = self.loss_kw
        if "rollout_is_weights" in mb:  # [rollout_correction]: truncated importance weights pi_old / pi_rollout
            kw = {**kw, "rollout_is_weights": mb["rollout_is_weights"][:, :R].to(dev)}
        pg_loss, pg_m = self.loss_fn(old, logp, mb["advantages"][:, :R].to(dev), mask, loss_agg_mode=self.agg_mode,
                                     loss_agg_norm=self.norm, **kw)
        loss = pg_loss
        terms = {"actor/pg_loss": pg_loss.detach()}
        if ent is not None:
            entropy = self.agg(ent, mask)
            if a.entropy_coeff != 0:
                loss = loss - a.entropy_coeff * entropy
            terms["actor/entropy"] = entropy.detach()
        stats.update({"actor/clipfrac": pg_m["pg_clipfrac"], "actor/ppo_kl": pg_m["ppo_kl"]})
        router = engine.moe_losses() if a.moe_aux_loss_coef or a.moe_z_loss_coef else None
        if router is not None:  # a mixture of experts' load-balancing and z-loss, summed over its MoE layers
            aux, z = router[0].to(dev), router[1].to(dev)
            loss = loss + a.moe_aux_loss_coef * aux + a.moe_z_loss_coef * z
            terms.update({"actor/moe_aux_loss": aux.detach(), "actor/moe_z_loss": z.detach()})
        if a.use_kl_loss:
            kl = self.agg(kl_penalty(logp, mb["ref_log_probs"][:, :R].to(dev), a.kl_loss_type), mask)
            loss = loss + a.kl_loss_coef * kl
            terms["actor/kl"] = kl.detach()
        elif "ref_log_probs" in mb:
            stats["actor/kl"] = masked_mean(kl_penalty(logp.detach(), mb["ref_log_probs"][:, :R].to(dev), "kl"), mask)
        else:  # no ref model: KL to the rollout policy
            stats["actor/kl"] = masked_mean((old - logp).detach(), mask)
        if self.distill is not None:
            term = self.agg(self.distill(logp, mb["teacher_log_probs"][:, :R].to(dev), mask,
                                         kl_type=self.distill_kl_type), mask)
            loss = loss + self.distill_coef * term
            terms["actor/distill_kl_loss"] = term.detach()
        terms["actor/loss"] = loss.detach()
        return loss, terms, stats


class CriticObjective:
    """Clipped value loss for one micro-batch."""

    def __init__(self, cfg):
        self.section = cfg.critic
        self.agg_mode = cfg.critic.loss_agg_mode
        self.norm = cfg.critic.loss_agg_norm or float(cfg.data.max_response_length)

    def __call__(self, mb: Batch, tb: TokenBatch, engine: TrainEngine):
        v = engine.values(tb)
        R = v.shape[1]
        dev = v.device
        mask = mb["response_mask"][:, :R].to(dev)
        loss, m = value_loss(
            v, mb["values"][:, :R].to(dev), mb["returns"][:, :R].to(dev), mask, self.section.cliprange_value,
            loss_agg_mode=self.agg_mode, loss_agg_norm=self.norm,
        )
        return loss, {"critic/vf_loss": loss.detach()}, {"critic/vf_clipfrac": m["vf_clipfrac"],
                                                          "critic/values_mean": masked_mean(v.detach(), mask)}


@torch.no_grad()
def forward_all(
    engine: TrainEngine, batch: Batch, micro_size: int, pad_id: int, head: str, *, max_tokens: int = 0,
    packed: bool = False, route_shape: tuple[int, int] | None = None, **head_kw,
) -> torch.Tensor:
    """engine.forward_micro_batches(micro-batches, head, **head_kw) (head "logprobs" or "values") over `batch`,
    assembled into a [B, R] CPU float tensor in batch order. The engine runs every micro-batch of the pass in one
    call (Megatron: one pipeline schedule); the results are assembled on the device and copied to the host once.

    Forward-only passes keep no activations for backward, so they can take larger micro-batches than the
    update (actor.forward_micro_batch_size / forward_max_tokens_per_micro_batch)."""
    engine.eval()
    batch = Batch({**batch.tensors, "_row": torch.arange(len(batch))}, batch.meta)  # where each sample goes back to
    group = engine.mesh.group("dp") if max_tokens > 0 else None
    mbs = micro_batches(batch, micro_size, pad_id, max_tokens=max_tokens, packed=packed, group=group,
                        route_shape=route_shape)
    results = engine.forward_micro_batches([tb for _, tb in mbs], head, **head_kw)
    if not results:
        return torch.zeros(len(batch), batch["responses"].shape[1])
    out = torch.zeros(len(batch), batch["responses"].shape[1], device=results[0].device)
    for (mb, _), vals in zip(mbs, results):
        out[mb["_row"].to(out.device, non_blocking=True), : vals.shape[1]] = vals.float()
    return out.cpu()
