"""Trainer = sampler, checked before step 1.

An RL update is only right if the actor's forward computes the distribution the rollout engine sampled from.
For an architecture neither spmdrl nor its tests know, three things can break that silently: spmdrl's kernels
(attention, the fused log-prob head) may not express something the model computes (a logit scale, attention
sinks, soft-capping), vLLM's implementation may differ from transformers', or the weight sync may misplace a
tensor. `ParityCheck.run` scores a few real samples before step 1:

    rollout   the rollout engine's log-probs of its own samples (the first prompts of the training set)
    actor     the actor's log-probs of the same tokens, as the update computes them
    model     transformers' own forward of the same weights (eager attention, the model's head; FSDP2 only)

and compares them with rollout.parity_tol (by precision, config/derived.py). actor = rollout passes. Otherwise,
where model.attn_implementation / model.logprob_head are "auto", the actor tries transformers' attention and
head, fastest first, and keeps the first that matches (one log line says which and why). If none does, the run
stops with one line: the largest differing token, the model's modules, and what to set.

Every rank computes the same samples and the verdict comes from maxima over the world, so all ranks decide alike.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from spmdrl.config.derived import parity_tolerance
from spmdrl.dist.collectives import reduce_max
from spmdrl.errors import ConfigError, SpmdrlError, summary
from spmdrl.loop.generate import request_seeds, rollout_to_batch
from spmdrl.rollout.base import SamplingSpec

log = logging.getLogger("spmdrl")

SYNC_BUG = ("the planned route learnt from vLLM's loaders misreads a tensor of this architecture; please report it "
            "with the model's config.json")
PROMPTS = 4  # samples scored: enough tokens to see a systematic difference, seconds on a CPU
MAX_TOKENS = 24


@dataclass
class Gap:
    """The largest |a - b| log-prob over the scored tokens, and where: sample, response position, token id."""

    value: float
    sample: int
    position: int
    token: int

    @staticmethod
    def of(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor) -> "Gap":
        d = torch.where(mask != 0, (a.double() - b.double()).abs(), 0.0)
        i = int(d.flatten().argmax())
        s, p = divmod(i, d.shape[1])
        return Gap(float(d.flatten()[i]), s, p, int(tokens[s, p]))

    def where(self) -> str:
        return f"{self.value:.3g} nats at sample {self.sample}, response token {self.position} (id {self.token})"


@dataclass
class Comparison:
    """One scoring of the samples: gaps[0] actor vs rollout, and with transformers' own forward gaps[1] model vs
    rollout and gaps[2] actor vs model (this rank's); worst: their maxima over the world."""

    batch: object
    gaps: list[Gap]
    worst: list[float]
    has_model: bool

    @property
    def tokens(self) -> int:
        return int(self.batch["response_mask"].sum())

    def metrics(self) -> dict[str, float]:
        out = {"parity/actor_vs_rollout": self.worst[0]}
        if self.has_model:
            out.update({"parity/model_vs_rollout": self.worst[1], "parity/actor_vs_model": self.worst[2]})
        return out


class ParityCheck:
    """cfg: the run's; actor: the actor engine; rollout: this rank's rollout engine; dataset: the training prompts;
    logprobs(engine, batch) -> [B, R]: the learner's forward pass (the update's micro-batching and temperature)."""

    def __init__(self, cfg, actor, rollout, dataset, pad_id: int, logprobs, on_gpu: bool, weight_sync):
        self.cfg, self.actor, self.rollout, self.dataset, self.pad_id = cfg, actor, rollout, dataset, pad_id
        self.logprobs, self.weight_sync = logprobs, weight_sync
        self.tol = parity_tolerance(cfg, on_gpu)

    def samples(self):
        """The first prompts of the training set, one sample each at the rollout temperature (no truncation: the
        model's whole distribution is compared), the same on every rank."""
        idx = list(range(min(PROMPTS, len(self.dataset))))
        prompts = [self.dataset.prompt_ids(i) for i in idx]
        spec = SamplingSpec(n=1, temperature=self.cfg.rollout.temperature or 1.0,
                            max_tokens=min(MAX_TOKENS, self.cfg.data.max_response_length))
        seeds = request_seeds(self.cfg.trainer.seed, 0, 0, len(idx))
        vision = self.dataset.batch(idx).vision  # a vision-language model's images (None for text)
        try:
            out = self.rollout.generate(prompts, spec, seeds, **({"vision": vision} if vision is not None else {}))
        except SpmdrlError:
            raise
        except Exception as e:  # the run's first generation: a model the engine builds but cannot run here
            log.debug("the parity check's generation failed", exc_info=True)
            raise ConfigError(f"parity check: the rollout engine cannot generate with model.path = "
                              f"{self.cfg.model.path!r} here ({summary(e)}); try rollout.model_impl = "
                              "'transformers' or rollout.engine = 'hf'") from None
        batch = rollout_to_batch(prompts, idx, out, 1, self.pad_id)
        if vision is not None:
            batch.meta["vision"] = vision
        return batch

    def run(self, memory, synced: bool) -> dict[str, float]:
        """Check, switch the actor's compute path if that closes the gap, or raise ConfigError. Returns the
        parity/* metrics (logged with the run's first step). synced: the rollout engine's weights came through the weight sync;
        otherwise (it read the checkpoint itself) the engine is checked as loaded, then once more after one sync,
        so a difference is put down to the right side: the model's computation or the sync."""
        c = self._compare(memory)
        if not c.worst[0] <= self.tol:  # NaN fails too
            c = self._switch_or_refuse(c, diagnose_sync=synced)
        if not synced:
            memory.for_sync()
            self.weight_sync()
            after = self._compare(memory)
            if not after.worst[0] <= self.tol:
                raise ConfigError(self._sync_refusal(after, self._sync_check() or "the engine's loaders then read "
                                                     "other values than the sync delivered"))
            c = after
        self.rollout.forget_prefixes()  # step 1 samples as it would without the check
        log.info("parity check: the actor's log-probs equal the rollout engine's: largest |diff| %.2g nats over %d "
                 "tokens (tolerance %.2g)%s", c.worst[0], c.tokens, self.tol,
                 f"; transformers' own forward: {c.worst[1]:.2g}" if c.has_model else "")
        return c.metrics()

    def _compare(self, memory) -> "Comparison":
        memory.for_rollout()
        batch = self.samples()
        memory.for_training("actor", update=False)
        mask, tokens, sampled = batch["response_mask"], batch["responses"], batch["rollout_log_probs"]
        actor = self.logprobs(self.actor, batch)
        model = self._reference(batch, self.cfg.rollout.temperature or 1.0)
        gaps = [Gap.of(actor, sampled, mask, tokens)]
        if model is not None:
            gaps += [Gap.of(model, sampled, mask, tokens), Gap.of(actor, model, mask, tokens)]
        worst = reduce_max(torch.tensor([g.value for g in gaps], dtype=torch.float64))
        return Comparison(batch, gaps, worst, model is not None)

    def _switch_or_refuse(self, c: "Comparison", diagnose_sync: bool) -> "Comparison":
        """The actor's other compute paths, fastest first: the first that matches the rollout is kept (one line);
        none: ConfigError naming the side that differs."""
        first = self.actor.compute
        for option in self.actor.compute_options():
            if option == first:
                continue
            try:
                self.actor.set_compute(*option)
            except (ValueError, ConfigError) as e:  # transformers refuses that attention for this model
                log.info("parity check: %s cannot run %s (%s)", self.actor.module_summary(), _describe_path(option),
                         str(e).splitlines()[0][:160])
                continue
            b = c.batch
            gap = Gap.of(self.logprobs(self.actor, b), b["rollout_log_probs"], b["response_mask"], b["responses"])
            value = reduce_max(torch.tensor([gap.value], dtype=torch.float64))[0]
            if value <= self.tol:  # NaN never does
                log.info("parity check: %s does not compute what %s does (actor vs rollout: %s); the training engines "
                         "run %s instead (slower), which matches within %.2g nats", _describe(first, option),
                         self.actor.module_summary(), c.gaps[0].where(), _describe_path(option), value)
                c.worst[0] = value
                return c
        self.actor.set_compute(*first)
        # the actor computes transformers' function, the rollout another
        vllm_differs = not c.has_model or (c.worst[2] <= self.tol and not c.worst[1] <= self.tol)
        if diagnose_sync and vllm_differs:
            found = self._sync_check()
            if found:
                raise ConfigError(self._sync_refusal(c, found))
        raise ConfigError(self._refusal(c.gaps, c.worst, c.has_model))

    def _sync_check(self) -> str:
        """What the whole-tensor check of the synced engine finds (reshard/verify.py): the first tensor that differs,
        or "" when the engine holds the actor's weights (or the sync has no such check: LoRA adapters)."""
        from spmdrl.reshard.verify import SyncMismatch

        check = getattr(self.weight_sync, "check_engine", None)
        if check is None:
            return ""
        try:
            check()
        except SyncMismatch as e:
            return str(e).split(": ", 1)[1]
        return ""

    def _sync_refusal(self, c: "Comparison", found: str) -> str:
        return (f"parity check: after the weight sync the rollout engine's log-probs differ from the actor's by up to "
                f"{c.gaps[0].where()} (model {self.actor.module_summary()}), while before it they agreed: the sync "
                f"does not place this model's weights as vLLM's own loaders do ({found}); {SYNC_BUG}")

    def _reference(self, batch, temperature: float):
        """transformers' own forward of the actor's weights, [B, R] (None on a backend without one)."""
        from spmdrl.engines.token_batch import pack_sequences

        rows = [(batch["prompts"][i, : batch["prompt_len"][i]], batch["responses"][i, : batch["response_len"][i]])
                for i in range(len(batch))]
        tb = pack_sequences([p for p, _ in rows], [r for _, r in rows], self.pad_id, packed=False,
                            vision=batch.meta.get("vision"))
        out = self.actor.reference_logprobs(tb, temperature=temperature)
        if out is None:
            return None
        full = torch.zeros_like(batch["rollout_log_probs"])
        full[:, : out.shape[1]] = out.cpu()[:, : full.shape[1]]
        return full

    def _refusal(self, gaps: list[Gap], worst: list[float], has_model: bool) -> str:
        head = (f"parity check: the actor's log-probs differ from the rollout engine's by up to {gaps[0].where()} "
                f"(tolerance {self.tol:.2g}; model {self.actor.module_summary()})")
        if not has_model:
            return (f"{head}: this backend's model does not compute what vLLM does for this architecture; use "
                    "trainer.backend = 'fsdp' (transformers' modeling code), or check rollout.parity_tol")
        if not worst[1] <= self.tol:
            return (f"{head}; transformers' own forward differs from vLLM's too ({gaps[1].where()}), so vLLM "
                    "computes another function than transformers for this model: set rollout.model_impl = "
                    "'transformers' (vLLM runs transformers' modeling code) or rollout.engine = 'hf'")
        return (f"{head}, while transformers' own forward matches it ({worst[1]:.2g}): spmdrl's kernels do not "
                "compute this model; set model.attn_implementation = 'auto' and model.logprob_head = 'auto' (they "
                "switch to transformers' implementation where needed)")


ATTENTION = {"spmdrl": "spmdrl's attention kernels", "sdpa": "transformers' SDPA attention",
             "eager": "transformers' eager attention"}


def _describe_path(option: tuple[str, str]) -> str:
    attn, head = option
    h = "spmdrl's fused log-prob head" if head == "fused" else "the model's own head"
    return f"{ATTENTION[attn]} with {h}"


def _describe(first: tuple[str, str], option: tuple[str, str]) -> str:
    """What the switch replaces: the parts of `first` that `option` changes."""
    parts = []
    if first[0] != option[0]:
        parts.append(ATTENTION[first[0]])
    if first[1] != option[1]:
        parts.append("spmdrl's fused log-prob head")
    return " and ".join(parts) or "the actor's forward"
