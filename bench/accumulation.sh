#!/usr/bin/env bash
# Memory and step time of each gradient-accumulation mode (bench/results/accumulation.md).
#
#   bench/accumulation.sh BUILD_DIR [REPEATS] [EXTRA FLAGS...]
#
# Runs the example trainer (fsdp_gpt) through fsdp-run on 4 ranks, one thread each, with the same
# global batch split into 4 micro-batches per rank, once per --grad-accum-mode (and once without
# accumulation), interleaved REPEATS times. Prints a markdown table: rank 0's FSDP peaks of
# parameter and gradient bytes over the run (memory_stats(); deterministic, so one figure per
# mode) and the median ms/step. HYBRID_SHARD (sharding factor 2) for every mode, so that
# replica-deferred applies.
set -euo pipefail
# shellcheck source=bench/trainer_runs.sh
source "$(dirname "$0")/trainer_runs.sh"
MODEL=(--layers 4 --width 256 --heads 8 --context 64 --batch-per-rank 4 --steps 16 --warmup 2 --log-interval 8
       --eval-batches 1 --sample-bytes 0 --show-memory --strategy HYBRID_SHARD --sharding-factor 2 "${EXTRA[@]}")
ORDER=(none no-sync no-sync-unsharded reduce replica-deferred)
declare -A FLAGS=(
  [none]="--grad-accum 1"
  [no-sync]="--grad-accum 4 --grad-accum-mode no-sync"
  [no-sync-unsharded]="--grad-accum 4 --grad-accum-mode no-sync-unsharded"
  [reduce]="--grad-accum 4 --grad-accum-mode reduce"
  [replica-deferred]="--grad-accum 4 --grad-accum-mode replica-deferred"
)
declare -A TIMES PARAMS GRADS
for ((r = 0; r < REPEATS; r++)); do
  for name in "${ORDER[@]}"; do
    # shellcheck disable=SC2086  # the mode's flags are split on purpose
    out=$("$RUN" --nproc-per-node 4 "$TRAINER" "${MODEL[@]}" ${FLAGS[$name]} 2>&1) || {
      echo "$out" >&2
      exit 1
    }
    ms=$(grep -E "^\[rank 0\] step +16/" <<<"$out" | sed -E 's/.*\| +([0-9.]+) ms\/step.*/\1/')
    peaks=$(grep -E "FSDP peak during training" <<<"$out" | sed -E 's/.*parameters ([0-9.]+) MiB, gradients ([0-9.]+) MiB.*/\1 \2/')
    TIMES[$name]="${TIMES[$name]:-} $ms"
    PARAMS[$name]=${peaks% *}
    GRADS[$name]=${peaks#* }
    echo "repeat $r $name: $ms ms/step, peaks $peaks MiB" >&2
  done
done
base=$(echo "${TIMES[none]}" | median)
echo "| mode | flags | parameter peak MiB | gradient peak MiB | ms/step (median of $REPEATS) | runs | ratio to no accumulation |"
echo "| --- | --- | ---: | ---: | ---: | --- | ---: |"
for name in "${ORDER[@]}"; do
  m=$(echo "${TIMES[$name]}" | median)
  echo "| $name | \`${FLAGS[$name]}\` | ${PARAMS[$name]} | ${GRADS[$name]} | $m | ${TIMES[$name]# } | $(awk -v a="$m" -v b="$base" 'BEGIN { printf "%.2f", a / b }') |"
done
