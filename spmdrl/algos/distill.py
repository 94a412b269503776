"""On-policy distillation: per-token terms that pull the student (the actor) towards a frozen teacher on the
tokens the student sampled (docs/distillation.md).

Every mode has one signature and declares, as `stage`, where its term enters the step:

    fn(student_log_prob [B, T], teacher_log_prob [B, T], response_mask [B, T], *, kl_type="k2") -> [B, T]

stage "advantage": the term is added, times distill.coef, to the advantages of the sampled tokens, and the policy
loss (with its importance ratio and clipping) optimises it; student_log_prob is the student's log-prob before the
update (the old log-probs). stage "loss": the term is aggregated like the policy loss and added, times
distill.coef, to the actor's loss; student_log_prob is the differentiated log-prob of the update.

Only valid tokens count (response_mask: in a multi-turn trajectory the model's own tokens; tool output is 0);
masked positions come back 0. The teacher is scored at the same temperature as the student (rollout.temperature).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from spmdrl.algos.kl import KL_ESTIMATORS
from spmdrl.registry import Registry

DistillFn = Callable[..., Tensor]
DISTILL_MODES: Registry[DistillFn] = Registry("distillation mode")


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


@DISTILL_MODES.register("reverse_kl", stage="advantage")
@torch.no_grad()
def reverse_kl_advantage(student_log_prob: Tensor, teacher_log_prob: Tensor, response_mask: Tensor, **_) -> Tensor:
    """A_t = -(log pi_student(a_t) - log pi_teacher(a_t)) = log pi_teacher(a_t) - log pi_student(a_t), per sampled
    token, no discounting: the negative of the single-sample (k1) estimate of the reverse KL
    KL(pi_student || pi_teacher) at that position. Its policy gradient E[A_t grad log pi_student(a_t)] is minus the
    gradient of the per-token reverse KL (on-policy distillation as in Agarwal et al. 2024, GKD with lambda = 1,
    and Thinking Machines' "On-Policy Distillation", 2025)."""
    return _masked(teacher_log_prob - student_log_prob, response_mask)


@DISTILL_MODES.register("kl_loss", stage="loss")
def kl_loss_term(student_log_prob: Tensor, teacher_log_prob: Tensor, response_mask: Tensor, *, kl_type: str = "k2",
                 **_) -> Tensor:
    """l_t = k(log pi_student(a_t), log pi_teacher(a_t)) with k the KL estimator kl_type of spmdrl.algos.kl (k1:
    logp_s - logp_t; k2: 0.5 (logp_s - logp_t)^2; k3: exp(d) - d - 1 with d = logp_t - logp_s; the '+' variants:
    the value of k1 / k3 with the gradient of k2), an estimate of KL(pi_student || pi_teacher) at the sampled
    token, differentiated through log pi_student. On the student's own samples, k2's gradient
    (logp_s - logp_t) grad logp_s has the expectation of the reverse KL's gradient."""
    return _masked(KL_ESTIMATORS.get(kl_type)(student_log_prob, teacher_log_prob), response_mask)


@torch.no_grad()
def distill_sums(student_log_prob: Tensor, teacher_log_prob: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """What distill/* metrics are made of, over one rank's valid tokens, in float64: sums [sum_t (logp_s - logp_t),
    sum_t logp_t, sum_t logp_s, tokens] (to be summed over ranks) and maxima [max_t (logp_s - logp_t)] (to be
    maxed over ranks; -inf without a valid token)."""
    valid = response_mask != 0
    s, t = student_log_prob.double(), teacher_log_prob.double()
    kl = (s - t)[valid]
    sums = torch.stack([kl.sum(), t[valid].sum(), s[valid].sum(), valid.sum().double()])
    top = kl.max() if kl.numel() else torch.tensor(float("-inf"), dtype=torch.float64)
    return sums, top.reshape(1)
