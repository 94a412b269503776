"""AdamW over float32 master weights kept apart from the model: the Megatron backend's optimizer when the model
weights are not float32 on the CPU path, and on any device with `memory.<role>_host_optimizer` (the master weights,
their gradients and AdamW's moments in host memory, the step on the CPU).

The model's parameters get their gradients in megatron DDP's float32 grad buffers (param.main_grad, all-reduced
over dp, an expert's over its expert-data-parallel group), which the engine clips in place. A step:

  1. master.grad <- param.main_grad       (float32; device -> host when the masters are in host memory)
  2. torch AdamW on the masters       (fused: one pass over each tensor; on the CPU for host masters)
  3. param <- master                  (cast to the model's dtype; host -> device)

Memory per local parameter: the model's weight (compute dtype) and float32 gradient on the device; 16 bytes where
the masters live (weight, gradient copy, exp_avg, exp_avg_sq). Unlike megatron's distributed optimizer nothing is
sharded over the data-parallel replicas: each rank keeps masters of all its local parameters (an expert's are held
by its expert-data-parallel replicas alike).

Checkpoints save the masters as "main" in HF coordinates, like the distributed optimizer's fp32 shards
(state.py), and the moments as the CPU path's AdamW moments.
"""
from __future__ import annotations

import torch


class MasterAdamW:
    """torch AdamW over float32 copies of `params`, placed on `where` (pinned when `pin`). `param_groups` and
    `state` are the inner AdamW's (the LR scheduler drives `inner`); state is keyed by the masters (`master`)."""

    def __init__(self, params: list[torch.nn.Parameter], where: torch.device, *, pin: bool, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float):
        self.params = params
        with torch.no_grad():
            self.masters = [self._alloc(p, where, pin).copy_(p) for p in params]
            for m in self.masters:
                m.grad = self._alloc(m, where, pin)
        self._of = {id(p): m for p, m in zip(params, self.masters)}
        # fused: one kernel per tensor on CUDA, one vectorised pass on the CPU (torch >= 2.4)
        self.inner = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                       fused=True)

    @staticmethod
    def _alloc(like: torch.Tensor, where: torch.device, pin: bool) -> torch.Tensor:
        return torch.zeros(like.shape, dtype=torch.float32, device=where, pin_memory=pin)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def master(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The float32 master of model parameter p (the key of its AdamW state)."""
        return self._of[id(p)]

    def step(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                # blocking: the CPU reads these right after (no device-specific wait needed)
                m.grad.copy_(p.main_grad)
            self.inner.step()
            for p, m in zip(self.params, self.masters):
                # queued behind the step's kernels; the next step's blocking gradient copies come after it on
                # the same stream, so the masters are not written before this copy has read them
                p.copy_(m, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to free: the gradients are megatron's grad buffers (zeroed by the engine before each step's
        first backward) and the masters' gradient copies, overwritten at the next step."""

    def tensors(self) -> list[torch.Tensor]:
        """Everything this optimizer owns that scales with the model: masters, their gradients, the moments."""
        out = [*self.masters, *(m.grad for m in self.masters)]
        for st in self.inner.state.values():
            out += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        return out
