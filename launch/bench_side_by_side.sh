#!/usr/bin/env bash
# Update and forward throughput of a previous revision and of this checkout, on the same batches, in one run.
#
# The previous revision's spmdrl is exported (git archive) next to the results; launch/bench_train_engine.py from
# this checkout then runs once against each (PYTHONPATH), with the same arguments and seed, so both see the
# same model and the same token batches. launch/bench_compare.py prints the table, with the FLOPs of both recomputed
# by this checkout's formula (spmdrl.metrics.flops_metrics), so the TFLOP/s and MFU columns compare like with like.
#
#   bash launch/bench_side_by_side.sh OLD_REV OUT_DIR [bench_train_engine.py args...]
#   bash launch/bench_side_by_side.sh eb2d77d /tmp/sbs --tiny --device cpu        # CPU smoke test
#
# Without bench arguments it runs the RL length mix of launch/bench_update_mix.sh: Qwen2.5-1.5B- and 3B-shaped
# random-init models on both backends (bf16). OLD_NEW_ARGS / NEW_ARGS add arguments to the new runs only (for
# options the old revision does not have).
set -euo pipefail
old_rev=${1:?usage: bench_side_by_side.sh OLD_REV OUT_DIR [args...]}
out=${2:?usage: bench_side_by_side.sh OLD_REV OUT_DIR [args...]}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
mkdir -p "$out/old"
git -C "$repo" archive "$old_rev" spmdrl | tar -x -C "$out/old"
read -r -a new_args <<< "${NEW_ARGS:-}"
mix=(--length-mix rl --prompt-min 128 --prompt-len 1024 --response-min 64 --response-len 4096 --batch 64 --n 8
     --packed --max-tokens 8192 --forward-max-tokens 16384 --iters 2 --count-syncs)
if [ $# -gt 0 ]; then mix=("$@"); fi
shapes=(${SHAPES:-qwen2.5-1.5b qwen2.5-3b})
for shape in "${shapes[@]}"; do
  extra=(--shape "$shape")
  [ "$shape" = qwen2.5-3b ] && extra+=(--recompute)
  for backend in ${BACKENDS:-megatron fsdp}; do
    for side in old new; do
      echo "== $shape $backend $side" >&2
      path=$repo; args=()
      if [ "$side" = old ]; then path=$out/old; else args=("${new_args[@]}"); fi
      PYTHONPATH="$path" python "$here/bench_train_engine.py" --backend "$backend" "${extra[@]}" "${mix[@]}" \
        "${args[@]}" --model-dir "$out/model-$shape" > "$out/$shape-$backend-$side.json"
    done
  done
done
PYTHONPATH="$repo" python "$here/bench_compare.py" "$out"/*-old.json
