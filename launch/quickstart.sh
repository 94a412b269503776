#!/usr/bin/env bash
# The CPU quickstart: tiny model + tokenizer, synthetic arithmetic data, SFT warm start, then GRPO with two
# processes and in-process vLLM, then a summary table. Everything lands in $OUT (default outputs/quickstart).
#   bash launch/quickstart.sh [extra GRPO overrides, e.g. trainer.total_steps=20]
#   GRPO_CONFIG=configs/quickstart/grpo_split.toml bash launch/quickstart.sh   # split placement, one step off-policy
#   TASK=tools bash launch/quickstart.sh   # long sums the tiny model solves only by calling the calculator
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${TASK:-arith}
case "$TASK" in
  arith) SUFFIX= ; DATA_CMD=(spmdrl data synthetic --n-sft 4096) ;;
  tools) SUFFIX=_tools ; DATA_CMD=(spmdrl data tool-sums) ;;
  *) echo "error: TASK=$TASK is not one of arith, tools" >&2; exit 2 ;;
esac
OUT=${OUT:-outputs/quickstart$SUFFIX}
NPROC=${NPROC:-2}
SFT_CONFIG=${SFT_CONFIG:-configs/quickstart/sft$SUFFIX.toml}
GRPO_CONFIG=${GRPO_CONFIG:-configs/quickstart/grpo$SUFFIX.toml}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
start=$(date +%s)

echo "== 1/4 tiny model and tokenizer -> $OUT/tiny"
spmdrl model tiny --out "$OUT/tiny"
echo "== 2/4 synthetic data ($TASK) -> $OUT/data"
"${DATA_CMD[@]}" --out "$OUT/data"
echo "== 3/4 SFT warm start ($NPROC processes)"
t_sft=$(date +%s)
spmdrl sft --nproc "$NPROC" --config "$SFT_CONFIG" \
  model.path="$OUT/tiny" sft.train_files="[\"$OUT/data/sft.parquet\"]" \
  sft.save_dir="$OUT/sft_model" trainer.output_dir="$OUT/sft"
echo "== 4/4 GRPO ($NPROC processes, in-process vLLM)"
t_grpo=$(date +%s)
# a fresh SFT model was just trained, so GRPO starts over too: checkpoint.resume=off, and trainer.overwrite=true
# deletes an earlier quickstart's GRPO checkpoints and metrics (without it a fresh run into a used directory is
# refused); pass checkpoint.resume=auto trainer.overwrite=false to continue an interrupted quickstart instead
spmdrl train --nproc "$NPROC" --config "$GRPO_CONFIG" \
  model.path="$OUT/sft_model" data.train_files="[\"$OUT/data/train.parquet\"]" \
  data.val_files="[\"$OUT/data/val.parquet\"]" trainer.output_dir="$OUT/grpo" checkpoint.resume=off trainer.overwrite=true "$@"

t_end=$(date +%s)

spmdrl summary "$OUT/grpo"
echo "SFT $(( t_grpo - t_sft )) s, GRPO $(( t_end - t_grpo )) s"
echo "quickstart finished in $(( $(date +%s) - start )) s; tensorboard --logdir $OUT/grpo/tensorboard"
