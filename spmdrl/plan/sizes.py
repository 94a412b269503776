"""Which model sizes fit a config on one GPU, full fine-tuning next to LoRA (`spmdrl plan --sizes`).

The config's workload (batch, lengths, micro-batches, rollout settings, offloading) is planned on a world of one
GPU for each Qwen2.5 size whose config.json ships in spmdrl/model_configs, and for the mixture of experts
Qwen3-30B-A3B (listed by total and active parameters), once as full fine-tuning and once with LoRA (the config's
[lora], else rank 32 on every linear layer, synced as an adapter). Every figure is `build_plan`'s.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

QWEN25_SIZES = ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B")
SIZES = QWEN25_SIZES + ("Qwen/Qwen3-30B-A3B",)  # a size, or a model id (its config.json in spmdrl/model_configs)
DEFAULT_LORA = SimpleNamespace(enable=True, rank=32, alpha=64, target_modules=[], dropout=0.0, init="default",
                               critic=False)


def _one_gpu(cfg, path: str, lora):
    c = copy.deepcopy(cfg)
    c.model.path = path
    if lora is None:
        c.lora.enable = False
    else:
        c.lora = lora
    c.memory.nodes, c.memory.gpus_per_node = 1, 1
    p = c.placement
    p.mode, p.rollout_tp, p.actor_tp, p.ref_tp, p.critic_tp = "colocate", 1, 1, 1, 1
    p.actor_ep, p.ref_ep, p.critic_ep = 1, 1, 1
    for key in ("actor_ranks", "ref_ranks", "critic_ranks", "rollout_ranks", "reward_ranks"):
        setattr(p, key, [])
    return c


def _row(plan: dict) -> dict:
    worst = max(plan["memory"], key=lambda k: plan["memory"][k]["gpu_gb"])
    return {"fits": plan["fits"], "peak_gpu_gb": plan["memory"][worst]["gpu_gb"], "peak_phase": worst,
            "sync_bytes": plan["weight_sync"]["bytes_recv_max"]}


def fit_table(cfg, sizes=SIZES) -> list[dict]:
    """One row per size: parameters (and those active per token, for a mixture of experts), and full
    fine-tuning's and LoRA's fit, peak GPU GiB (and its phase) and weight-sync bytes on one GPU of
    memory.gpu_memory_gb."""
    from spmdrl.config.derived import lora_settings
    from spmdrl.plan.estimate import build_plan

    lora = lora_settings(cfg) or DEFAULT_LORA
    rows = []
    for size in sizes:
        path = size if "/" in size else f"Qwen/Qwen2.5-{size}-Instruct"
        full = build_plan(_one_gpu(cfg, path, None), 1)
        with_lora = build_plan(_one_gpu(cfg, path, lora), 1)
        rows.append({"model": path, "params": full["model"]["params"], "full": _row(full), "lora": _row(with_lora),
                     "lora_rank": int(lora.rank),
                     **({"active_params": full["model"]["active_params"]} if "active_params" in full["model"] else {})})
    return rows


def render_fit_table(rows: list[dict], gpu_gb: float) -> str:
    rank = rows[0]["lora_rank"] if rows else 0
    lines = [f"this config's workload on one GPU of {gpu_gb:g} GiB, full fine-tuning and LoRA rank {rank} "
             "(peak GPU per rank and the phase it is in):",
             f"  {'model':30s} {'params':>20s}  {'full FT':30s}  {'LoRA':30s}"]
    for r in rows:
        cell = {k: f"{'fits' if r[k]['fits'] else 'NO':4s} {r[k]['peak_gpu_gb']:6.1f} GiB {r[k]['peak_phase']:15s}"
                for k in ("full", "lora")}
        params = f"{r['params'] / 1e9:.2f}B" + (f" ({r['active_params'] / 1e9:.2f}B active)" if "active_params" in r else "")
        lines.append(f"  {r['model']:30s} {params:>20s}  {cell['full']:30s}  {cell['lora']:30s}")
    return "\n".join(lines)
