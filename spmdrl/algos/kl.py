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
