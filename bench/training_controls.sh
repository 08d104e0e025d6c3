#!/usr/bin/env bash
# Step time of each training control against the same run without it (bench/results/training_controls.md).
#
#   bench/training_controls.sh BUILD_DIR [REPEATS] [EXTRA FLAGS...]
#
# Runs the example trainer (fsdp_gpt) through fsdp-run on 4 ranks, one thread each, alternating
# the baseline with each control (interleaved, so load drifts hit both), REPEATS times; prints a
# markdown table of median ms/step and the ratio to the baseline's median. Every run trains the
# same model on the same global batch: --grad-accum splits each rank's rows into micro-batches.
set -euo pipefail
# shellcheck source=bench/trainer_runs.sh
source "$(dirname "$0")/trainer_runs.sh"
MODEL=(--layers 4 --width 256 --heads 8 --context 64 --batch-per-rank 4 --steps 24 --warmup 2 --log-interval 8
       --eval-batches 1 --sample-bytes 0 "${EXTRA[@]}")
declare -A CONTROLS=(
  [baseline]=""
  [bf16]="--mixed-precision bf16"
  [grad-accum-2]="--grad-accum 2"
  [clip]="--clip-grad-norm 1.0"
  [no-reshard-after-forward]="--reshard-after-forward false"
)
help=$("$TRAINER" --help 2>/dev/null || true)
if grep -q -- "--activation-checkpointing" <<<"$help"; then
  CONTROLS[activation-checkpointing]="--activation-checkpointing"
fi
ORDER=(baseline bf16 grad-accum-2 clip no-reshard-after-forward activation-checkpointing)
declare -A TIMES
ms_per_step() {  # the mean over the steps after the first log window (warm-up excluded)
  grep -E "^\[rank 0\] step +(16|24)/" | sed -E 's/.*\| +([0-9.]+) ms\/step.*/\1/' | awk '{ s += $1 } END { printf "%.1f", s / NR }'
}
for ((r = 0; r < REPEATS; r++)); do
  for name in "${ORDER[@]}"; do
    [ -n "${CONTROLS[$name]+x}" ] || continue
    # shellcheck disable=SC2086  # the control's flags are split on purpose
    ms=$("$RUN" --nproc-per-node 4 "$TRAINER" "${MODEL[@]}" ${CONTROLS[$name]} 2>&1 | ms_per_step)
    TIMES[$name]="${TIMES[$name]:-} $ms"
    echo "repeat $r $name: $ms ms/step" >&2
  done
done
base=$(echo "${TIMES[baseline]}" | median)
echo "| control | flags | ms/step (median of $REPEATS) | runs | ratio to baseline |"
echo "| --- | --- | ---: | --- | ---: |"
for name in "${ORDER[@]}"; do
  [ -n "${CONTROLS[$name]+x}" ] || continue
  m=$(echo "${TIMES[$name]}" | median)
  echo "| $name | \`${CONTROLS[$name]:-none}\` | $m | ${TIMES[$name]# } | $(awk -v a="$m" -v b="$base" 'BEGIN { printf "%.2f", a / b }') |"
done
