"""Actor and critic updates: epochs x mini-batches x micro-batches, with the loss normalised over the whole
mini-batch across data-parallel ranks.

FSDP averages gradients over the dp ranks, so a micro-batch's loss is weighted by
    dp * (its tokens, or sequences for seq-mean modes) / (the mini-batch's total over all ranks),
which makes the update identical to one computed on the whole mini-batch on a single rank.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from spmdrl.algos import agg_loss, kl_penalty, masked_mean
from spmdrl.algos.losses import value_loss
from spmdrl.batch import Batch
from spmdrl.dist.collectives import comm_device, reduce_sum
from spmdrl.engines.fsdp import FSDPEngine, TokenBatch, pack_sequences
from spmdrl.engines.packing import balanced_partition, micro_batch_count


def micro_batches(
    batch: Batch, size: int, pad_id: int, *, max_tokens: int = 0, packed: bool = False, group=None,
) -> list[tuple[Batch, TokenBatch]]:
    """(samples, TokenBatch) pairs covering `batch` once.

    Without a token budget: consecutive chunks of `size` samples. With `max_tokens` > 0: k micro-batches of
    near-equal token counts (longest first into the lightest), k the smallest count that keeps every
    micro-batch within max_tokens tokens and `size` samples, maximised over the ranks of `group` (one
    all-reduce) because every rank must run as many forwards as the others under FSDP. `packed` packs each
    micro-batch's sequences into rows (spmdrl.engines.packing) instead of padding them. The split never
    changes the objective: run_updates weights each micro-batch by its share of the mini-batch's tokens.
    """
    if max_tokens > 0:
        lengths = (batch["prompt_len"] + batch["response_len"]).tolist()
        k = micro_batch_count(lengths, max_tokens, size)
        if group is not None and dist.is_initialized():
            k = _max_over(k, group)
        parts = [batch.select(idx) for idx in balanced_partition(lengths, k, size)] if len(batch) else []
    else:
        parts = batch.split(size)
    out = []
    for mb in parts:
        prompts = [mb["prompts"][i, : int(mb["prompt_len"][i])] for i in range(len(mb))]
        resps = [mb["responses"][i, : int(mb["response_len"][i])] for i in range(len(mb))]
        out.append((mb, pack_sequences(prompts, resps, pad_id, packed=packed)))
    return out


def _max_over(value: int, group) -> int:
    t = torch.tensor([value], dtype=torch.long, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0])


def run_updates(
    engine: FSDPEngine, batch: Batch, *, epochs: int, mini_size: int, micro_size: int, pad_id: int,
    agg_mode: str, dp_size: int, dp_group, body: Callable, prefix: str, max_tokens: int = 0, packed: bool = False,
) -> dict[str, float]:
    """Optimizer steps over `batch`; body(mb, tb, engine) -> (unweighted loss, metrics). Returns mean metrics."""
    seq_mode = agg_mode != "token-mean"
    sums: dict[str, float] = {}
    count = 0
    for _ in range(epochs):
        for mini in batch.split(mini_size):  # fixed order: the same config and seed give the same updates
            def units(mask):
                return (mask.sum(-1) > 0).float().sum() if seq_mode else mask.sum()

            total = float(reduce_sum(units(mini["response_mask"]).reshape(1), group=dp_group)[0])

            def loss_fn(item, eng):
                mb, tb = item
                loss, m = body(mb, tb, eng)
                weight = float(units(mb["response_mask"])) / max(total, 1.0) * dp_size
                return loss * weight, m

            mbs = micro_batches(mini, micro_size, pad_id, max_tokens=max_tokens, packed=packed, group=dp_group)
            out = engine.train_step(mbs, loss_fn)
            for k, v in out.items():
                key = k if "/" in k else f"{prefix}/{k}"
                sums[key] = sums.get(key, 0.0) + v
            count += 1
    return {k: v / max(count, 1) for k, v in sums.items()}


def actor_body(cfg, loss_fn: Callable, temperature: float) -> Callable:
    """The policy objective for one micro-batch: policy loss - entropy bonus (+ KL to the ref)."""
    a = cfg.actor
    # the entropy enters the gradient only with a bonus; otherwise it is a metric computed without autograd,
    # or not computed at all (actor.entropy_metric = false)
    entropy_mode = True if a.entropy_coeff != 0 else ("detached" if a.entropy_metric else False)

    def body(mb: Batch, tb: TokenBatch, engine: FSDPEngine):
        logp, ent = engine.logprobs(tb, temperature=temperature, with_entropy=entropy_mode, chunk_size=a.logprob_chunk_size)
        R = logp.shape[1]
        dev = logp.device
        mask = mb["response_mask"][:, :R].to(dev)
        m = {}
        if "old_log_probs" in mb:
            old = mb["old_log_probs"][:, :R].to(dev)
        else:  # on-policy: the parameters have not moved since the rollout, so these are the old log-probs
            old = logp.detach()
            m["rollout/logprob_diff_mean"] = masked_mean((mb["rollout_log_probs"][:, :R].to(dev) - old).abs(), mask)
        pg_loss, pg_m = loss_fn(
            old, logp, mb["advantages"][:, :R].to(dev), mask, clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode,
        )
        loss = pg_loss
        m.update({"actor/pg_loss": pg_loss.detach(), "actor/clipfrac": pg_m["pg_clipfrac"], "actor/ppo_kl": pg_m["ppo_kl"]})
        if ent is not None:
            entropy = agg_loss(ent, mask, a.loss_agg_mode)
            if a.entropy_coeff != 0:
                loss = loss - a.entropy_coeff * entropy
            m["actor/entropy"] = entropy.detach()
        if a.use_kl_loss:
            kl = agg_loss(kl_penalty(logp, mb["ref_log_probs"][:, :R].to(dev), a.kl_loss_type), mask, a.loss_agg_mode)
            loss = loss + a.kl_loss_coef * kl
            m["actor/kl"] = kl.detach()
        elif "ref_log_probs" in mb:
            m["actor/kl"] = masked_mean(kl_penalty(logp.detach(), mb["ref_log_probs"][:, :R].to(dev), "kl"), mask)
        else:  # no ref model: KL to the rollout policy
            m["actor/kl"] = masked_mean((old - logp).detach(), mask)
        return loss, m

    return body


def critic_body(cfg) -> Callable:
    """Clipped value loss for one micro-batch."""
    c = cfg.critic

    def body(mb: Batch, tb: TokenBatch, engine: FSDPEngine):
        v = engine.values(tb)
        R = v.shape[1]
        dev = v.device
        mask = mb["response_mask"][:, :R].to(dev)
        loss, m = value_loss(
            v, mb["values"][:, :R].to(dev), mb["returns"][:, :R].to(dev), mask, c.cliprange_value,
            loss_agg_mode=c.loss_agg_mode,
        )
        return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": m["vf_clipfrac"],
                      "critic/values_mean": masked_mean(v.detach(), mask)}

    return body


@torch.no_grad()
def forward_all(
    engine: FSDPEngine, batch: Batch, micro_size: int, pad_id: int, fn: Callable, *, max_tokens: int = 0,
    packed: bool = False,
) -> torch.Tensor:
    """fn(engine, tb) -> [b, R'] for each micro-batch, assembled into a [B, R] CPU float tensor in batch order.

    Forward-only passes keep no activations for backward, so they can take larger micro-batches than the
    update (actor.forward_micro_batch_size / forward_max_tokens_per_micro_batch)."""
    engine.module.eval()
    out = torch.zeros(len(batch), batch["responses"].shape[1])
    batch = Batch({**batch.tensors, "_row": torch.arange(len(batch))})  # where each sample goes back to
    group = engine.mesh.mesh.get_group("dp") if max_tokens > 0 else None
    for mb, tb in micro_batches(batch, micro_size, pad_id, max_tokens=max_tokens, packed=packed, group=group):
        vals = fn(engine, tb)
        out[mb["_row"], : vals.shape[1]] = vals.float().cpu()
    return out
