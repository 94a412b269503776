"""One owner of GPU memory: the phases of a colocated RL step and the transitions between them.

The trainer only says which phase comes next; this object moves state so the phase fits:

    begin_build / adopt  each training engine's configured kinds go to host memory as soon as it is built
    settle()             before vLLM is built: every role's configured kinds in host memory
    for_checkpoint(..)   vLLM sleeps, every role's configured kinds in host memory; the checkpoint manager brings
                         back one engine's params and optimizer state at a time (never gradients)
    for_rollout()        every role's configured kinds to host, training buffers freed (empty_cache); vLLM wakes
                         its KV cache (its weights came with the sync)
    for_training(role)   vLLM sleeps at level 2 (weights and KV dropped: the next sync restores the weights);
                         the other roles' configured kinds go to host memory; `role` is onloaded
    for_sync()           every role's configured kinds go to host memory, the actor's params stay; empty_cache so
                         PyTorch's caching allocator gives its freed blocks back before vLLM's cuMem wake; vLLM
                         wakes its weights only

Offload is per role and per kind (params / grads / optimizer: memory.<role>_offload). FSDP2 frees gradients at
the end of every train_step (zero_grad(set_to_none=True)), so "grads" has nothing to move between phases; the
Megatron engine's DDP grad buffers persist, and "grads" frees them (docs/megatron.md#offload).

Every transition closes the current phase and opens the next: the phase's peak allocated / reserved bytes
(torch's allocator, reset at each phase; plus vLLM's cuMem pool where vLLM reports it) become
memory/<phase>_allocated_gb and memory/<phase>_reserved_gb, maxed over the step; memory/host_rss_gb is this
rank's resident set. On CPU, sleep and offload are no-ops and allocated/reserved report 0; RSS is real.

With `components` (memory.report_components), each phase also reports what it holds, component by component,
maxed over the step: memory/<phase>/<role>_<kind>_gb, the bytes of each engine's params / grads / optimizer on
the device at the phase's end (TrainEngine.resident_bytes: real tensor bytes, on CPU too), and on CUDA
memory/<phase>/vllm_pool_gb and memory/<phase>/transient_gb = the phase's peak allocated minus those resident
bytes and vLLM's pool: activations, gradients that live only inside an update (FSDP2 frees them at its end),
logits, sync buckets.
"""
from __future__ import annotations

import os

import torch

GIB = 2**30
ALL_KINDS = ("params", "grads", "optimizer")


def host_rss_bytes() -> int:
    """This process's current resident set size (Linux /proc; falls back to the peak on other systems)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def vllm_pool_bytes() -> int:
    """Bytes vLLM's sleep-mode allocator (CuMemAllocator) holds on this GPU; 0 where vLLM does not report it."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator

        return int(CuMemAllocator.get_instance().get_current_usage())
    except Exception:  # no vLLM, no CUDA build of it, or sleep mode off
        return 0


