"""Advantage estimators.

Every estimator has one signature, so the trainer looks one up by name and calls it the same way:

    fn(token_level_rewards [B, T], response_mask [B, T], *, index [B] int64 | None = None,
       values [B, T] | None = None, baseline_rewards [B] | None = None, gamma=1.0, lam=1.0,
       epsilon=1e-6, norm_by_std=True, whiten=True, reduce=None, **_) -> (advantages [B, T], returns [B, T])

``index[i]`` is the group (prompt) sample i was drawn for; ids need not be contiguous. Advantages and
returns are 0 on masked tokens; masked rewards/values are ignored (they may be garbage or NaN).
Estimators run under no_grad: advantages are targets, never differentiated.

Batch-level statistics (the whitening of REINFORCE++ and GAE, GPG's scale) are over the GLOBAL batch: the
trainer passes ``reduce`` (see ``spmdrl.algos.agg.Reduce``), a sum over the actor's data-parallel ranks, and
the estimator calls it once. Group statistics need no communication: a group never spans ranks (validation
rejects layouts that would split one).

Discounting walks valid tokens only: with holes in the mask (multi-turn, tool output masked), the
return at a token is r_t + gamma * (return at the next *valid* token), so credit flows across holes.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from spmdrl.algos.agg import Reduce, masked_sum, masked_whiten
from spmdrl.errors import ConfigError, SpmdrlError
from spmdrl.registry import Registry

AdvFn = Callable[..., tuple[Tensor, Tensor]]
ADV_ESTIMATORS: Registry[AdvFn] = Registry("advantage estimator")


# ---------------------------------------------------------------------------------------------- helpers


def _check(rewards: Tensor, mask: Tensor, index: Tensor | None = None, **named: Tensor | None) -> Tensor:
    """Validate shapes; return the bool mask."""
    if rewards.dim() != 2 or rewards.shape != mask.shape:
        raise SpmdrlError(
            f"token_level_rewards {tuple(rewards.shape)} and response_mask {tuple(mask.shape)} "
            "must both be [B, T]"
        )
    B = rewards.shape[0]
    if index is not None:
        if index.shape != (B,) or index.is_floating_point():
            raise SpmdrlError(
                f"index must be an integer tensor of shape [{B}], got {index.dtype} {tuple(index.shape)}"
            )
    for name, t in named.items():
        want = (B,) if name == "baseline_rewards" else tuple(rewards.shape)
        if t is not None and tuple(t.shape) != want:
            raise SpmdrlError(f"{name} must have shape {list(want)}, got {list(t.shape)}")
    return mask != 0


def _zero_masked(x: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _outcome_scores(rewards: Tensor, valid: Tensor) -> Tensor:
    """s_i = sum_t m_it r_it  -> [B]."""
    return masked_sum(rewards, valid, dim=-1)


def group_stats(scores: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, unbiased group std, group size) of ``scores`` [B] grouped by ``index`` [B].

    Vectorised (unique + index_add), computed in float64; a group of one has std 0. All three are [B].
    """
    uniq, inv = torch.unique(index, return_inverse=True)
    G = uniq.numel()
    s = scores.double()
    n = torch.bincount(inv, minlength=G).double()
    mean = s.new_zeros(G).index_add_(0, inv, s) / n.clamp_min(1)
    dev = s - mean[inv]
    var = s.new_zeros(G).index_add_(0, inv, dev * dev) / (n - 1).clamp_min(1)
    return mean[inv], var.sqrt()[inv], n[inv]


