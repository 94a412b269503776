#!/usr/bin/env bash
# Learning under asynchronous and partial rollouts: the quickstart's GRPO stage run three ways from the same SFT
# model, data and seed, then validation accuracy per validation step side by side:
#   sync     configs/quickstart/grpo.toml as shipped (colocated, synchronous)
#   async    split placement (rank 0 generates, rank 1 trains), rollout.partial = keep, trainer.max_staleness = 2
#   partial  colocated, rollout.partial = keep (rollout.max_version_lag = 1)
# Every step trains data.train_batch_size x rollout.n = 256 samples in all three, so a step is the same number of
# trained samples. The quickstart is on-policy (one epoch, one mini-batch): each token's old policy is its
# behaviour log-prob, so no decoupled PPO or rollout_is is needed.
#   bash launch/bench_learning.sh [extra overrides for all three, e.g. trainer.seed=1]
# Needs the quickstart's data and SFT model in $OUT (default outputs/quickstart: run `bash launch/quickstart.sh`
# once); the runs go to $OUT/learning_{sync,async,partial}$TAG (TAG, default empty: e.g. TAG=_s1 for a second seed).
# MODES="async partial" skips the synchronous run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/quickstart}
TAG=${TAG:-}
NPROC=${NPROC:-2}
if [ ! -f "$OUT/sft_model/config.json" ]; then
  echo "error: $OUT/sft_model not found: run 'bash launch/quickstart.sh' first (or set OUT to its output directory)" >&2
  exit 2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
common=(model.path="$OUT/sft_model" data.train_files="[\"$OUT/data/train.parquet\"]"
        data.val_files="[\"$OUT/data/val.parquet\"]" checkpoint.resume=off trainer.overwrite=true checkpoint.save_freq=-1)
ranks="[$(seq -s, 0 $(( NPROC / 2 - 1 )))]"
for mode in ${MODES:-sync async partial}; do
  case "$mode" in
    sync) extra=() ;;
    async) extra=(placement.mode=split "placement.rollout_ranks=$ranks" trainer.max_staleness=2 rollout.partial=keep) ;;
    partial) extra=(rollout.partial=keep) ;;
    *) echo "error: MODES: $mode is not one of sync, async, partial" >&2; exit 2 ;;
  esac
  echo "== $mode -> $OUT/learning_$mode$TAG"
  spmdrl train --nproc "$NPROC" --config configs/quickstart/grpo.toml "${common[@]}" \
    trainer.output_dir="$OUT/learning_$mode$TAG" "${extra[@]}" "$@"
done
args=()
for mode in sync async partial; do
  if [ -f "$OUT/learning_$mode$TAG/metrics.jsonl" ]; then args+=("$mode=$OUT/learning_$mode$TAG"); fi
done
python -m spmdrl.bench learning "${args[@]}"
