"""Single-process throughput of one training engine (trainer.backend fsdp | megatron) on a GRPO-shaped batch.

Builds a random-init HF Qwen2 model (default: Qwen2.5-0.5B's shape) in a temporary directory, then the engine on
one device (cuda: bfloat16 compute with float32 master weights / optimizer; cpu: float32), and times after a
warm-up iteration:
  logprobs    the old-log-prob forward over the whole batch (spmdrl.loop.update.forward_all, forward micro-batches);
  train_step  one actor update (spmdrl.loop.update.run_updates with the PPO-clip actor loss, one optimizer step over
              the whole batch in micro-batches).
Prints one JSON object: tokens/s, achieved TFLOP/s (spmdrl.metrics.flops_metrics: 3 x forward FLOPs for the
update, 1 x for the forward), MFU when the device's peak is known (H100/H200/A100), and the peak memory of each
phase (CUDA max_memory_allocated after a reset; on CPU the process's peak RSS, which never goes down).

    python launch/bench_train_engine.py --backend megatron              # on a GPU
    python launch/bench_train_engine.py --backend fsdp --tiny --device cpu

--shape qwen2.5-1.5b / qwen2.5-3b set Qwen2.5-1.5B's / Qwen2.5-3B's dimensions (random init); --length-mix rl
draws each group's prompt length uniformly in [128, 1024] and each response's length log-uniformly in [64, 4096]
(seeded), instead of fixed lengths; --max-tokens / --forward-max-tokens set token-budget micro-batches and
--packed packs them. launch/bench_update_mix.sh runs both shapes on both backends with that mix.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import tempfile
import time

import torch


def build_model_dir(args, out_dir: str, dtype: torch.dtype) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdrl.tiny import build_tokenizer

    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(4096, args.prompt_len + args.response_len),
                      tie_word_embeddings=not args.untied, rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False)
    torch.manual_seed(args.seed)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)


# (hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings) of the published configs
SHAPES = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-3b": (2048, 36, 16, 2, 11008, 151936, True),
}


def rl_lengths(args, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] prompt lengths (one per group of n, uniform in [prompt_min, prompt_len]) and [B] response lengths
    (log-uniform in [response_min, response_len]): the long-tailed mix of RL rollouts."""
    groups = args.batch // args.n
    plen = torch.randint(args.prompt_min, args.prompt_len + 1, (groups,), generator=g).repeat_interleave(args.n)
    lo, hi = math.log(args.response_min), math.log(args.response_len)
    rlen = torch.exp(lo + (hi - lo) * torch.rand(args.batch, generator=g, dtype=torch.float64)).round().long()
    return plen, rlen.clamp(args.response_min, args.response_len)


