"""Rehearse a large config's per-rank GPU memory on one GPU, phase by phase, and compare with `spmdrl plan`.

    python launch/rehearse_memory.py --config configs/ppo_70b.toml --out /tmp/rehearsal          # one GPU
    python launch/rehearse_memory.py --config configs/ppo_70b.toml --out /tmp/rehearsal --smoke  # CPU check

What it does:
1. The target: the per-rank training peak `spmdrl plan` gives for --config (max over train_actor / train_critic).
2. A stand-in that one GPU can hold: a Llama whose layers have the shapes one rank of the config holds (heads,
   kv heads, ffn and vocabulary divided by the actor's tp; hidden size and head dim unchanged) and as many layers
   as make the one-GPU plan's training peak (world 1, no parallelism; the config's batch sizes, lengths, offload
   kinds and backend) come closest to the target, within 10% (the search fails otherwise).
   Random-init bf16 weights are written as an HF directory next to the byte tokenizer of spmdrl.tiny, and a few
   synthetic prompts as the dataset.
3. Run A (one process): PPO with the config's algorithm (actor + critic + ref, the config's offload settings)
   for 3 steps with a checkpoint after step 2; run B, a new process: resume from that checkpoint and one more
   step. Step 3 of run A reports the save's phase (`memory/checkpoint_save_*`), step 3 of run B the build,
   load and resume phases; every step reports the training phases.
4. A table: measured peak allocated GiB (`memory/<phase>_allocated_gb`, max over both runs) next to the plan's
   figure for the stand-in config, with the ratio; a row is marked when it is off by more than 10% or above
   0.9 x the GPU's memory. Written as JSON to <out>/rehearsal.json too.

vLLM is not used: the rollout engine is spmdrl's transformers engine (`rollout.engine = "hf"`). What that changes:
vLLM's pool (weights + KV cache, `rollout.gpu_memory_utilization` of the GPU) does not exist, so the phases in
which the plan counts vLLM (load, rollout, sync) are not comparable and are shown for information; the
transformers engine keeps its own full copy of the weights, on the GPU while generating and syncing and in host
memory otherwise (its `sleep` moves them). The training, build, checkpoint-save and resume phases hold only the
training engines and are comparable. --smoke runs the same pipeline on CPU with a 2-layer model of hidden size
64 (where every memory figure is 0): it checks the script, not the memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TRAIN_PHASES = ("train_actor", "train_critic")
COMPARABLE = ("build", "checkpoint_save", "resume", "ref_forward", "actor_forward", "critic_forward",
              "train_actor", "train_critic")


def train_peak(plan: dict) -> float:
    return max(plan["memory"][p]["gpu_gb"] for p in TRAIN_PHASES if p in plan["memory"])


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


def choose_layers(cfg_path: str, base_overrides: list[str], work: str, smoke: bool) -> tuple[dict, int, float, float]:
    """(shape, layers, the stand-in's planned training peak, the target): the per-rank layer shape of the config's
    actor and the layer count whose one-GPU plan comes closest to the config's per-rank training peak."""
    from spmdrl.config import load_config
    from spmdrl.engines.loading import load_hf_config
    from spmdrl.plan import build_plan

    cfg = load_config(cfg_path, [])
    target = train_peak(build_plan(cfg))
    shape = stand_in_shape(load_hf_config(cfg.model.path, cfg.model.trust_remote_code), cfg.placement.actor_tp)
    probe = os.path.join(work, "probe")
    os.makedirs(probe, exist_ok=True)
    best = None
    for layers in range(1, 200):
        llama_config(shape, layers).save_pretrained(probe)
        peak = train_peak(build_plan(load_config(cfg_path, base_overrides + [f"model.path={probe}"]), world_size=1))
        if best is None or abs(peak - target) < abs(best[1] - target):
            best = (layers, peak)
        if peak > target:
            break
    layers, peak = best
    if not smoke and abs(peak - target) > 0.1 * target:
        raise SystemExit(f"no layer count brings the one-GPU training peak within 10% of {target:.1f} GiB "
                         f"(closest: {layers} layers, {peak:.1f} GiB)")
    return shape, layers, peak, target


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
    ap.add_argument("--smoke", action="store_true", help="CPU check of the pipeline with a tiny model")
    args = ap.parse_args()
    from spmdrl.config import load_config
    from spmdrl.data.synthetic import make_arith
    from spmdrl.metrics import read_jsonl
    from spmdrl.plan import build_plan

    out = os.path.abspath(args.out)
    model_dir, run_a, run_b = (os.path.join(out, x) for x in ("model", "run_a", "run_b"))
    data = make_arith(os.path.join(out, "data"), n_train=64, n_val=0, seed=0)["train"]
    base = stand_in_overrides(model_dir, data, run_a, args.smoke)
    shape, layers, planned_peak, target = choose_layers(args.config, base, out, args.smoke)
    print(f"target: {target:.2f} GiB per rank ({args.config}); stand-in: {layers} layers of {shape}, "
          f"plan {planned_peak:.2f} GiB", flush=True)
    write_llama(shape, 2 if args.smoke else layers, model_dir, args.smoke)
    plan = build_plan(load_config(args.config, base), world_size=1)
    train = [sys.executable, "-m", "spmdrl.train", "--config", args.config]
    run(train + base + ["trainer.total_steps=3", "checkpoint.resume=off"], os.path.join(out, "run_a.log"))
    ckpt = os.path.join(run_a, "checkpoints", "step_00000002")
    resumed = [o for o in base if not o.startswith("trainer.output_dir=")]
    run(train + resumed + [f"trainer.output_dir={run_b}", "trainer.total_steps=3", f"checkpoint.resume={ckpt}"],
        os.path.join(out, "run_b.log"))
    measured: dict[str, float] = {}
    for d in (run_a, run_b):
        for row in read_jsonl(os.path.join(d, "metrics.jsonl")):
            for k, v in row.items():
                if k.startswith("memory/") and k.endswith("_allocated_gb"):
                    phase = k[len("memory/"):-len("_allocated_gb")]
                    measured[phase] = max(measured.get(phase, 0.0), v)
    limit = 0.9 * plan["hardware"]["gpu_memory_gb"] * 1e9 / 2**30
    rows = []
    for phase in sorted(set(plan["memory"]) | set(measured)):
        want = plan["memory"].get(phase, {}).get("gpu_gb")
        got = measured.get(phase)
        ratio = got / want if got is not None and want else None
        if phase not in COMPARABLE:
            flag = "not comparable: the plan counts vLLM, the rehearsal runs the transformers engine"
        elif ratio is None:
            flag = "no planned figure" if got is not None else "not measured"
        else:
            flag = "off by more than 10%" if abs(ratio - 1) > 0.1 else ""
        if got is not None and got > limit:
            flag = f"above 0.9 x GPU ({limit:.1f} GiB)"
        rows.append({"phase": phase, "measured_gb": got, "planned_gb": want, "ratio": ratio, "note": flag})
    print(f"{'phase':18s} {'measured GiB':>13s} {'planned GiB':>12s} {'ratio':>6s}  note")
    for r in rows:
        f = (lambda x, w: f"{x:{w}.2f}" if x is not None else " " * (w - 1) + "-")
        print(f"{r['phase']:18s} {f(r['measured_gb'], 13)} {f(r['planned_gb'], 12)} {f(r['ratio'], 6)}  {r['note']}")
    with open(os.path.join(out, "rehearsal.json"), "w") as fh:
        json.dump({"config": args.config, "target_train_peak_gb": target, "layers": layers,
                   "planned_train_peak_gb": planned_peak, "phases": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
