"""The contract every training backend implements (the FSDP2 and Megatron-core engines): `TrainEngine`,
`AdapterEngine` for an engine that trains LoRA adapters, and `ScoreEngine` for a reward model.

The loop, checkpoints and the weight sync call only these protocols' members (tests/test_repo.py checks
spmdrl/loop/, spmdrl/reshard/ and spmdrl/checkpoint/). Nothing outside `spmdrl/engines/` imports a backend's
internals (FSDP, DTensor, `.hf`, `.module`).

Loss-scale contract of `train_step`: the engine sums the gradients of the micro-batch losses it is given and
AVERAGES them over the data-parallel ranks of its mesh (FSDP2's reduce-scatter, Megatron's DDP both do).
A caller that wants the gradient of a global objective sum_i l_i / N (N = tokens or sequences of the whole
mini-batch over all dp ranks) therefore passes, for each micro-batch, loss = dp * sum_{i in micro} l_i / N.
The engine adds no scaling of its own (no division by the number of micro-batches).

Micro-batch contract of `train_step(micro_batches, loss_fn)`:
- each item of `micro_batches` is a tuple whose item [1] is the micro-batch's TokenBatch
  (spmdrl.engines.token_batch); the engine stages and runs [1] and hands the whole item, untouched, to loss_fn
  (the loop's items are loop/update.MicroBatch: samples, tokens, unit_share, token_share);
- loss_fn(item, engine) -> (loss, metrics) reads the engine's heads (`engine.logprobs`, `engine.values`) on
  item[1]; the engine calls it once per item where the heads run under autograd, and it may call it again: on
  pipeline stages other than the last, the Megatron engine replays loss_fn after the schedule on the last stage's
  broadcast, detached head outputs, so that its metrics are the same on every rank (those losses are not
  differentiated). loss_fn must therefore return the same metrics for the same heads and keep no state that a
  replay would count twice.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Protocol, runtime_checkable

import torch

from spmdrl.dist.blocks import Block

if TYPE_CHECKING:
    from spmdrl.dist.meshes import RoleMesh

OFFLOAD_KINDS = ("params", "grads", "optimizer")


@runtime_checkable
class TrainEngine(Protocol):
    """One model of one role, sharded over that role's mesh."""

    trainable: bool
    mesh: "RoleMesh"  # the role's (dp, pp, tp) mesh (spmdrl.dist.meshes)
    device: torch.device  # where its parameters and the forward heads' results live
    lora: object  # LoRA settings (spmdrl.models.lora.LoraSettings) when the engine trains adapters, else None

    # ---- forward heads on a token batch (spmdrl.engines.token_batch.TokenBatch) -----------------------
    def logprobs(self, tb, *, temperature: float = 1.0, with_entropy: bool = False, chunk_size: int = 1024,
                 top_k: int = -1, top_p: float = 1.0):
        """(log p(response token) [B, R], entropy [B, R] or None), temperature applied to the logits first; with
        top_k > 0 or top_p < 1 also the sampler's truncation (spmdrl.algos.token_stats.truncate_logits), so p is
        the distribution vLLM samples from (its processed log-probs)."""

    def values(self, tb) -> torch.Tensor:
        """Critic values [B, R] at response positions (value-head engines only)."""

    def forward_micro_batches(self, tbs: list, head: str, **head_kw) -> list[torch.Tensor]:
        """Forward-only pass (no autograd) over several token batches: head "logprobs" (head_kw: temperature,
        chunk_size, top_k, top_p, as for logprobs; log p of the response tokens) or "values" (value-head engines).
        One float32 [B_i, R_i] per batch, on the engine's device (not copied to the host), the same on every rank
        of the mesh. The Megatron engine runs them all in one pipeline schedule; FSDP one forward per batch
        (forward_each)."""

    def eval(self) -> None:
        """Switch to inference mode (dropout off) before forward-only passes."""

    # ---- compute paths, for the parity check (spmdrl/loop/parity.py) -----------------------------------
    compute: tuple[str, str]
    """(attention, head) the forwards run with (FSDP2: attention "spmdrl" | "sdpa" | "eager", head "fused" |
    "model"; Megatron: ("megatron", "megatron"))."""

    def compute_options(self) -> list[tuple[str, str]]:
        """The compute paths the parity check may switch to, fastest first, the current one included."""

    def set_compute(self, attention: str, head: str) -> None:
        """Run the forwards with one of compute_options()."""

    def reference_logprobs(self, tb, *, temperature: float = 1.0) -> torch.Tensor | None:
        """log p(response token) [B, R] from transformers' own, unmodified forward of the engine's weights (the
        parity check's reference for the engine's kernels), the same on every rank; None for a backend that does
        not run transformers' modeling code."""

    def module_summary(self) -> str:
        """The model's class and its decoder layer's module types, for messages."""

    def moe_losses(self):
        """A mixture-of-experts model's (load-balancing loss, z-loss) of the last forward under autograd, summed over
        its MoE layers, differentiable; None for a dense model or an engine built without them."""

    def moe_counts(self) -> dict[str, torch.Tensor]:
        """A mixture-of-experts model's router counts summed over the forwards since the last call, for
        engines/router_replay.router_metrics (agreement with the rollout's routes, tokens per expert); {} for a
        dense model or a backend that does not count."""

    # ---- update -------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list, loss_fn: Callable) -> dict[str, float]:
        """One optimizer step; loss_fn(micro, engine) -> (loss, metrics). See the module docstring for how the
        loss must be scaled. Returns summed-over-micro-batches metrics divided by their count, plus grad_norm,
        lr and skipped_step (a non-finite grad norm skips the step)."""

    # ---- weights out ----------------------------------------------------------------------------------
    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter as (HF name, full shape), in a fixed order shared by all ranks."""

    def source_blocks(self) -> dict[str, list[tuple[int, Block]]]:
        """For every parameter, the block each global rank of the mesh holds (pure arithmetic, no communication)."""

    def weight_shards(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor, Block]]:
        """(HF name, local tensor, its block in the full tensor) for what this rank holds; no communication."""

    def hf_config(self):
        """The HF model config (what export and the rollout need)."""

    def export_hf(self, out_dir: str, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        """Write an HF model directory; every rank of the mesh calls it, one rank writes."""

    # ---- checkpoints --------------------------------------------------------------------------------
    def checkpoint_access(self) -> ContextManager[None]:
        """A context in which checkpoint_state's tensors can be read and loaded into: an engine that parks state
        in host memory brings back what a checkpoint holds (params, optimizer; never gradients) and parks it
        again on exit. The checkpoint manager enters it for one engine at a time."""

    def checkpoint_state(self) -> tuple[dict, dict]:
        """(tensors for torch.distributed.checkpoint, JSON-able metadata: optimizer param groups, scheduler)."""

    def load_checkpoint_state(self, tensors: dict, meta: dict) -> None:
        """Restore what checkpoint_state returned (tensors already loaded in place by DCP)."""

    def param_manifest(self) -> list:
        """[name, shape, dtype] per saved parameter (for compatibility checks on resume)."""

    def hf_prefix(self) -> str:
        """Prefix of the HF model's parameter names inside the checkpointed root module ("" when there is none)."""

    # ---- memory -------------------------------------------------------------------------------------
    def offload(self, kinds: tuple[str, ...] = OFFLOAD_KINDS) -> None:
        """Move the named kinds of state (params / grads / optimizer) to host memory (GPU only; no-op on CPU)."""

    def onload(self, kinds: tuple[str, ...] = OFFLOAD_KINDS) -> None:
        """Bring offloaded state back to the device."""

    def resident_bytes(self) -> dict[str, int]:
        """{params, grads, optimizer: bytes of this rank's state of that kind on `device` now}: each storage
        counted once, offloaded state and freed gradients as 0. The per-component memory figures
        (`logging.memory_components`) and the one-GPU rehearsal compare these with `spmdrl plan`."""


