#!/usr/bin/env bash
# Where the optimizer step runs (bench/results/step_thread.md): after backward, in backward on
# backward's thread, and in backward on a thread of its own (set_step_in_backward's StepThread).
#
#   bench/step_thread.sh BUILD_DIR [REPEATS] [EXTRA FLAGS...]
#
# Runs the example trainer (fsdp_gpt) as one process (world 1), one OpenMP thread, so that the
# machine's second core is free for the step's own thread: the CPU stand-in for CPU offload on a
# GPU, where the host steps while the device runs backward. A small batch makes LibTorch's AdamW a
# large part of the step. Interleaved REPEATS times; prints a markdown table of the median ms/step
# over the logged intervals after the first (10 steps each), every interval, and the ratio to the
# step after backward. Also checks that every mode logs the same losses.
set -euo pipefail
# shellcheck source=bench/trainer_runs.sh
source "$(dirname "$0")/trainer_runs.sh"
MODEL=(--layers 6 --width 384 --heads 6 --context 16 --batch-per-rank 1 --steps 40 --log-interval 10
       --eval-batches 1 --sample-bytes 8 --prompt "The " "${EXTRA[@]}")
ORDER=(after backward own)
declare -A FLAGS=(
  [after]=""
  [backward]="--step-in-backward --step-thread backward"
  [own]="--step-in-backward --step-thread own"
)
declare -A TIMES LOSSES
for ((r = 0; r < REPEATS; r++)); do
  for name in "${ORDER[@]}"; do
    # shellcheck disable=SC2086  # the mode's flags are split on purpose
    out=$("$TRAINER" "${MODEL[@]}" ${FLAGS[$name]} 2>&1) || {
      echo "$out" >&2
      exit 1
    }
    ms=$(grep -E "^step +(20|30|40)/" <<<"$out" | sed -E 's/.*\| +([0-9.]+) ms\/step.*/\1/' | tr '\n' ' ')
    losses=$(grep -E "^step +[0-9]+/" <<<"$out" | sed -E 's/.*(\| loss [0-9.]+) \|.*/\1/' | tr '\n' ' ')
    [ -z "${LOSSES[after]:-}" ] || [ "$losses" = "${LOSSES[after]}" ] || {
      echo "$name logged other losses than after: $losses vs ${LOSSES[after]}" >&2
      exit 1
    }
    LOSSES[$name]=$losses
    TIMES[$name]="${TIMES[$name]:-} $ms"
    echo "repeat $r $name: $ms ms/step" >&2
  done
done
base=$(echo "${TIMES[after]}" | median)
echo "| optimizer step | flags | ms/step (median) | intervals | ratio to after backward |"
echo "| --- | --- | ---: | --- | ---: |"
for name in "${ORDER[@]}"; do
  m=$(echo "${TIMES[$name]}" | median)
  echo "| $name | \`${FLAGS[$name]:-}\` | $m | ${TIMES[$name]# } | $(awk -v a="$m" -v b="$base" 'BEGIN { printf "%.2f", a / b }') |"
done
