"""Parking a Megatron engine's idle state in host memory, in place.

megatron's DDP keeps parameters (with the distributed optimizer) and gradients in contiguous buffers that many
tensors view: param.data, param.main_grad, the buckets' param_data / grad_data, the distributed optimizer's
shard views, and the fp32 main params are keys of the optimizer's state and values of param.main_param.
Replacing any of those tensors would leave stale views behind. So nothing is replaced: each distinct storage
is copied to (pinned, on CUDA) host memory and resized to 0 bytes, which frees its device memory while every
tensor object and view keeps pointing at the same storage; onload resizes it back and copies the bytes in.
(megatron's own _ParamAndGradBuffer.offload_to_cpu works the same way.)

A storage whose values are not needed (the gradient buffers: train_step zeroes them before its first backward)
is freed without a copy and comes back zero-filled.

Host copies are cut into power-of-two pieces (the set bits of the byte count, the tail below 64 KiB in one piece):
torch's pinned-memory allocator rounds every request up to a power of two and caches the blocks, so one 9 GiB
buffer would pin 16 GiB; cut this way nothing is rounded up except the tail (< 64 KiB per storage).
"""
from __future__ import annotations

import torch


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (storage offsets and dtypes of its views do not matter)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


TAIL = 1 << 16


def pieces(n: int) -> list[tuple[int, int]]:
    """(offset, size) of the power-of-two pieces of n bytes, largest first; the part below TAIL is one piece."""
    out, off = [], 0
    for bit in range(n.bit_length() - 1, TAIL.bit_length() - 2, -1):  # bits >= log2(TAIL)
        if n >> bit & 1:
            out.append((off, 1 << bit))
            off += 1 << bit
    if n > off:
        out.append((off, n - off))
    return out


class HostStash:
    """Storages parked per kind ("params", "grads", "optimizer"); park / unpark of a kind twice is a no-op."""

    def __init__(self, pin: bool):
        self.pin = pin  # pinned host memory: CUDA only (pinning needs a CUDA context)
        self._parked: dict[str, list[tuple[torch.UntypedStorage, list[torch.Tensor] | None, int]]] = {}

    def parked(self, kind: str) -> bool:
        return kind in self._parked

    def park(self, kind: str, storages: list[torch.UntypedStorage], keep_values: bool = True) -> int:
        """Copy each storage to host memory (unless not keep_values), then free its device memory. Returns the
        bytes freed."""
        if kind in self._parked:
            return 0
        entries = []
        for st in storages:
            host = None
            if keep_values:
                flat, host = _bytes(st), []
                for off, size in pieces(st.nbytes()):
                    host.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
                    host[-1].copy_(flat[off: off + size], non_blocking=self.pin)
            entries.append((st, host, st.nbytes()))
        if self.pin:
            torch.cuda.synchronize()  # the host copies are complete before the device memory can be reused
        for st, _, _ in entries:
            st.resize_(0)
        self._parked[kind] = entries
        return sum(n for _, _, n in entries)

    def unpark(self, kind: str) -> None:
        """Reallocate each parked storage at its old size and copy its bytes back (zeros when not kept); the host
        copies are released once the copies are done."""
        entries = self._parked.pop(kind, None)
        if entries is None:
            return
        for st, host, n in entries:
            st.resize_(n)
            flat = _bytes(st)
            if host is None:
                flat.zero_()
                continue
            for (off, size), h in zip(pieces(n), host):
                flat[off: off + size].copy_(h, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()  # before the pinned host blocks go back to the host allocator


def torch_optimizers(opt) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (ChainedOptimizer -> DistributedOptimizer -> Adam) or a
    plain torch optimizer."""
    if opt is None:  # a stub optimizer (no parameters on this rank)
        return []
    if isinstance(opt, torch.optim.Optimizer):
        return [opt]
    if hasattr(opt, "chained_optimizers"):
        return [o for c in opt.chained_optimizers for o in torch_optimizers(c)]
    return torch_optimizers(opt.optimizer)


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """Everything an optimizer owns that scales with the model: the parameters it updates (the distributed
    optimizer's fp32 main-param shards; the model's own params for torch AdamW on CPU) and its state tensors
    (Adam moments). 0-dim tensors (step counters) stay where they are."""
    from .host_optim import MasterAdamW

    if isinstance(opt, MasterAdamW):
        return opt.tensors()
    out = []
    for o in torch_optimizers(opt):
        for group in o.param_groups:
            out += list(group["params"])
        for state in o.state.values():
            out += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return out