@runtime_checkable
class AdapterEngine(TrainEngine, Protocol):
    """A TrainEngine that trains LoRA adapters on a frozen base model (`lora` is not None; docs/lora.md): the
    loop computes the reference policy with the adapters disabled, the weight sync sends only the adapters, and
    a checkpoint records their adapter_config."""

    def adapters_disabled(self) -> ContextManager[None]:
        """A context in which the forward heads compute the base model alone (the reference policy)."""

    def adapter_tensors(self, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
        """Every adapter tensor, whole, on CPU, named as PEFT's save_pretrained names them; on every rank."""

    def adapter_config(self) -> dict:
        """The adapter_config.json PEFT writes for these adapters."""


@runtime_checkable
class ScoreEngine(Protocol):
    """A forward-only sequence-classification model (a reward model), sharded over its role's mesh."""

    mesh: "RoleMesh"
    vocab_size: int  # the model's embedding rows: token ids at or above it are refused before scoring

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The score [B] (float32, on the engine's device) of each padded token row [B, L] at its last attended
        position; every rank of the mesh calls it the same number of times, with rows of its own."""


def unique_storages(tensors) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages behind `tensors` (views of one buffer count once; DTensors by their local
    shard; None skipped), in first-seen order."""
    seen, out = set(), []
    for t in tensors:
        if t is None:
            continue
        st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(st)
    return out


def state_storages(params, grads, optimizer) -> dict[str, list[torch.UntypedStorage]]:
    """An engine's state by offload kind, each storage once: a gradient or optimizer storage that is a
    parameter's (torch AdamW updates the parameters themselves) belongs to "params"."""
    out = {"params": unique_storages(params)}
    taken = {st.data_ptr() for st in out["params"]}
    for kind, tensors in (("grads", grads), ("optimizer", optimizer)):
        out[kind] = [st for st in unique_storages(tensors) if st.data_ptr() not in taken]
    return out


def resident(storages: dict[str, list[torch.UntypedStorage]], device: torch.device) -> dict[str, int]:
    """{kind: bytes of its storages on `device`'s type} (TrainEngine.resident_bytes)."""
    return {kind: sum(st.nbytes() for st in sts if st.device.type == device.type) for kind, sts in storages.items()}


def forward_each(engine: TrainEngine, tbs: list, head: str, **head_kw) -> list[torch.Tensor]:
    """forward_micro_batches as one logprobs / values call per token batch (engines that gain nothing from
    running them together)."""
    if head == "logprobs":
        return [engine.logprobs(tb, **head_kw)[0].float() for tb in tbs]
    if head == "values" and not head_kw:
        return [engine.values(tb).float() for tb in tbs]
    raise ValueError(f"forward_micro_batches: head {head!r} with {sorted(head_kw)} (logprobs or values)")


def clipped_step(optimizer, clip_grad_norm: Callable[[], float]) -> tuple[float, bool]:
    """Clip the gradients, step only when their norm is finite (a non-finite step is skipped and counted by the
    trainer), and free the gradients. Returns (grad norm, finite)."""
    grad_norm = clip_grad_norm()
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, finite


def accumulate(sums: dict, metrics: dict) -> None:
    """Add one micro-batch's metrics into `sums` without reading them: values stay tensors (0-dim, on whatever
    device the loss ran) until step_metrics copies them to the host once per optimizer step, so the
    micro-batch loop never waits for the device. Plain floats are summed as they are."""
    for k, v in metrics.items():
        v = v.detach() if isinstance(v, torch.Tensor) else v
        sums[k] = sums[k] + v if k in sums else v


def host_floats(values: dict) -> dict[str, float]:
    """{name: float} of a dict of 0-dim tensors and floats, with one device-to-host copy for all the tensors
    that share a device (instead of one blocking copy per value)."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    by_device: dict = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        stacked = torch.stack([values[k].detach().reshape(()).double() for k in keys]).cpu().tolist()
        out.update(zip(keys, stacked))
    return out


def step_metrics(sums: dict, n: int, grad_norm: float, finite: bool, scheduler) -> dict[str, float]:
    """train_step's result, shared by the backends: the micro-batch mean of each loss metric (`sums` from
    accumulate: read from the device here, once), the grad norm, the lr the step used and whether it was skipped;
    advances the lr scheduler."""
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    out = {k: v / n for k, v in host_floats(sums).items()}
    out.update(grad_norm=grad_norm, lr=lr, skipped_step=0.0 if finite else 1.0)
    return out


def lr_lambda(warmup: int, total: int, schedule: str, min_ratio: float) -> Callable[[int], float]:
    """The learning-rate multiplier of each optimizer step (torch's LambdaLR), shared by the backends: linear
    warmup over `warmup` steps, then constant, linear or cosine decay to min_ratio at step `total`."""
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return min_ratio + (1 - min_ratio) * (1 - progress)

    return f
