"""Per-token KL estimators between the policy and the reference policy, and KL coefficient controllers.

Estimators take log pi(a_t) and log pi_ref(a_t) of the sampled token, [B, T] each, and return [B, T]
(Schulman, "Approximating KL Divergence", 2020). With samples from pi, k1 and k3 are unbiased for
KL(pi || pi_ref); k3 is always >= 0 and has low variance.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from spmdrl.errors import ConfigError, SpmdrlError
from spmdrl.registry import Registry

KLFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("kl estimator")


@KL_ESTIMATORS.register("k1", "kl")
def k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k1 = logp - logp_ref."""
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def kl_abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """|logp - logp_ref|."""
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("k2", "mse")
def k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k2 = 0.5 * (logp - logp_ref)^2."""
    return 0.5 * (log_prob - ref_log_prob) ** 2


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1 with d = clamp(logp_ref - logp, -20, 20); result clamped to [-10, 10]."""
    d = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


def _straight_through(value_fn: KLFn) -> KLFn:
    def fn(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
        grad = k2(log_prob, ref_log_prob)
        return value_fn(log_prob, ref_log_prob).detach() + grad - grad.detach()

    return fn


@KL_ESTIMATORS.register("k1+", "kl+")
def k1_plus(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k1+ = sg[k1] + k2 - sg[k2]: the value of k1, the gradient of k2 (straight-through).

    d/dlogp = logp - logp_ref, whose expectation under pi is the gradient of KL(pi || pi_ref); the
    gradients of k1 (1, zero in expectation) and k3 (1 - pi_ref/pi) are not. Same convention as verl's
    "k1+" / "kl+"; as a loss term (actor.kl_loss_type), not a reward penalty.
    """
    return _straight_through(k1)(log_prob, ref_log_prob)


@KL_ESTIMATORS.register("k3+", "low_var_kl+")
def k3_plus(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k3+ = sg[k3] + k2 - sg[k2]: the value of k3 (with its clamps), the gradient of k2 (straight-through)."""
    return _straight_through(k3)(log_prob, ref_log_prob)


def controller_kl(kl: Tensor, response_mask: Tensor, reduce: Callable[[Tensor], Tensor] | None = None) -> float:
    """The KL the adaptive controller is fed: the mean over sequences of each sequence's token-mean KL.

    KL_ctrl = (1 / N) sum_i (sum_t m_it kl_it / sum_t m_it) over the N sequences with at least one valid
    token, over the global batch (``reduce`` sums [sum of per-sequence means, N] over the actor's
    data-parallel ranks). verl's convention; a long response counts as much as a short one. 0 if N == 0.
    """
    valid = response_mask != 0
    has = valid.any(-1)
    per_seq = torch.where(valid, kl.double(), torch.zeros((), dtype=torch.float64, device=kl.device)).sum(-1)
    per_seq = per_seq / valid.sum(-1).clamp_min(1)
    stats = torch.stack([per_seq[has].sum(), has.sum().double()])
    if reduce is not None:
        stats = reduce(stats)
    return float(stats[0] / stats[1]) if float(stats[1]) > 0 else 0.0


def kl_penalty(
    log_prob: Tensor, ref_log_prob: Tensor, kind: str = "low_var_kl", *, response_mask: Tensor | None = None
) -> Tensor:
    """Per-token KL estimate [B, T] of estimator ``kind``; 0 on masked tokens when ``response_mask`` is given."""
    if log_prob.shape != ref_log_prob.shape:
        raise SpmdrlError(f"log_prob {tuple(log_prob.shape)} and ref_log_prob {tuple(ref_log_prob.shape)} differ")
    fn = KL_ESTIMATORS.get(kind)
    if response_mask is None:
        return fn(log_prob, ref_log_prob)
    valid = response_mask != 0
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    # zero the inputs first so a NaN in a masked slot cannot leak into the gradient
    kl = fn(torch.where(valid, log_prob, zero), torch.where(valid, ref_log_prob.to(log_prob.dtype), zero))
    return torch.where(valid, kl, zero)


class FixedKLController:
    """Constant KL coefficient beta."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """A fixed coefficient does not move."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive beta (Ziegler et al. 2019).

    e = clip(KL / KL_target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0 or target_kl <= 0 or horizon <= 0:
            raise ConfigError(
                "adaptive KL needs init_kl_coef >= 0, target_kl > 0, horizon > 0; got "
                f"{init_kl_coef}, {target_kl}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """One controller step after ``n_steps`` samples; a non-finite KL leaves beta unchanged."""
        if not math.isfinite(float(current_kl)):
            return
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
