#!/usr/bin/env bash
# The CPU quickstart: tiny model + tokenizer, synthetic arithmetic data, SFT warm start, then GRPO with two
# processes and in-process vLLM, then a summary table. Everything lands in $OUT (default outputs/quickstart);
# the GRPO run in $OUT/<config name> (grpo, grpo_split, grpo_lora, ...), so each config keeps its own results.
#   bash launch/quickstart.sh [extra GRPO overrides, e.g. trainer.total_steps=20]
#   GRPO_CONFIG=configs/quickstart/grpo_split.toml bash launch/quickstart.sh   # split placement, one step off-policy
#   TASK=tools bash launch/quickstart.sh   # long sums the tiny model solves only by calling the calculator
#     (its own data, SFT on tool-call conversations and GRPO with multi-turn rollouts; OUT=outputs/quickstart_tools)
#   TASK=agent bash launch/quickstart.sh   # the same task, data and SFT model, but GRPO rolls out with a black-box
#     agent (configs/quickstart/agent_react.py, the openai client) through the endpoint (docs/agents.md); results in
#     outputs/quickstart_tools/grpo_agent, next to TASK=tools' grpo_tools
#   TASK=vlm bash launch/quickstart.sh   # a tiny vision-language model (Qwen2.5-VL) counting shapes in pictures: its
#     own data (count-shapes), SFT on pictures with their answers, GRPO with the transformers rollout engine
#     (docs/vlm.md; OUT=outputs/quickstart_vlm)
#   TASK=distill bash launch/quickstart.sh   # on-policy distillation: the GRPO quickstart's result (run first when
#     $OUT/grpo has no checkpoint) exported as the teacher, the SFT model as the student; distillation and plain
#     GRPO from the same start over the same steps, side by side (DISTILL_STEPS, default 20)
# A second run reuses $OUT's tiny model, data and SFT model (delete $OUT/sft_model to train it again).
# SFT_OVERRIDES="sft.max_steps=100" passes overrides to the SFT stage.
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${TASK:-arith}
MODEL=()  # spmdrl model tiny's architecture (default: the text model)
GRPO_NAME=  # the GRPO config's name when it is not grpo$SUFFIX
case "$TASK" in
  arith) SUFFIX= ; DATA=(synthetic --n-sft 4096) ;;
  tools) SUFFIX=_tools ; DATA=(tool-sums) ;;
  agent) SUFFIX=_tools ; DATA=(tool-sums) ; GRPO_NAME=grpo_agent ;;  # the tools task's model, data and SFT warm start
  vlm) SUFFIX=_vlm ; DATA=(count-shapes --n-train 1024 --n-val 128 --n-sft 2048) ; MODEL=(--arch qwen2_5_vl) ;;
  distill) SUFFIX= ; DATA=(synthetic --n-sft 4096) ;;  # the arithmetic task's model, data and SFT warm start
  *) echo "error: TASK=$TASK is not one of arith, tools, agent, vlm, distill" >&2; exit 2 ;;
esac
OUT=${OUT:-outputs/quickstart$SUFFIX}
NPROC=${NPROC:-2}
GRPO_CONFIG=${GRPO_CONFIG:-configs/quickstart/${GRPO_NAME:-grpo$SUFFIX}.toml}
RUN="$OUT/$(basename "$GRPO_CONFIG" .toml)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
start=$(date +%s)

t_sft=$(date +%s)
if [ -f "$OUT/sft_model/config.json" ]; then
  echo "== 1-3/4 reusing the tiny model, data and SFT model in $OUT (delete $OUT/sft_model to retrain)"
