#!/usr/bin/env bash
# One-rank GRPO/PPO run on a random-init Qwen2 of Qwen2.5-0.5B's shape (SIZE=0.5b) or a 2-layer toy (tiny),
# with the transformers rollout engine (for machines without vLLM). Writes the model, the synthetic task,
# `spmdrl plan --json` for the same config (OUTDIR/plan.json) and the run (OUTDIR/run/metrics.jsonl), so the
# measured memory/<phase>_allocated_gb can be read next to the plan's per-phase figures.
#   bash launch/gpu_check.sh OUTDIR cuda|cpu 0.5b|tiny [config overrides...]
# The figures in docs/performance.md ("GPU: first runs") came from this script on one H100.
set -euo pipefail
W=$1; DEV=$2; SIZE=$3; shift 3
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p $W
python3 - "$W" "$SIZE" <<'PY'
import sys, os
from spmdrl.tiny import build_tokenizer, build_model
w, size = sys.argv[1], sys.argv[2]
if size == "0.5b":
    kw = dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, tie_word_embeddings=True)
else:
    kw = dict(vocab_size=151936, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, tie_word_embeddings=True)
m = os.path.join(w, "model")
build_tokenizer(m); build_model(m, max_position_embeddings=4096, **kw)
print("model built", m)
PY
python3 -m spmdrl data synthetic --out $W/data --n-sft 64
python3 -m spmdrl plan --config configs/quickstart/grpo.toml model.path=$W/model trainer.device=$DEV rollout.engine=hf "$@" --world-size 1 --json > $W/plan.json || echo "plan failed"
torchrun --nproc-per-node 1 -m spmdrl.train --config configs/quickstart/grpo.toml model.path=$W/model \
  data.train_files="[\"$W/data/train.parquet\"]" data.val_files="[]" trainer.output_dir=$W/run \
  trainer.device=$DEV rollout.engine=hf checkpoint.resume=off trainer.overwrite=true "$@"