class MemoryLifecycle:
    """Phase transitions and per-phase memory metrics for colocated placement."""

    def __init__(self, device: torch.device, engines: dict, offload: dict[str, list[str]], rollout=None,
                 components: bool = False):
        self.device, self.cuda = device, device.type == "cuda"
        self.components = components
        self._parts: dict[str, float] = {}
        self._kinds = offload
        self.engines: dict = {}
        self.offload: dict[str, tuple[str, ...]] = {}
        self.rollout = rollout
        self.phase: str | None = None
        self._peaks: dict[str, tuple[float, float]] = {}
        for role, engine in engines.items():
            if engine is not None:
                self.engines[role] = engine
                self.offload[role] = tuple(k for k in offload.get(role, ()) if k in ALL_KINDS)

    # ---- transitions ----------------------------------------------------------------------------------
    def begin_build(self) -> None:
        """Before the first training engine is built: the "build" phase, which `adopt` fills engine by engine."""
        self._enter("build")

    def adopt(self, role: str, engine) -> None:
        """Right after `engine` is built: its configured kinds go to host memory before the next engine is built,
        so the build's peak is one engine's full state next to what the others keep on the device."""
        self.engines[role] = engine
        self.offload[role] = tuple(k for k in self._kinds.get(role, ()) if k in ALL_KINDS)
        self._offload(role, self.offload[role])
        self._empty_cache()

    def settle(self) -> None:
        """After building the training engines, before vLLM is built: every role's configured kinds in host
        memory (adopt already moved them), so vLLM finds its share of the GPU free."""
        self._enter("load")
        for role in self.engines:
            self._offload(role, self.offload[role])
        self._empty_cache()

    def for_checkpoint(self, phase: str, keep_rollout_weights: bool) -> None:
        """Before a checkpoint is saved ("checkpoint_save") or loaded ("resume"): vLLM sleeps where it shares the
        device with training engines (level 1 keeps its weights in host memory for the next wake; level 2 drops
        them, for a resume whose weight sync refills them), and every role's configured kinds are in host memory.
        The checkpoint manager then brings back one engine's checkpointed state at a time
        (TrainEngine.checkpoint_access)."""
        self._enter(phase)
        if self.rollout is not None and self.engines:
            self.rollout.sleep(level=1 if keep_rollout_weights else 2)
        for role in self.engines:
            self._offload(role, self.offload[role])
        self._empty_cache()

    def for_rollout(self) -> None:
        if self.phase == "rollout":
            return
        self._enter("rollout")
        for role in self.engines:  # the actor's params too, when configured: the sync was their last use
            self._offload(role, self.offload[role])
        self._empty_cache()  # the sync's buckets and the update's freed blocks go back before vLLM takes its KV
        if self.rollout is not None:
            self.rollout.wake_up(tags=["weights", "kv_cache"])  # weights: already awake after a sync

    def for_training(self, role: str, update: bool = True, keep_rollout_weights: bool = False) -> None:
        """The next phase runs `role`: an update (all its state onloaded) or a forward (params only). vLLM sleeps
        at level 2, or level 1 (weights kept on the host) when no weight sync follows (critic warmup)."""
        name = f"train_{role}" if update else f"{role}_forward"
        if self.phase == name:
            return
        self._enter(name)
        if self.rollout is not None:
            self.rollout.sleep(level=1 if keep_rollout_weights else 2)
        for other in self.engines:
            if other != role:
                self._offload(other, self.offload[other])
        self._empty_cache()
        if role in self.engines:
            self._onload(role, ALL_KINDS if update else ("params",))

    def for_sync(self) -> None:
        """Actor params on the GPU, everything else configured out, vLLM's weights (not its KV cache) awake. The
        loop calls it on the line before a sync; the sync objects call it again, a no-op then."""
        if self.phase == "sync":
            return
        self._enter("sync")
        for role in self.engines:
            kinds = tuple(k for k in self.offload[role] if not (role == "actor" and k == "params"))
            self._offload(role, kinds)
        if "actor" in self.engines and "params" in self.offload["actor"]:
            self._onload("actor", ("params",))
        self._empty_cache()  # without it the caching allocator keeps the update's blocks and vLLM's wake fails
        if self.rollout is not None:
            self.rollout.wake_up(tags=["weights"])

    # ---- metrics --------------------------------------------------------------------------------------
    def step_metrics(self) -> dict[str, float]:
        """Peaks per phase since the last call (each phase's max over the step), and this rank's RSS."""
        self._close()
        out = {}
        for phase, (alloc, reserved) in self._peaks.items():
            out[f"memory/{phase}_allocated_gb"] = alloc / GIB
            out[f"memory/{phase}_reserved_gb"] = reserved / GIB
        out.update({k: v / GIB for k, v in self._parts.items()})
        out["memory/host_rss_gb"] = host_rss_bytes() / GIB
        self._peaks, self._parts = {}, {}
        if self.phase is not None and self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)  # the open phase counts from here in the next step
        return out

    # ---- internals ------------------------------------------------------------------------------------
    def _enter(self, phase: str) -> None:
        self._close()
        self.phase = phase
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _close(self) -> None:
        if self.phase is None:
            return
        if self.cuda:
            pool = vllm_pool_bytes()
            alloc = torch.cuda.max_memory_allocated(self.device) + pool
            reserved = torch.cuda.max_memory_reserved(self.device) + pool
        else:
            alloc = reserved = 0.0
        a, r = self._peaks.get(self.phase, (0.0, 0.0))
        self._peaks[self.phase] = (max(a, alloc), max(r, reserved))
        if self.components:
            self._record_parts(alloc, pool if self.cuda else 0)

    def _record_parts(self, peak: float, pool: int) -> None:
        parts = {f"{role}_{kind}": b for role, engine in self.engines.items()
                 for kind, b in engine.resident_bytes().items()}
        if self.cuda:
            parts["vllm_pool"] = pool
            parts["transient"] = max(0.0, peak - sum(parts.values()))
        for name, b in parts.items():
            key = f"memory/{self.phase}/{name}_gb"
            self._parts[key] = max(self._parts.get(key, 0.0), b)

    def _offload(self, role: str, kinds: tuple[str, ...]) -> None:
        if kinds:  # the engines decide what moves (nothing on CPU, where the state is in host memory already)
            self.engines[role].offload(kinds)

    def _onload(self, role: str, kinds: tuple[str, ...] = ALL_KINDS) -> None:
        self.engines[role].onload(kinds)

    def _empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