else
  echo "== 1/4 tiny model and tokenizer -> $OUT/tiny"
  spmdrl model tiny "${MODEL[@]}" --out "$OUT/tiny"
  echo "== 2/4 synthetic data ($TASK) -> $OUT/data"
  spmdrl data "${DATA[@]}" --out "$OUT/data"
  echo "== 3/4 SFT warm start ($NPROC processes)"
  t_sft=$(date +%s)
  # shellcheck disable=SC2086  # SFT_OVERRIDES is a list of words
  spmdrl sft --nproc "$NPROC" --config "configs/quickstart/sft$SUFFIX.toml" \
    model.path="$OUT/tiny" sft.train_files="[\"$OUT/data/sft.parquet\"]" \
    sft.save_dir="$OUT/sft_model" trainer.output_dir="$OUT/sft" ${SFT_OVERRIDES:-}
fi
if [ "$TASK" = distill ]; then
  # the teacher: the GRPO quickstart's trained model (trained here first if $OUT/grpo holds no checkpoint)
  STEPS=${DISTILL_STEPS:-20}
  if [ ! -f "$OUT/teacher/config.json" ]; then
    if ! ls "$OUT/grpo/checkpoints" 2>/dev/null | grep -q step_; then
      echo "== 4a GRPO quickstart, the teacher ($NPROC processes) -> $OUT/grpo"
      spmdrl train --nproc "$NPROC" --config configs/quickstart/grpo.toml \
        model.path="$OUT/sft_model" data.train_files="[\"$OUT/data/train.parquet\"]" \
        data.val_files="[\"$OUT/data/val.parquet\"]" trainer.output_dir="$OUT/grpo" checkpoint.resume=off trainer.overwrite=true
    fi
    spmdrl export --checkpoint "$OUT/grpo" --out "$OUT/teacher"
  fi
  t_grpo=$(date +%s)
  for run in distill grpo_baseline; do
    cfg=configs/quickstart/distill.toml
    [ "$run" = grpo_baseline ] && cfg=configs/quickstart/grpo.toml
    echo "== 4b $run: $STEPS steps from the SFT model ($NPROC processes) -> $OUT/$run"
    spmdrl train --nproc "$NPROC" --config "$cfg" model.path="$OUT/sft_model" \
      data.train_files="[\"$OUT/data/train.parquet\"]" data.val_files="[\"$OUT/data/val.parquet\"]" \
      trainer.output_dir="$OUT/$run" trainer.total_steps="$STEPS" trainer.test_freq=5 checkpoint.save_freq=-1 \
      checkpoint.resume=off trainer.overwrite=true $([ "$run" = distill ] && echo distill.teacher_path="$OUT/teacher") "$@"
  done
  echo "teacher (GRPO quickstart, its last validation) vs the student distilled from it and plain GRPO, same start:"
  spmdrl summary "$OUT/grpo" "$OUT/distill" "$OUT/grpo_baseline"
  echo "distillation and GRPO $(( $(date +%s) - t_grpo )) s; quickstart finished in $(( $(date +%s) - start )) s"
  exit 0
fi
echo "== 4/4 GRPO ($NPROC processes, $([ "$TASK" = vlm ] && echo "transformers rollout engine" || echo "in-process vLLM")$([ "$TASK" = agent ] && echo ", agent sessions")) -> $RUN"
t_grpo=$(date +%s)
# the quickstart starts its GRPO run over: checkpoint.resume=off, and trainer.overwrite=true deletes an earlier
# run of this config in $RUN (without it a fresh run into a used directory is refused); pass
# checkpoint.resume=auto trainer.overwrite=false to continue an interrupted quickstart instead
spmdrl train --nproc "$NPROC" --config "$GRPO_CONFIG" \
  model.path="$OUT/sft_model" data.train_files="[\"$OUT/data/train.parquet\"]" \
  data.val_files="[\"$OUT/data/val.parquet\"]" trainer.output_dir="$RUN" checkpoint.resume=off trainer.overwrite=true "$@"

t_end=$(date +%s)

spmdrl summary "$RUN"
echo "SFT $(( t_grpo - t_sft )) s, GRPO $(( t_end - t_grpo )) s"
echo "quickstart finished in $(( $(date +%s) - start )) s; tensorboard --logdir $RUN/tensorboard"