def discounted_returns(rewards: Tensor, valid: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + gamma * G_t' with t' the next valid token (0 past the last one); [B, T], 0 where masked.

    gamma == 1 is a reverse cumsum; otherwise a loop over T (vectorised over B).
    """
    r = _zero_masked(rewards, valid)
    if gamma == 1.0:
        g = r.flip(-1).cumsum(-1).flip(-1)
    else:
        running = r.new_zeros(r.shape[0])
        cols = []
        for t in reversed(range(r.shape[1])):
            running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
            cols.append(running)
        g = torch.stack(cols[::-1], dim=1) if cols else torch.zeros_like(r)
    return _zero_masked(g, valid)


def _need_index(name: str, index: Tensor | None) -> Tensor:
    if index is None:
        raise ConfigError(
            f"advantage estimator {name!r} groups samples by prompt and needs index=[B] group ids"
        )
    return index


def _broadcast(per_seq: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    return _zero_masked(per_seq.to(dtype)[:, None].expand(valid.shape), valid)


# ------------------------------------------------------------------------------------------- estimators


@ADV_ESTIMATORS.register("grpo", requires=("index",))
@torch.no_grad()
def grpo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: Tensor | None = None,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
    **_,
) -> tuple[Tensor, Tensor]:
    """GRPO: A_it = (s_i - mean_g(s)) / (std_g(s) + epsilon), s_i = sum_t r_it, g = group of i.

    std is unbiased (as torch.std). ``norm_by_std=False`` drops the division (Dr. GRPO). A group of one
    has advantage 0. returns = advantages (no critic).
    """
    valid = _check(token_level_rewards, response_mask, index)
    index = _need_index("grpo", index)
    s = _outcome_scores(token_level_rewards.double(), valid)
    mean, std, n = group_stats(s, index)
    a = s - mean
    if norm_by_std:
        den = std + epsilon  # 0 only for a constant group with epsilon == 0: advantage 0, not NaN
        a = torch.where(den > 0, a / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(a))
    a = torch.where(n > 1, a, torch.zeros_like(a))
    adv = _broadcast(a, valid, token_level_rewards.dtype)
    return adv, adv


@ADV_ESTIMATORS.register("drgrpo", requires=("index",))
@torch.no_grad()
def drgrpo(token_level_rewards: Tensor, response_mask: Tensor, **kw) -> tuple[Tensor, Tensor]:
    """Dr. GRPO: A_it = s_i - mean_g(s) (GRPO without the std division; ``norm_by_std`` is ignored)."""
    kw["norm_by_std"] = False
    return grpo(token_level_rewards, response_mask, **kw)


@ADV_ESTIMATORS.register("rloo", requires=("index",))
@torch.no_grad()
def rloo(
    token_level_rewards: Tensor, response_mask: Tensor, *, index: Tensor | None = None, **_
) -> tuple[Tensor, Tensor]:
    """RLOO: A_it = s_i - (1/(n-1)) sum_{j in g, j != i} s_j = n/(n-1) * (s_i - mean_g(s)).

    A group of one has advantage 0. returns = advantages.
    """
    valid = _check(token_level_rewards, response_mask, index)
    index = _need_index("rloo", index)
    s = _outcome_scores(token_level_rewards.double(), valid)
    mean, _, n = group_stats(s, index)
    a = torch.where(n > 1, n / (n - 1).clamp_min(1) * (s - mean), torch.zeros_like(s))
    adv = _broadcast(a, valid, token_level_rewards.dtype)
    return adv, adv


@ADV_ESTIMATORS.register("reinforce_plus_plus", requires=())
@torch.no_grad()
def reinforce_plus_plus(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    whiten: bool = True,
    reduce: Reduce | None = None,
    **_,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: G_it = r_it + gamma * G_i,next-valid; A = whiten(G) over all valid tokens of the global
    batch (mean and unbiased std over every rank's valid tokens, via ``reduce``).

    returns = G (before whitening).
    """
    valid = _check(token_level_rewards, response_mask)
    g = discounted_returns(token_level_rewards, valid, gamma)
    adv = masked_whiten(g, valid, reduce=reduce) if whiten else g
    return adv, g


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline", requires=("index",))
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: Tensor | None = None,
    whiten: bool = True,
    reduce: Reduce | None = None,
    **_,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: A_it = whiten(s_i - mean_g(s)) over all valid tokens of the global batch
    (every token of response i carries s_i - mean_g(s), so longer responses weigh more in the statistics).

    returns = advantages.
    """
    valid = _check(token_level_rewards, response_mask, index)
    index = _need_index("reinforce_plus_plus_baseline", index)
    s = _outcome_scores(token_level_rewards.double(), valid)
    mean, _, _ = group_stats(s, index)
    adv = _broadcast(s - mean, valid, torch.float64)
    adv = (masked_whiten(adv, valid, reduce=reduce) if whiten else adv).to(token_level_rewards.dtype)
    return adv, adv


@ADV_ESTIMATORS.register("gae", requires=("values",))
@torch.no_grad()
def gae(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    reduce: Reduce | None = None,
    **_,
) -> tuple[Tensor, Tensor]:
    """GAE: delta_t = r_t + gamma V_t' - V_t, A_t = delta_t + gamma lam A_t', t' = next valid token.

    V and A beyond the last valid token are 0. returns = A + V (before whitening); advantages are
    whitened over the global batch's valid tokens when ``whiten`` (via ``reduce``). Loop over T,
    vectorised over B.
    """
    valid = _check(token_level_rewards, response_mask, values=values)
    if values is None:
        raise ConfigError(
            "advantage estimator 'gae' needs values=[B, T] from the critic; enable the critic or pick grpo/rloo"
        )
    r = _zero_masked(token_level_rewards, valid)
    v = _zero_masked(values.to(r.dtype), valid)
    next_v = r.new_zeros(r.shape[0])
    last = r.new_zeros(r.shape[0])
    cols = []
    for t in reversed(range(r.shape[1])):
        m = valid[:, t]
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * last
        last = torch.where(m, a, last)
        next_v = torch.where(m, v[:, t], next_v)
        cols.append(last)
    adv = torch.stack(cols[::-1], dim=1) if cols else torch.zeros_like(r)
    adv = _zero_masked(adv, valid)
    returns = _zero_masked(adv + v, valid)
    if whiten:
        adv = masked_whiten(adv, valid, reduce=reduce)
    return adv, returns


@ADV_ESTIMATORS.register("remax", requires=("baseline_rewards",))
@torch.no_grad()
def remax(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    baseline_rewards: Tensor | None = None,
    gamma: float = 1.0,
    **_,
) -> tuple[Tensor, Tensor]:
    """ReMax: G_it = return-to-go of r (with gamma); A_it = G_it - b_i, b_i = reward of the greedy response.

    returns = G.
    """
    valid = _check(token_level_rewards, response_mask, baseline_rewards=baseline_rewards)
    if baseline_rewards is None:
        raise ConfigError("advantage estimator 'remax' needs baseline_rewards=[B] (reward of the greedy rollout)")
    g = discounted_returns(token_level_rewards, valid, gamma)
    adv = _zero_masked(g - baseline_rewards.to(g.dtype)[:, None], valid)
    return adv, g


@ADV_ESTIMATORS.register("grpo_passk", requires=("index",))
@torch.no_grad()
def grpo_passk(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: Tensor | None = None,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
    **_,
) -> tuple[Tensor, Tensor]:
    """Pass@k GRPO (Chen et al. 2025, arXiv 2503.19595): only the best response of a group learns.

    A_i = (s_(1) - s_(2)) / (std_g(s) + epsilon)  for i = the first sample of its group (in batch order)
          with the group's largest score s_(1); s_(2) is the second largest (equal to s_(1) on a tie, so
          a tie gives 0);
    A_i = 0  for every other sample, and for a group of one.
    std is unbiased; ``norm_by_std=False`` drops the division. returns = advantages.
    """
    valid = _check(token_level_rewards, response_mask, index)
    index = _need_index("grpo_passk", index)
    s = _outcome_scores(token_level_rewards.double(), valid)
    _, std, _ = group_stats(s, index)
    a = torch.zeros_like(s)
    for g in torch.unique(index):
        rows = (index == g).nonzero().flatten()
        if rows.numel() < 2:
            continue
        top = torch.topk(s[rows], 2, sorted=True).values
        best = rows[int(torch.argmax(s[rows]))]  # argmax returns the first maximum
        gap = top[0] - top[1]
        if norm_by_std:
            den = std[best] + epsilon
            gap = gap / den if den > 0 else torch.zeros_like(gap)
        a[best] = gap
    adv = _broadcast(a, valid, token_level_rewards.dtype)
    return adv, adv


@ADV_ESTIMATORS.register("opo", requires=("index",))
@torch.no_grad()
def opo(
    token_level_rewards: Tensor, response_mask: Tensor, *, index: Tensor | None = None, **_
) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025, arXiv 2505.23585): the length-weighted optimal baseline.

    b_g = sum_{j in g} |o_j| s_j / sum_{j in g} |o_j|,   A_i = s_i - b_g,   |o_j| = valid tokens of j.
    A group of one (or of empty responses only) has advantage 0. returns = advantages.
    """
    valid = _check(token_level_rewards, response_mask, index)
    index = _need_index("opo", index)
    s = _outcome_scores(token_level_rewards.double(), valid)
    length = valid.sum(-1).double()
    uniq, inv = torch.unique(index, return_inverse=True)
    num = s.new_zeros(uniq.numel()).index_add_(0, inv, length * s)
    den = s.new_zeros(uniq.numel()).index_add_(0, inv, length)
    n = torch.bincount(inv, minlength=uniq.numel())[inv]
    ok = (n > 1) & (den[inv] > 0)
    base = num[inv] / torch.where(ok, den[inv], torch.ones_like(den[inv]))
    a = torch.where(ok, s - base, torch.zeros_like(s))
    adv = _broadcast(a, valid, token_level_rewards.dtype)
    return adv, adv


@ADV_ESTIMATORS.register("gpg", requires=("index",))
@torch.no_grad()
def gpg(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    index: Tensor | None = None,
    reduce: Reduce | None = None,
    **_,
) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025, arXiv 2504.02546): group mean baseline, no std, rescaled by the share of
    samples with a non-zero reward.

    A_i = alpha * (s_i - mean_g(s)),  alpha = B / max(M, 1),  B = samples in the global batch,
    M = samples whose outcome score s_i != 0 (both counted over every rank via ``reduce``).
    A group of one has advantage 0. returns = advantages. Pair with ``actor.policy_loss = "gpg"``.
    """
    valid = _check(token_level_rewards, response_mask, index)
    index = _need_index("gpg", index)
    s = _outcome_scores(token_level_rewards.double(), valid)
    mean, _, n = group_stats(s, index)
    counts = torch.stack([s.new_tensor(float(s.numel())), (s != 0).sum().double()])
    if reduce is not None:
        counts = reduce(counts).to(device=s.device, dtype=torch.float64)
    alpha = counts[0] / counts[1].clamp_min(1)
    a = torch.where(n > 1, alpha * (s - mean), torch.zeros_like(s))
    adv = _broadcast(a, valid, token_level_rewards.dtype)
    return adv, adv
