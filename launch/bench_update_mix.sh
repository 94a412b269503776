#!/usr/bin/env bash
# Update-phase throughput on one GPU with an RL length mix: Qwen2.5-1.5B- and Qwen2.5-3B-shaped random-init
# models, both training backends, bf16 compute (fp32 master weights and optimizer state). One JSON object per
# run on stdout (launch/bench_train_engine.py): update tokens/s, model TFLOP/s and MFU (lm_head at response
# positions, causal attention within each sequence; recomputation not counted), forward-only tokens/s, peak
# memory per phase.
#
# The memory settings below are estimates (the 3B run needs activation
# recompute to fit fp32 AdamW state and 8k-token micro-batches in 80 GiB).
#
#   bash launch/bench_update_mix.sh [OUT_DIR] [extra bench_train_engine.py args...]
#   bash launch/bench_update_mix.sh /tmp/mix --tiny --device cpu     # CPU smoke test of the same commands
set -euo pipefail
out=${1:-/tmp/bench_update_mix}
shift || true
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
# prompts 128-1024 tokens per group, responses 64-4096 tokens, 64 sequences (8 groups of 8) per optimizer step
mix=(--length-mix rl --prompt-min 128 --prompt-len 1024 --response-min 64 --response-len 4096 --batch 64 --n 8
     --packed --max-tokens 8192 --forward-max-tokens 16384 --iters 2 --count-syncs)
for shape in qwen2.5-1.5b qwen2.5-3b; do
  extra=()
  [ "$shape" = qwen2.5-3b ] && extra=(--recompute)
  for backend in megatron fsdp; do
    echo "== $shape $backend" >&2
    python "$here/bench_train_engine.py" --backend "$backend" --shape "$shape" "${mix[@]}" "${extra[@]}" \
      --model-dir "$out/$shape" "$@" | tee "$out/$shape-$backend.json"
  done
done