def synthetic_batch(args):
    """GRPO-shaped: B sequences in groups of n, fixed (or --length-mix rl) prompt and response lengths, random
    tokens and advantages; padded to the longest, with the lengths and masks marking the real tokens."""
    from spmdrl.batch import Batch

    g = torch.Generator().manual_seed(args.seed)
    B, P, R = args.batch, args.prompt_len, args.response_len
    if args.length_mix == "rl":
        plen, rlen = rl_lengths(args, g)
    else:
        plen, rlen = torch.full((B,), P), torch.full((B,), R)
    prompts = torch.randint(5, args.vocab - 1, (B, P), generator=g)
    prompts[torch.arange(P)[None, :] >= plen[:, None]] = 0
    response_mask = (torch.arange(R)[None, :] < rlen[:, None]).float()
    adv = torch.randn(B // args.n, 1, generator=g).repeat_interleave(args.n, 0).expand(B, R) * response_mask
    return Batch({
        "prompts": prompts, "prompt_len": plen,
        "responses": torch.randint(5, args.vocab - 1, (B, R), generator=g) * response_mask.long(),
        "response_len": rlen, "response_mask": response_mask, "advantages": adv.contiguous(),
        "rollout_log_probs": torch.zeros(B, R), "index": torch.arange(B // args.n).repeat_interleave(args.n),
    })


def peak_gb(device) -> float:
    from spmdrl.metrics import peak_memory_gb

    return peak_memory_gb(device)


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def count_cuda_syncs(fn) -> int:
    """How many times fn() makes the host wait for the GPU (torch.cuda.set_sync_debug_mode("warn") reports each
    synchronising call: .item(), nonzero, blocking copies, ...). CUDA only."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["fsdp", "megatron"], required=True)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--tiny", action="store_true", help="a ~1M-parameter model and a small batch (CPU smoke test)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="",
                   help="a published model's dimensions (overrides --hidden ... --vocab and --untied)")
    p.add_argument("--length-mix", choices=["fixed", "rl"], default="fixed",
                   help="rl: prompts uniform in [--prompt-min, --prompt-len] per group, responses log-uniform in "
                        "[--response-min, --response-len]")
    p.add_argument("--prompt-min", type=int, default=128)
    p.add_argument("--response-min", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=0, help="update token budget per micro-batch (0: --micro sequences)")
    p.add_argument("--forward-max-tokens", type=int, default=0, help="forward token budget per micro-batch")
    p.add_argument("--packed", action="store_true", help="pack sequences into rows (with the token budgets)")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--untied", action="store_true", help="untied embeddings (default tied, like Qwen2.5-0.5B)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt (GRPO group size)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--micro", type=int, default=4, help="update micro-batch size (sequences)")
    p.add_argument("--forward-micro", type=int, default=8, help="log-prob forward micro-batch size")
    p.add_argument("--iters", type=int, default=2, help="timed iterations after one warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default="", help="reuse / keep the generated model here")
    p.add_argument("--megatron-attention", default="sdpa", choices=["sdpa", "local"],
                   help="megatron local-spec core attention: torch SDPA or megatron's DotProductAttention")
    p.add_argument("--recompute", action="store_true", help="activation recompute (model.gradient_checkpointing)")
    p.add_argument("--recompute-policy", default="", choices=["", "full", "selective"],
                   help="model.checkpoint_policy with --recompute (empty: the engine's default, full)")
    p.add_argument("--compile", action="store_true", help="model.compile: torch.compile each decoder block (fsdp)")
    p.add_argument("--count-syncs", action="store_true",
                   help="CUDA: one more pass of each phase counting host-device synchronisations (cuda_syncs_*)")
    args = p.parse_args()
    if args.shape:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab, tied = SHAPES[args.shape]
        args.untied = not tied
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab = 128, 2, 4, 2, 256, 512
        args.batch, args.n, args.prompt_len, args.response_len, args.micro, args.forward_micro = 8, 4, 16, 32, 4, 8
        args.prompt_min, args.response_min = min(args.prompt_min, 4), min(args.response_min, 2)
        args.max_tokens, args.forward_max_tokens = min(args.max_tokens, 128), min(args.forward_max_tokens, 192)
    if args.length_mix == "rl" and not (0 < args.prompt_min <= args.prompt_len and 0 < args.response_min <= args.response_len):
        p.error("--length-mix rl needs 0 < --prompt-min <= --prompt-len and 0 < --response-min <= --response-len")
    os.environ.setdefault("MASTER_PORT", "29531")

    import spmdrl
    from spmdrl.algos import POLICY_LOSSES
    from spmdrl.config import Config
    from spmdrl.dist.init import init_distributed
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine
    from spmdrl.metrics import device_peak_tflops, flops_metrics
    # launch/bench_side_by_side.sh runs this script against a previous revision too, whose update module may be
    # spmdrl/update.py (checked on disk: an editable install of this checkout would answer a failed import)
    if os.path.isdir(os.path.join(os.path.dirname(spmdrl.__file__), "loop")):
        from spmdrl.loop import update as update_module
    else:
        from spmdrl import update as update_module
    forward_all, run_updates = update_module.forward_all, update_module.run_updates
    # an older revision builds the objective with actor_body and passes it as body=
    make_objective = getattr(update_module, "ActorObjective", None) or update_module.actor_body
    objective_key = "objective" if "objective" in inspect.signature(run_updates).parameters else "body"

    env, device = init_distributed(args.device)
    cuda = device.type == "cuda"
    cfg = Config()
    mesh = RoleMeshes(plan_layout(cfg.placement, env.world_size), env.rank, device.type)["actor"]
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="bench_train_engine_")
    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        build_model_dir(args, model_dir, torch.bfloat16 if cuda else torch.float32)
    build_model_s = time.perf_counter() - t0
    reset_peak(device)
    t0 = time.perf_counter()
    extra = {"attention": args.megatron_attention} if args.backend == "megatron" else {}
    if args.recompute_policy:  # options an older revision's engines do not take are passed only when set
        extra["checkpoint_policy"] = args.recompute_policy
    if args.compile:
        extra["compile"] = True
    engine = build_train_engine(args.backend, model_dir, mesh, device, trainable=True,
                                dtype="bfloat16" if cuda else "float32", gradient_checkpointing=args.recompute, **extra,
                                optim=dict(lr=1e-6, weight_decay=0.01, grad_clip=1.0))
    sync(device)
    out = {"backend": args.backend, "megatron_attention": args.megatron_attention if args.backend == "megatron" else None,
           "recompute": args.recompute, "recompute_policy": args.recompute_policy or None, "compile": args.compile,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "torch": torch.__version__, "engine_build_s": time.perf_counter() - t0, "model_build_s": build_model_s,
           "peak_gb_build": peak_gb(device)}
    batch = synthetic_batch(args)
    cfg.data.max_response_length = args.response_len
    objective = make_objective(cfg, POLICY_LOSSES.get(cfg.actor.policy_loss), 1.0)

    def forward():
        kw = dict(max_tokens=args.forward_max_tokens, packed=args.packed)
        if "head" not in inspect.signature(forward_all).parameters:  # an older spmdrl: a per-micro-batch callback
            return forward_all(engine, batch, args.forward_micro, 0, lambda e, tb: e.logprobs(
                tb, temperature=1.0, chunk_size=cfg.actor.logprob_chunk_size)[0], **kw)
        return forward_all(engine, batch, args.forward_micro, 0, "logprobs", temperature=1.0,
                           chunk_size=cfg.actor.logprob_chunk_size, **kw)

    def update():
        return run_updates(engine, batch, epochs=1, mini_size=len(batch), micro_size=args.micro, pad_id=0, dp_size=1,
                           dp_group=mesh.group("dp"), prefix="actor", max_tokens=args.max_tokens,
                           packed=args.packed, **{objective_key: objective})

    times = {}
    for name, fn in (("logprobs", forward), ("train_step", update)):
        res = fn()  # warm-up
        if name == "logprobs":
            batch["old_log_probs"] = res
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        sync(device)
        times[name] = (time.perf_counter() - t0) / args.iters
        out[f"peak_gb_{name}"] = peak_gb(device)
        if args.count_syncs and cuda:  # one more pass with torch's synchronisation warnings on, after the timing
            out[f"cuda_syncs_{name}"] = count_cuda_syncs(fn)
    lens = (batch["prompt_len"] + batch["response_len"]).double()
    tokens = float(lens.sum())
    peak = device_peak_tflops(device)
    counts = dict(seq_lens_sum=tokens, seq_sq_sum=float((lens ** 2).sum()), head_tokens=float(batch["response_len"].sum()))
    known = inspect.signature(flops_metrics).parameters  # an older formula had no head_tokens (lm_head at every token)
    f = flops_metrics(engine.hf_config(), **{k: v for k, v in counts.items() if k in known}, update_s=times["train_step"], rollout_s=times["logprobs"], devices=1,
                      peak_tflops=peak)
    out.update({
        "params": sum(math.prod(s) for _, s in engine.param_shapes()),
        "shape": "tiny" if args.tiny else args.shape or None,
        "batch": {"sequences": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len,
                  "length_mix": args.length_mix, "mean_prompt_len": float(batch["prompt_len"].double().mean()),
                  "mean_response_len": float(batch["response_len"].double().mean()),
                  "max_len": int(lens.max()), "micro": args.micro, "forward_micro": args.forward_micro,
                  "max_tokens": args.max_tokens, "forward_max_tokens": args.forward_max_tokens,
                  "packed": args.packed, "tokens": tokens},
        "model_dir": model_dir, "counts": counts, "spmdrl": os.path.dirname(os.path.dirname(os.path.abspath(spmdrl.__file__))),
        "logprobs_s": times["logprobs"], "train_step_s": times["train_step"],
        "logprobs_tokens_per_s": tokens / times["logprobs"], "train_step_tokens_per_s": tokens / times["train_step"],
        "logprobs_tflops": f.get("perf/rollout_tflops"), "train_step_tflops": f.get("perf/actor_tflops"),
        "logprobs_mfu": f.get("perf/mfu_rollout"), "train_step_mfu": f.get("perf/mfu_actor"), "peak_tflops": peak or None,
    })
    print(json.dumps(out, indent=1), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # gloo's threads otherwise may abort the interpreter's exit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
