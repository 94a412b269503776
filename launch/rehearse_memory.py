"""Rehearse one rank of a large config on one GPU, component by component, and compare with `spmdrl plan`.

    python launch/rehearse_memory.py --config configs/ppo_70b.toml --out /tmp/rehearsal          # one GPU
    python launch/rehearse_memory.py --config configs/ppo_70b.toml --out /tmp/rehearsal --smoke  # CPU check

What it does:
1. The stand-in: a Llama with the layers one rank of the config's actor holds: heads, kv heads, ffn and
   vocabulary divided by the actor's tp (hidden size and head dim unchanged), and num_layers / actor pp layers;
   fewer layers where that does not fit this GPU by the one-GPU plan (--layers sets the count). Random-init
   bf16 weights are written as an HF directory next to the byte tokenizer of spmdrl.tiny, and a few synthetic
   prompts as the dataset.
2. Run A (one process): PPO with the config's algorithm, backend and offload settings (actor + critic + ref)
   for 3 steps with a checkpoint after step 2; run B, a new process: resume from that checkpoint and one more
   step. Both run with memory.report_components, so every phase reports what each engine holds on the device
   (params, grads, optimizer: real tensor bytes) and the rest of its peak (transient: activations, gradients
   inside an update, logits, staging).
3. A table per phase and component: measured GiB, the plan's figure for the stand-in (world 1) and their ratio;
   next to it the plan's figure for the same component on one rank of the config itself, and the factor between
   the two plans (layers, and the dp sharding a one-GPU run cannot do). A row is marked when measured and
   planned differ by more than 10%. Written as JSON to <out>/rehearsal.json too.

What one GPU cannot rehearse, listed with the config's planned figures instead of measurements: NCCL
communicators and p2p buffers (one process has no peer), vLLM (the rollout engine is spmdrl's transformers
engine, `rollout.engine = "hf"`: no vLLM pool, so the load / rollout / sync phases are not compared), the
weight sync's buffers (nothing to send), and the CUDA context (outside torch's allocator).
--smoke runs the same pipeline on CPU with a 2-layer model of hidden size 64: the resident components are real
tensor bytes there too (they are compared), the transient ones are not measured (torch has no peak counter for CPU memory).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

COMPARABLE = ("build", "checkpoint_save", "resume", "ref_forward", "actor_forward", "critic_forward",
              "train_actor", "train_critic")


def stand_in_overrides(model_dir: str, data: str, out: str, smoke: bool) -> list[str]:
    """The rehearsal's overrides of --config: one rank, the transformers rollout engine, a few prompts."""
    o = [f"model.path={model_dir}", "model.tokenizer_path=", f"data.train_files=[\"{data}\"]", "data.val_files=[]",
         "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "memory.nodes=1", "memory.gpus_per_node=1",
         "placement.actor_tp=1", "placement.actor_pp=1", "placement.ref_tp=1", "placement.ref_pp=1",
         "placement.critic_tp=1", "placement.critic_pp=1", "placement.rollout_tp=1", "rollout.engine=hf",
         "rollout.n=1", f"trainer.output_dir={out}", "trainer.overwrite=true", "trainer.test_freq=0",
         "trainer.val_before_train=false", "checkpoint.save_freq=2", "checkpoint.keep_last=2",
         "logging.tensorboard=false"]
    if smoke:
        o += ["trainer.device=cpu", "data.max_prompt_length=32", "data.max_response_length=16"]
    return o


