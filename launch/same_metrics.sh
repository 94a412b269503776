#!/usr/bin/env bash
# Fixed-seed 2-rank CPU runs whose metrics a behaviour-preserving change must leave bitwise identical:
# colocated GRPO with a critic and a ref (two mini-batches, so old log-probs are computed; validation; checkpoints),
# the same run resumed from its step-2 checkpoint, and split placement one step off-policy.
#   bash launch/same_metrics.sh OUT            # runs the three, about a minute on 2 cores
#   python launch/same_metrics.py OUT_A OUT_B  # compares two such OUTs, every metric but timing/, perf/, memory/
# To compare with another commit: check it out in a git worktree and run this script from there into another OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "$1"); mkdir -p "$OUT"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false VLLM_LOGGING_LEVEL=WARNING
[ -d "$OUT/tiny" ] || spmdrl model tiny --out "$OUT/tiny" >/dev/null
[ -d "$OUT/data" ] || spmdrl data synthetic --out "$OUT/data" --n-sft 64 >/dev/null
rm -rf "$OUT/colocated" "$OUT/resumed" "$OUT/split"
COMMON=(model.path="$OUT/tiny" data.train_files="[\"$OUT/data/train.parquet\"]" data.val_files="[\"$OUT/data/val.parquet\"]"
  data.train_batch_size=8 rollout.n=4 trainer.total_steps=4 trainer.test_freq=2 checkpoint.save_freq=2 checkpoint.keep_last=0
  logging.progress=false logging.tensorboard=false hooks.files='["configs/hooks/custom_metric.py"]' checkpoint.resume=off
  reward.custom_fn=tests/dist_scripts/reward_len.py:score)
CRITIC=(critic.enable=true actor.use_kl_loss=true actor.ppo_mini_batch_size=4 actor.micro_batch_size=4 critic.micro_batch_size=4)
spmdrl train --nproc 2 --config configs/quickstart/grpo.toml "${COMMON[@]}" "${CRITIC[@]}" \
  trainer.output_dir="$OUT/colocated" > "$OUT/colocated.log" 2>&1
# keep steps 0-2 of the copied metrics.jsonl: steps 3-4 must come from the resumed run
cp -r "$OUT/colocated" "$OUT/resumed"; rm -rf "$OUT/resumed/checkpoints/step_00000004"
python - "$OUT/resumed/metrics.jsonl" <<'PY'
import json, sys
rows = [line for line in open(sys.argv[1]) if json.loads(line)["step"] <= 2]
open(sys.argv[1], "w").writelines(rows)
PY
spmdrl train --nproc 2 --config configs/quickstart/grpo.toml "${COMMON[@]}" "${CRITIC[@]}" \
  trainer.output_dir="$OUT/resumed" checkpoint.resume=auto > "$OUT/resumed.log" 2>&1
spmdrl train --nproc 2 --config configs/quickstart/grpo_split.toml "${COMMON[@]}" actor.ppo_mini_batch_size=8 \
  actor.micro_batch_size=8 trainer.output_dir="$OUT/split" > "$OUT/split.log" 2>&1
echo "metrics in $OUT/{colocated,resumed,split}/metrics.jsonl"
