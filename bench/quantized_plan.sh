#!/usr/bin/env bash
# The planner's prediction of quantized and unquantized steps against the runs it predicts
# (bench/results/quantized.md, "The planner's prediction").
#
#   bench/quantized_plan.sh BUILD_DIR [REPEATS] [EXTRA FLAGS...]
#
# The narrow GPT of bench/quantized.sh (width 384, 4 blocks, 1 sequence of 16 tokens per rank) at
# world 4, FULL_SHARD, over shared memory without a network model and over the modeled network at
# 10 and 1 Gbit/s between ranks (one rank per modeled host); unquantized and with int8 all-gathers
# and reductions. Every run calibrates first (--calibrate: the model's passes, its quantization
# format's loops, the link and the transport beneath it, the runtime's iterations), then trains 24
# steps and writes its own prediction (--plan-file). Measured: rank 0's ms/step over the logged
# windows at steps 16 and 24; predicted: the plan's step_s. Runs interleaved, REPEATS rounds;
# medians. MASTER_PORT: fsdp-run's port (29500). Prints the markdown table.
set -euo pipefail
# shellcheck source=bench/trainer_runs.sh
source "$(dirname "$0")/trainer_runs.sh"
MODEL=(--layers 4 --width 384 --heads 6 --context 16 --batch-per-rank 1 --sample-bytes 0 --eval-batches 1
       --steps 24 --log-interval 8)
QUANT=(--quantize-all-gather int8 --quantize-reduce int8)
NETWORKS=(shm 10gbit 1gbit)
declare -A NETS=([shm]="FSDP_TRANSPORT=shm" [10gbit]="FSDP_NETWORK_MODEL=gbps=1.25,ranks_per_host=1"
                 [1gbit]="FSDP_NETWORK_MODEL=gbps=0.125,ranks_per_host=1")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
declare -A MEASURED PREDICTED
for ((r = 0; r < REPEATS; r++)); do
  for net in "${NETWORKS[@]}"; do
    for q in plain int8; do
      flags=()
      [ "$q" = int8 ] && flags=("${QUANT[@]}")
      out=$(env "${NETS[$net]}" "$RUN" --master-port "${MASTER_PORT:-29500}" --nproc-per-node 4 "$TRAINER" "${MODEL[@]}" \
            "${EXTRA[@]}" "${flags[@]}" --calibrate --plan-file "$TMP/plan.jsonl" 2>&1)
      ms=$(grep -E "^\[rank 0\] step +(16|24)/" <<<"$out" | sed -E 's/.*\| +([0-9.]+) ms\/step.*/\1/' |
           awk '{ s += $1 } END { printf "%.1f", s / NR }')
      predicted=$(grep -oE '"step_s":[0-9.e+-]+' "$TMP/plan.jsonl" | cut -d: -f2 | awk '{ printf "%.1f", 1000 * $1 }')
      MEASURED[$net/$q]="${MEASURED[$net/$q]:-} $ms"
      PREDICTED[$net/$q]="${PREDICTED[$net/$q]:-} $predicted"
      echo "repeat $r $net $q: measured $ms ms/step, predicted $predicted" >&2
    done
  done
done
echo "| network | run | ms/step measured | ms/step predicted | measured / predicted | runs measured; predicted |"
echo "| --- | --- | ---: | ---: | ---: | --- |"
for net in "${NETWORKS[@]}"; do
  for q in plain int8; do
    m=$(echo "${MEASURED[$net/$q]}" | median)
    p=$(echo "${PREDICTED[$net/$q]}" | median)
    name=$([ "$q" = plain ] && echo unquantized || echo int8)
    echo "| $net | $name | $m | $p | $(awk -v a="$m" -v b="$p" 'BEGIN { printf "%.2f", a / b }') |${MEASURED[$net/$q]};${PREDICTED[$net/$q]} |"
  done
done
echo
echo "| network | int8 speed-up measured | predicted |"
echo "| --- | ---: | ---: |"
speedup() { awk -v a="$(echo "$1" | median)" -v b="$(echo "$2" | median)" 'BEGIN { printf "%.2f", a / b }'; }
for net in "${NETWORKS[@]}"; do
  echo "| $net | $(speedup "${MEASURED[$net/plain]}" "${MEASURED[$net/int8]}") | $(speedup "${PREDICTED[$net/plain]}" "${PREDICTED[$net/int8]}") |"
done