def stand_in_shape(hf_config, tp: int) -> dict:
    """The layer shapes one rank holds at tensor parallel `tp`: heads, kv heads, ffn and vocabulary divided by tp,
    hidden size and head dim unchanged (what its GEMMs and its per-layer state look like)."""
    heads = hf_config.num_attention_heads
    return dict(hidden_size=hf_config.hidden_size, head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                num_attention_heads=max(1, heads // tp), num_key_value_heads=max(1, hf_config.num_key_value_heads // tp),
                intermediate_size=hf_config.intermediate_size // tp, vocab_size=-(-hf_config.vocab_size // (64 * tp)) * 64,
                rms_norm_eps=hf_config.rms_norm_eps, rope_theta=getattr(hf_config, "rope_theta", 500000.0),
                tie_word_embeddings=False, max_position_embeddings=8192)


def llama_config(shape: dict, layers: int, tok=None):
    from transformers import LlamaConfig

    extra = dict(bos_token_id=0, eos_token_id=tok.eos_token_id, pad_token_id=0) if tok is not None else {}
    if tok is not None:
        shape = {**shape, "vocab_size": max(shape["vocab_size"], len(tok))}
    return LlamaConfig(num_hidden_layers=layers, architectures=["LlamaForCausalLM"], **shape, **extra)


def write_llama(shape: dict, layers: int, out_dir: str, smoke: bool) -> None:
    """A random-init Llama of `shape` with `layers` layers (bf16; float32 for --smoke) and the byte tokenizer of
    spmdrl.tiny."""
    import torch
    from transformers import LlamaForCausalLM

    from spmdrl.tiny import build_tokenizer

    tok = build_tokenizer(out_dir)
    if smoke:
        shape = {**shape, "hidden_size": 64, "head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": 320}
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu"):
        model = LlamaForCausalLM(llama_config(shape, layers, tok)).to(torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    del model


def choose_layers(cfg_path: str, base_overrides: list[str], work: str, layers: int | None,
                  gpu_gb: float) -> tuple[dict, int, dict]:
    """(shape, layers, the config's own plan): one rank's layer shape of the config's actor, and its layer
    count (num_layers / actor pp), or the most layers whose one-GPU plan fits `gpu_gb` x memory.margin."""
    from spmdrl.config import load_config
    from spmdrl.models.model import load_hf_config
    from spmdrl.plan import build_plan

    cfg = load_config(cfg_path, [])
    target = build_plan(cfg)
    hf = load_hf_config(cfg.model.path, cfg.model.trust_remote_code)
    shape = stand_in_shape(hf, cfg.placement.actor_tp)
    if layers:
        return shape, layers, target
    probe = os.path.join(work, "probe")
    os.makedirs(probe, exist_ok=True)
    overrides = base_overrides + [f"model.path={probe}", f"memory.gpu_memory_gb={gpu_gb}"]
    for n in range(max(1, hf.num_hidden_layers // cfg.placement.actor_pp), 0, -1):
        llama_config(shape, n).save_pretrained(probe)
        if build_plan(load_config(cfg_path, overrides), world_size=1)["fits"]:
            return shape, n, target
    raise SystemExit(f"not even one layer of {shape} fits {gpu_gb:.0f} GiB by the one-GPU plan")


# The plan's components that a one-process run cannot hold: listed with the config's figures, never compared.
NOT_REHEARSED = ("nccl_", "vllm_", "sync_", "cuda_context")


def resident(name: str) -> bool:
    return name.rsplit("_", 1)[-1] in ("params", "grads", "optimizer") and not name.endswith("gathered_params")


def gib_parts(plan: dict, phase: str) -> dict[str, float]:
    return {k: v / 2**30 for k, v in plan["memory"].get(phase, {}).get("gpu_bytes", {}).items()}


def compare(plan: dict, target: dict, measured: dict, cpu: bool) -> tuple[list[dict], list[dict]]:
    """(compared rows, not-rehearsed rows). Per phase: each resident component measured vs planned; `transient`
    vs the planned components that are neither resident on the device at the phase's end (by measurement: a
    gradient FSDP2 frees at the end of its update is transient) nor among NOT_REHEARSED. On CPU (`cpu`) offload is
    a no-op, so state the plan has in host memory is on the "device" too: only planned components are compared."""
    rows, skipped = [], []
    for phase in COMPARABLE:
        got = measured.get(phase)
        want, tgt = gib_parts(plan, phase), gib_parts(target, phase)
        if not got or phase not in plan["memory"]:
            continue
        names = sorted({n for n in set(want) | set(got) if resident(n) and (got.get(n) or want.get(n))
                        and not (cpu and n not in want)})
        held = [n for n in names if got.get(n)]
        rest = lambda parts: sum(v for n, v in parts.items()  # noqa: E731  (a gradient not held is transient)
                                 if not n.startswith(NOT_REHEARSED)
                                 and not (resident(n) and (n in held or not n.endswith("_grads"))))
        for n in names + ["transient"]:
            m = got.get(n)
            w, t = (rest(want), rest(tgt)) if n == "transient" else (want.get(n), tgt.get(n))
            ratio = m / w if m is not None and w else None
            note = "" if ratio is None or abs(ratio - 1) <= 0.1 else "off by more than 10%"
            if m is None:
                note = "CPU: transient not measured" if n == "transient" else "not measured"
            rows.append({"phase": phase, "component": n, "measured_gb": m, "planned_gb": w, "ratio": ratio,
                         "target_gb": t, "target_factor": t / w if t and w else None, "note": note})
        for n, v in sorted(tgt.items()):
            if n.startswith(NOT_REHEARSED):
                skipped.append({"phase": phase, "component": n, "target_gb": v})
    return rows, skipped


def run(cmd: list[str], log: str) -> None:
    print("$", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode:
        tail = open(log).read()[-3000:]
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); log {log}:\n{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/ppo_70b.toml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="stand-in layers (default: one rank's, or what fits)")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the pipeline with a tiny model")
    args = ap.parse_args()
    import torch

    from spmdrl.config import load_config
    from spmdrl.data.synthetic import make_arith
    from spmdrl.metrics import read_jsonl
    from spmdrl.plan import build_plan

    out = os.path.abspath(args.out)
    model_dir, run_a, run_b = (os.path.join(out, x) for x in ("model", "run_a", "run_b"))
    data = make_arith(os.path.join(out, "data"), n_train=64, n_val=0, seed=0)["train"]
    base = stand_in_overrides(model_dir, data, run_a, args.smoke)
    gpu_gb = (torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() and not args.smoke
              else load_config(args.config, []).memory.gpu_memory_gb)
    shape, layers, target = choose_layers(args.config, base, out, 2 if args.smoke else args.layers, gpu_gb)
    what = "2 layers of hidden size 64 (--smoke)" if args.smoke else f"{layers} layers of {shape}"
    print(f"stand-in: {what} for one rank of {args.config}; GPU {gpu_gb:.1f} GiB", flush=True)
    write_llama(shape, layers, model_dir, args.smoke)
    base += [f"memory.gpu_memory_gb={gpu_gb}", "memory.report_components=true"]
    plan = build_plan(load_config(args.config, base), world_size=1)
    train = [sys.executable, "-m", "spmdrl.train", "--config", args.config]
    run(train + base + ["trainer.total_steps=3", "checkpoint.resume=off"], os.path.join(out, "run_a.log"))
    ckpt = os.path.join(run_a, "checkpoints", "step_00000002")
    resumed = [o for o in base if not o.startswith("trainer.output_dir=")]
    run(train + resumed + [f"trainer.output_dir={run_b}", "trainer.total_steps=3", f"checkpoint.resume={ckpt}"],
        os.path.join(out, "run_b.log"))
    measured: dict[str, dict[str, float]] = {}
    for d in (run_a, run_b):
        for row in read_jsonl(os.path.join(d, "metrics.jsonl")):
            for k, v in row.items():
                parts = k.split("/")
                if len(parts) == 3 and parts[0] == "memory" and parts[2].endswith("_gb"):
                    phase, name = parts[1], parts[2][:-3]
                    measured.setdefault(phase, {})[name] = max(measured.get(phase, {}).get(name, 0.0), v)
    rows, skipped = compare(plan, target, measured, cpu=args.smoke)
    f = (lambda x, w: f"{x:{w}.3g}" if x is not None else " " * (w - 1) + "-")  # noqa: E731
    print(f"{'phase':16s} {'component':22s} {'measured':>9s} {'planned':>8s} {'ratio':>6s} {'target':>8s} "
          f"{'factor':>7s}  note   (GiB; planned: the stand-in, world 1; target: one rank of the config)")
    for r in rows:
        print(f"{r['phase']:16s} {r['component']:22s} {f(r['measured_gb'], 9)} {f(r['planned_gb'], 8)} "
              f"{f(r['ratio'], 6)} {f(r['target_gb'], 8)} {f(r['target_factor'], 7)}  {r['note']}")
    print("not rehearsed on one GPU (the config's planned GiB per rank):")
    for phase in dict.fromkeys(r["phase"] for r in skipped):
        print(f"  {phase:16s} " + ", ".join(f"{r['component']} {r['target_gb']:.3g}" for r in skipped
                                             if r["phase"] == phase))
    with open(os.path.join(out, "rehearsal.json"), "w") as fh:
        json.dump({"config": args.config, "layers": layers, "shape": shape, "gpu_gb": gpu_gb,
                   "components": rows, "not_rehearsed": skipped}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
