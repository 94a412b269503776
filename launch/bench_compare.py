"""Side-by-side table of launch/bench_train_engine.py results: each OLD.json next to its NEW.json (the same name
with -old replaced by -new), FLOPs of both recomputed with this checkout's formula (spmdrl.metrics.flops_metrics:
lm_head at response positions, causal attention pairs within each sequence) from the token counts each run
recorded and the model's config, so the TFLOP/s and MFU columns compare like with like.

    python launch/bench_compare.py OUT_DIR/*-old.json
"""
from __future__ import annotations

import json
import sys


def recomputed(res: dict) -> dict:
    from transformers import AutoConfig

    from spmdrl.metrics import flops_metrics

    f = flops_metrics(AutoConfig.from_pretrained(res["model_dir"]), **res["counts"], update_s=res["train_step_s"],
                      rollout_s=res["logprobs_s"], devices=1, peak_tflops=res.get("peak_tflops") or 0.0)
    return {"update_tflops": f["perf/actor_tflops"], "forward_tflops": f["perf/rollout_tflops"],
            "update_mfu": f.get("perf/mfu_actor"), "forward_mfu": f.get("perf/mfu_rollout")}


def rows(old: dict, new: dict) -> list[tuple[str, float, float]]:
    o, n = recomputed(old), recomputed(new)
    out = [("update tokens/s", old["train_step_tokens_per_s"], new["train_step_tokens_per_s"]),
           ("update TFLOP/s", o["update_tflops"], n["update_tflops"])]
    if o["update_mfu"] is not None:
        out.append(("update MFU %", 100 * o["update_mfu"], 100 * n["update_mfu"]))
    out += [("forward tokens/s", old["logprobs_tokens_per_s"], new["logprobs_tokens_per_s"]),
            ("forward TFLOP/s", o["forward_tflops"], n["forward_tflops"])]
    if o["forward_mfu"] is not None:
        out.append(("forward MFU %", 100 * o["forward_mfu"], 100 * n["forward_mfu"]))
    out += [("peak GB, update", old["peak_gb_train_step"], new["peak_gb_train_step"]),
            ("peak GB, forward", old["peak_gb_logprobs"], new["peak_gb_logprobs"])]
    for phase, label in (("train_step", "update"), ("logprobs", "forward")):  # --count-syncs, on a GPU
        if f"cuda_syncs_{phase}" in new:
            out.append((f"host-device syncs, one {label}", old.get(f"cuda_syncs_{phase}", 0), new[f"cuda_syncs_{phase}"]))
    return out


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print("| model | backend | metric | old | new | new / old |")
    print("|---|---|---|---:|---:|---:|")
    for path in sorted(paths):
        with open(path) as f:
            old = json.load(f)
        with open(path.replace("-old.json", "-new.json")) as f:
            new = json.load(f)
        name = new.get("shape") or "custom"
        for metric, a, b in rows(old, new):
            ratio = f"{b / a:.2f}" if a else "-"
            print(f"| {name} | {new['backend']} | {metric} | {a:.4g} | {b:.4g} | {ratio} |")
    dev = {json.load(open(p))["device"] for p in paths}
    print(f"\ndevice: {', '.join(sorted(dev))}; old: {json.load(open(paths[0]))['spmdrl']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
