"""A transformers fallback for machines without vLLM: same interface, plain batched decoding with a KV cache.

Slow (no continuous batching, no paged attention); meant for tests, debugging and tiny models. Every rank holds
the whole model, so in a "TP group" each rank simply computes the same samples. Samples decode in batches of
`max_num_seqs`; by default one generator per call, seeded with `call_seed(seeds)`, samples every row at once
(the same on every rank passing the same seeds); with `per_request_seed` each sample has its own generator
seeded by `sample_seed(seeds[i], j)` and rows are sampled one by one.

A vision-language model's prompts may come with images (`vision`: per prompt its data.images.VisionInputs): such
a request decodes alone, each token from a forward of the whole sequence with the prompt's pixel values, the
model computing its 3-D rotary positions as the training engines' forward does (no KV cache: for tests and tiny
models).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

import torch

from spmdrl.algos.token_stats import truncate_logits
from spmdrl.errors import ConfigError, SpmdrlError
from spmdrl.rollout.base import (
    GENERATE_ID,
    Completion,
    drain,
    RequestLog,
    RolloutOutput,
    SamplingSpec,
    call_seed,
    check_admission,
    check_generate_args,
    preserved_rng_state,
    sample_seed,
)

logger = logging.getLogger(__name__)
_warned_slow = False


def _warn_slow_once() -> None:
    global _warned_slow
    if not _warned_slow:
        _warned_slow = True
        logger.warning(
            "rollout uses the transformers engine (HFEngine): it is much slower than vLLM; "
            "install vllm and set rollout.engine = 'vllm' for real runs"
        )


class HFEngine:
    """Sampling with a transformers causal LM in this process."""

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str = "auto",
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        per_request_seed: bool = False,
        trust_remote_code: bool = False,
        seed: int = 0,
    ):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        from spmdrl.models.model import load_hf_config
        from spmdrl.models.vision import is_vision_language

        _warn_slow_once()
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"rollout dtype={dtype!r}: use auto, float32, bfloat16 or float16")
        if max_num_seqs < 1:
            raise ConfigError(f"rollout.max_num_seqs={max_num_seqs}: must be >= 1")
        self.vision_language = is_vision_language(load_hf_config(model_path, trust_remote_code))
        auto = AutoModelForImageTextToText if self.vision_language else AutoModelForCausalLM
        with preserved_rng_state():
            self.model = auto.from_pretrained(
                model_path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
            ).to(self.device)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_path or model_path, trust_remote_code=trust_remote_code
        )
        self.max_model_len = max_model_len
        self.batch_size = max_num_seqs
        self.per_request_seed = bool(per_request_seed)
        self.seed = seed  # unused: sampling is seeded from the caller's per-prompt seeds
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(self.eos_ids), 0)
        self._queue: list = []  # admitted requests: (RequestLog, prompt, seed, spec), in admission order
        self._stash: list[Completion] = []  # finished while generate stepped the engine; the next step() returns them
        self._shared: torch.Generator | None = None  # the unseeded requests' stream (reseed)
        self._vision: dict = {}  # request id -> its images' inputs (queued requests with images)
        self.weight_version = 0

    # ----------------------------------------------------------------------------------------------- generate

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec, seeds: list[int],
                 vision: list | None = None) -> RolloutOutput:
        """spec.n samples per prompt, prompt-major; draws seeded by call_seed(seeds) (one generator for the
        call), or with per_request_seed sample j of prompt i by sample_seed(seeds[i], j). A drain of the
        request-level interface: every sample admitted, stepped until none is in flight. vision: per prompt its
        images' inputs or None (module docstring)."""
        check_generate_args(prompt_ids, spec, seeds)
        self._check_lengths(prompt_ids)
        self._check_vision(prompt_ids, vision)
        ids = [f"{GENERATE_ID}{i}.{j}" for i in range(len(prompt_ids)) for j in range(spec.n)]
        prompts = [list(p) for p in prompt_ids for _ in range(spec.n)]
        sample_seeds = [sample_seed(s, j) if self.per_request_seed else None for s in seeds for j in range(spec.n)]
        self.reseed(call_seed(seeds))
        per_sample = [v for v in vision for _ in range(spec.n)] if vision is not None else None
        self._enqueue(ids, prompts, replace(spec, n=1), sample_seeds, per_sample)
        outs = drain(self._step, ids, self._stash)
        return RolloutOutput([c.token_ids for c in outs], [c.logprobs for c in outs], [c.finish_reason for c in outs])

    # ------------------------------------------------------------------------------------ request-level interface

    def admit(self, ids: list[str], prompt_ids: list[list[int]], spec: SamplingSpec, seeds: list[int | None],
              vision: list | None = None) -> None:
        """Queue one request per id (spec.n = 1); seed None draws from the engine's generator (reseed). vision:
        per request its images' inputs or None."""
        if any(i.startswith(GENERATE_ID) for i in ids):
            raise ConfigError(f"admit: request ids starting with {GENERATE_ID!r} are generate's own")
        check_admission([log.id for log, _, _, _ in self._queue], ids, prompt_ids, spec, seeds)
        self._check_lengths(prompt_ids)
        self._check_vision(prompt_ids, vision)
        self._enqueue(ids, prompt_ids, spec, seeds, vision)

    def _enqueue(self, ids: list[str], prompt_ids: list[list[int]], spec: SamplingSpec, seeds: list,
                 vision: list | None = None) -> None:
        vision = vision if vision is not None else [None] * len(ids)
        self._queue += [(RequestLog(rid), list(p), seed, spec) for rid, p, seed in zip(ids, prompt_ids, seeds)]
        self._vision.update({rid: v for rid, v in zip(ids, vision) if v is not None})

    def _check_vision(self, prompt_ids: list[list[int]], vision: list | None) -> None:
        if vision is None:
            return
        if len(vision) != len(prompt_ids):
            raise ConfigError(f"rollout: {len(vision)} image inputs for {len(prompt_ids)} prompts")
        if not self.vision_language and any(v is not None for v in vision):
            raise ConfigError("rollout: prompts with images need a vision-language model (Qwen2.5-VL, Qwen3-VL); "
                              f"this one is a {type(self.model).__name__}")

    def step(self, partial: bool = False) -> list[Completion]:
        """Decode the next max_num_seqs queued requests of one sampling spec to the end, as one batch (no
        continuous batching: a request finishes in the step that starts it); plus those that finished while a
        generate call stepped the engine. partial: nothing more to report (no request runs across steps)."""
        stashed, self._stash = self._stash, []
        return stashed + self._step()

    @torch.no_grad()
    def _step(self) -> list[Completion]:
        if not self._queue:
            return []
        spec = self._queue[0][3]
        chunk = []
        for item in self._queue:
            if item[3] != spec or len(chunk) == self.batch_size:
                break
            chunk.append(item)
        del self._queue[: len(chunk)]
        if self._shared is None:
            self._shared = torch.Generator(device=self.device)
        shared = self._shared
        if all(seed is None for _, _, seed, _ in chunk):
            gens = [shared]
        else:
            gens = [shared if seed is None else torch.Generator(device=self.device).manual_seed(seed)
                    for _, _, seed, _ in chunk]
        if any(log.id in self._vision for log, _, _, _ in chunk):  # with images: each request alone
            rows = [self._generate_vision(p, self._vision.pop(log.id, None), gens[min(k, len(gens) - 1)], spec)
                    for k, (log, p, _, _) in enumerate(chunk)]
            ids, lps, reasons = (list(x) for x in zip(*rows))
        else:
            ids, lps, reasons = self._generate_batch([p for _, p, _, _ in chunk], gens, spec)
        out = []
        for (log, _, _, _), t, lp, reason in zip(chunk, ids, lps, reasons):
            log.extend(t, lp if spec.logprobs else [], self.weight_version)
            out.append(log.done(reason))
        return out

    def abort(self, ids: list[str]) -> list[Completion]:
        """Take queued requests back (nothing of theirs has run: a request runs whole within one step); one that
        finished while a generate call stepped the engine comes back finished, as step() would have returned it."""
        gone = set(ids)
        out = [c for c in self._stash if c.id in gone] + [log.done("abort") for log, _, _, _ in self._queue if log.id in gone]
        self._stash = [c for c in self._stash if c.id not in gone]
        self._queue = [item for item in self._queue if item[0].id not in gone]
        for rid in gone:
            self._vision.pop(rid, None)
        return out

    @property
    def in_flight(self) -> int:
        return len(self._queue) + len(self._stash)

    def reseed(self, seed: int) -> None:
        self._shared = torch.Generator(device=self.device).manual_seed(seed)

    def rebuild_kv(self) -> None:
        """Nothing is cached across steps."""

    def _check_lengths(self, prompt_ids: list[list[int]]) -> None:
        if self.max_model_len is not None:
            for i, p in enumerate(prompt_ids):
                if len(p) >= self.max_model_len:
                    raise ConfigError(f"prompt {i} has {len(p)} tokens, max_model_len is {self.max_model_len}")

    def _generate_batch(self, prompts: list[list[int]], generators: list[torch.Generator], spec: SamplingSpec):
        dev = self.device
        b = len(prompts)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros((b, width), dtype=torch.long, device=dev)
        for r, p in enumerate(prompts):  # left padding keeps every row's next token in the last column
            input_ids[r, width - len(p) :] = torch.tensor(p, device=dev)
            mask[r, width - len(p) :] = 1
        max_new = spec.max_tokens
        if self.max_model_len is not None:
            max_new = min(max_new, self.max_model_len - width)
        stop_t = torch.tensor(sorted(self.eos_ids | set(spec.stop_token_ids)), dtype=torch.long, device=dev)

        tokens_out = torch.full((b, max(max_new, 0)), self.pad_id, dtype=torch.long, device=dev)
        logp_out = torch.zeros((b, max(max_new, 0)), dtype=torch.float32, device=dev)
        length = torch.zeros(b, dtype=torch.long, device=dev)  # tokens generated per row so far
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        stopped = torch.zeros(b, dtype=torch.bool, device=dev)
        past = None
        step_ids = input_ids
        for t in range(max_new):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            res = self.model(
                input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True
            )
            past = res.past_key_values
            logits = _processed_logits(res.logits[:, -1, :].float(), spec)
            tokens = _sample(logits, spec, generators)
            lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]  # processed, as vLLM's
            live = ~done
            tokens_out[:, t] = torch.where(live, tokens, tokens_out[:, t])
            logp_out[:, t] = torch.where(live, lp, logp_out[:, t])
            length += live.long()
            hit = live & torch.isin(tokens, stop_t)
            if spec.stop:  # stop strings need the decoded text: row by row, only for rows still running
                for r in live.nonzero()[:, 0].tolist():
                    if not hit[r] and self._hit_stop_string(tokens_out[r, : t + 1].tolist(), spec.stop):
                        hit[r] = True
            stopped |= hit
            done |= hit
            if bool(done.all()):
                break
            step_ids = torch.where(done, torch.full_like(tokens, self.pad_id), tokens)[:, None]
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], dim=1)
        lengths = length.tolist()
        toks, lps = tokens_out.tolist(), logp_out.tolist()
        responses = [row[:n] for row, n in zip(toks, lengths)]
        logprobs = [row[:n] for row, n in zip(lps, lengths)]
        return responses, logprobs, ["stop" if s else "length" for s in stopped.tolist()]

    def _generate_vision(self, prompt: list[int], vision, generator: torch.Generator, spec: SamplingSpec):
        """One request of a vision-language model, decoded alone: every token from a forward of the whole sequence
        so far with the prompt's images (the model's own 3-D rotary positions; no cache). Returns
        (tokens, processed log-probs, finish reason)."""
        from spmdrl.models.vision import prompt_images_only, token_types

        dev, image_token = self.device, self.model.config.image_token_id
        images = {} if vision is None else dict(pixel_values=vision.pixel_values.to(dev, self.model.dtype),
                                                image_grid_thw=vision.image_grid_thw.to(dev))
        max_new = spec.max_tokens if self.max_model_len is None else min(spec.max_tokens, self.max_model_len - len(prompt))
        seq, tokens, lps, reason = list(prompt), [], [], "length"
        stops = self.eos_ids | set(spec.stop_token_ids)
        for _ in range(max(max_new, 0)):
            x = torch.tensor([seq], device=dev)
            types = token_types(x, image_token, torch.tensor([len(prompt)], device=dev))
            with prompt_images_only(self.model.model, types):
                logits = self.model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False,
                                    mm_token_type_ids=types, **images).logits[:, -1, :].float()
            logits = _processed_logits(logits, spec)
            t = _sample(logits, spec, [generator])
            lps.append(float(torch.log_softmax(logits, -1)[0, t[0]]))
            tokens.append(int(t[0]))
            seq.append(tokens[-1])
            if tokens[-1] in stops or (spec.stop and self._hit_stop_string(tokens, spec.stop)):
                reason = "stop"
                break
        return tokens, lps, reason

    def _hit_stop_string(self, response: list[int], stops: list[str]) -> bool:
        text = self.tokenizer.decode(response, skip_special_tokens=True)
        return any(s in text for s in stops)

    @torch.no_grad()
    def compute_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """Raw log-probs (no temperature, no truncation) of response tokens given their prompts, one list per pair."""
        if len(prompt_ids) != len(response_ids):
            raise ConfigError(f"compute_logprobs got {len(prompt_ids)} prompts but {len(response_ids)} responses")
        result = []
        for p, r in zip(prompt_ids, response_ids):
            ids = torch.tensor([list(p) + list(r)], device=self.device)
            logits = self.model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r, device=self.device)[:, None])[:, 0]
            result.append(lp.tolist())
        return result

    # ------------------------------------------------------------------------------------------------ weights

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the module by name; any subset, in any number of calls."""
        params = dict(self.model.named_parameters())
        params.update(self.model.named_buffers())
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:
                if tied and name == "lm_head.weight":
                    continue  # the embedding carries it
                raise SpmdrlError(f"update_weights: the rollout model has no parameter named {name!r}")
            if target.shape != tensor.shape:
                raise SpmdrlError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, the rollout model expects "
                    f"{tuple(target.shape)} (send full, unsharded tensors)"
                )
            target.copy_(tensor)

    def finish_weight_update(self) -> None:
        """Nothing pending: update_weights copies immediately."""

    @torch.no_grad()
    def weight_snapshot(self) -> dict[str, torch.Tensor]:
        """Host copies of every parameter and buffer, by HF name."""
        tensors = dict(self.model.named_parameters())
        tensors.update(self.model.named_buffers())
        return {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}

    # ---------------------------------------------------------------------------------------------- lifecycle

    def forget_prefixes(self) -> None:
        """No prefix cache here."""

    def sleep(self, level: int = 1) -> None:
        """Move the weights to CPU (CUDA only; a no-op on CPU); both levels keep them, the engine has no KV pool."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Move the weights back after sleep (tags other than "weights" have nothing to restore)."""
        if self.device.type == "cuda" and (tags is None or "weights" in tags):
            self.model.to(self.device)

    def close(self) -> None:
        """Drop the model."""
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _processed_logits(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """The logits vLLM samples from (and takes processed log-probs of): raw at temperature 0 (greedy), else
    divided by the temperature and truncated by top-k / top-p (spmdrl.algos.token_stats.truncate_logits)."""
    if spec.temperature == 0:
        return logits
    return truncate_logits(logits / spec.temperature, spec.top_k, spec.top_p)


def _sample(logits: torch.Tensor, spec: SamplingSpec, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row from processed logits: greedy at temperature 0, else one multinomial draw over
    softmax(logits) for all rows from a single generator, or row by row when there is one generator per row."""
    if spec.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    if len(generators) == 1:
        return torch.multinomial(probs, 1, generator=generators[0])[:, 0]
    return torch.stack([torch.multinomial(probs[r], 1, generator=g)[0] for r, g in enumerate(generators)])


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(x) for x in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
