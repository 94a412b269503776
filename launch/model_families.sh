#!/usr/bin/env bash
# GRPO on a tiny random model of each architecture: 2 processes, in-process vLLM at rollout TP = 2, off-policy
# mini-batches, 2 steps; prints, per architecture, the vLLM-vs-actor log-prob gap at each step and the weight-sync
# bytes per rank against the lower bound.
#   bash launch/model_families.sh [OUT] [ARCH ...]      (default: every architecture of `spmdrl model tiny`)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/model_families}
shift || true
ARCHS=("$@")
[ ${#ARCHS[@]} -gt 0 ] || ARCHS=(llama qwen2 qwen3 mistral gemma3 mixtral qwen3_moe qwen2_moe phi3 falcon)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
[ -f "$OUT/data/train.parquet" ] || spmdrl data synthetic --n-sft 64 --out "$OUT/data" >/dev/null
for arch in "${ARCHS[@]}"; do
  spmdrl model tiny --arch "$arch" --out "$OUT/$arch/model" >/dev/null
  start=$(date +%s)
  if ! spmdrl train --nproc 2 --config configs/quickstart/grpo.toml model.path="$OUT/$arch/model" \
      data.train_files="[\"$OUT/data/train.parquet\"]" data.val_files="[\"$OUT/data/val.parquet\"]" \
      data.max_prompt_length=32 data.max_response_length=8 data.train_batch_size=4 rollout.n=4 rollout.kv_cache_gb=0.1 \
      actor.lr=1e-3 actor.micro_batch_size=4 actor.ppo_mini_batch_size=2 trainer.total_steps=2 trainer.device=cpu \
      trainer.output_dir="$OUT/$arch/run" trainer.overwrite=true logging.progress=false placement.rollout_tp=2 \
      > "$OUT/$arch/log" 2>&1; then
    echo "$arch: FAILED, see $OUT/$arch/log"; continue
  fi
  python - "$arch" "$OUT/$arch/run/metrics.jsonl" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
arch, path, secs = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [r for r in map(json.loads, open(path)) if r.get("step", 0) >= 1]
gaps = " ".join(f"{r['rollout/logprob_diff_max']:.1e}" for r in rows)
r = rows[-1]
print(f"{arch:10s} gap per step {gaps}  sync bytes/rank {int(r['weight_sync/bytes_recv_max'])} "
      f"(lower bound {int(r['weight_sync/bytes_lower_bound'])})  {secs} s")
PY
done
