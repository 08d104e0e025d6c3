#!/usr/bin/env bash
# Quantized communication against the same training unquantized (bench/results/quantized.md).
#
#   bench/quantized.sh BUILD_DIR [REPEATS] [EXTRA FLAGS...]
#
# Step time and modeled bytes: the example trainer at world 4 through fsdp-run (block units, one
# thread per rank), 1 sequence of 16 tokens per rank, two GPTs: `narrow` (width 384) and `wide`
# (width 1024, 7x the parameters). FULL_SHARD over
# shared memory without a network model, over Gloo TCP and over the modeled network at 10 Gbit/s
# between ranks (FSDP_NETWORK_MODEL, one rank per modeled host) for both; at 1 Gbit/s for the narrow
# one, also NO_SHARD (its gradient all-reduce quantized); unquantized and with int8 all-gathers and
# reductions. Runs interleaved, REPEATS rounds; medians. Loss (narrow GPT): 500 steps unquantized,
# int8 (blocks of 256, also of 64 and 1024), and int8 with error feedback: validation loss at the
# end and the training-loss curves (bench/results/quantized.png, with gnuplot); after the
# unquantized run, its --quantization-report at block sizes 32 to 4096 (each parameter's error
# through int8 gathers and reductions at the trained weights). Prints the markdown tables.
# With a LibTorch that has float8 (LibTorch 2.6 through scripts/trixie.sh run): FORMAT=fp8 times
# fp8 instead of int8, FP8=1 adds 500-step runs with fp8 all-gathers and reductions.
# REPEATS 0: the loss comparison only; LOSS=0: the step times only; ONLY=NETWORK (shm, tcp, 1gbit,
# 10gbit): the step-time rows of that network only. MASTER_PORT: fsdp-run's port (29500).
set -euo pipefail
# shellcheck source=bench/trainer_runs.sh
source "$(dirname "$0")/trainer_runs.sh"
COMMON=(--layers 4 --context 16 --batch-per-rank 1 --sample-bytes 0)
declare -A SHAPES=([narrow]="--width 384 --heads 6" [wide]="--width 1024 --heads 8")
read -ra narrow <<<"${SHAPES[narrow]}"
MODEL=("${COMMON[@]}" "${narrow[@]}" "${EXTRA[@]}")
QUANT=(--quantize-all-gather int8 --quantize-reduce int8)
# The step times' quantized format (FORMAT=fp8: float8 e4m3, a LibTorch with float8).
FORMAT=${FORMAT:-int8}
STEP_QUANT=(--quantize-all-gather "$FORMAT" --quantize-reduce "$FORMAT")
declare -A NETS=([shm]="FSDP_TRANSPORT=shm" [tcp]="FSDP_TRANSPORT=tcp"
                 [1gbit]="FSDP_NETWORK_MODEL=gbps=0.125,ranks_per_host=1"
                 [10gbit]="FSDP_NETWORK_MODEL=gbps=1.25,ranks_per_host=1")
# Rows: "model strategy network".
ROWS=("narrow FULL_SHARD shm" "narrow FULL_SHARD tcp" "narrow FULL_SHARD 1gbit" "narrow FULL_SHARD 10gbit"
      "narrow NO_SHARD 1gbit" "wide FULL_SHARD shm" "wide FULL_SHARD tcp" "wide FULL_SHARD 10gbit")
if [ -n "${ONLY:-}" ]; then
  KEPT=()
  for row in "${ROWS[@]}"; do [ "${row##* }" = "$ONLY" ] && KEPT+=("$row"); done
  ROWS=("${KEPT[@]}")
fi
declare -A TIMES BYTES
ms_per_step() {  # the mean over the logged windows after the first (warm-up excluded)
  grep -E "^\[rank 0\] step +(16|24)/" | sed -E 's/.*\| +([0-9.]+) ms\/step.*/\1/' | awk '{ s += $1 } END { printf "%.1f", s / NR }'
}
for ((r = 0; r < REPEATS; r++)); do
  for row in "${ROWS[@]}"; do
    read -r shape strategy net <<<"$row"
    read -ra shape_flags <<<"${SHAPES[$shape]}"
    for q in plain int8; do
      flags=(--strategy "$strategy")
      [ "$q" = int8 ] && flags+=("${STEP_QUANT[@]}")
      out=$(env ${NETS[$net]} "$RUN" --master-port "${MASTER_PORT:-29500}" --nproc-per-node 4 "$TRAINER" "${COMMON[@]}" "${shape_flags[@]}" "${EXTRA[@]}" --eval-batches 1 --steps 24 --log-interval 8 \
            "${flags[@]}" 2>&1)
      ms=$(ms_per_step <<<"$out")
      TIMES[$row/$q]="${TIMES[$row/$q]:-} $ms"
      BYTES[$row/$q]=$(grep -oE "all-gathers [0-9.]+ MB, reduce-scatters [0-9.]+ MB, other [0-9.]+ MB" <<<"$out" | head -1 || true)
      echo "repeat $r $row $q: $ms ms/step ${BYTES[$row/$q]}" >&2
    done
  done
done
if ((REPEATS > 0)); then
echo "| model | strategy | network | ms/step unquantized | ms/step $FORMAT | speed-up | runs (unquantized; $FORMAT) | modeled MB per step, rank 0, unquantized | $FORMAT |"
echo "| --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |"
for row in "${ROWS[@]}"; do
  read -r shape strategy net <<<"$row"
  a=$(echo "${TIMES[$row/plain]}" | median)
  b=$(echo "${TIMES[$row/int8]}" | median)
  echo "| $shape | $strategy | $net | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a / b }') | ${TIMES[$row/plain]# }; ${TIMES[$row/int8]# } | ${BYTES[$row/plain]:-n/a} | ${BYTES[$row/int8]:-n/a} |"
done
fi

[ "${LOSS:-1}" = 0 ] && exit 0
# Loss over 500 steps, on shared memory (the arithmetic does not depend on the transport).
DIR=$(mktemp -d)
VAL=()
trap 'rm -rf "$DIR"' EXIT
REPORT_BLOCKS=32,64,128,256,512,1024,4096
# Loss runs: name, then the table's label. FP8=1 (a LibTorch with float8, 2.1 or later) adds the fp8 runs.
RUNS=(plain int8 feedback int8_64 int8_1024)
declare -A LABEL=([plain]="unquantized" [int8]="int8 all-gathers and reduce-scatters, blocks of 256"
                  [feedback]="int8, reductions with error feedback" [int8_64]="int8, blocks of 64"
                  [int8_1024]="int8, blocks of 1024" [fp8]="fp8 (e4m3) all-gathers and reduce-scatters, blocks of 256"
                  [fp8_int8]="fp8 all-gathers, int8 reduce-scatters"
                  [fp8_feedback]="fp8, reductions with error feedback")
[ "${FP8:-0}" = 1 ] && RUNS+=(fp8 fp8_int8 fp8_feedback)
FP8_QUANT=(--quantize-all-gather fp8 --quantize-reduce fp8)
for q in "${RUNS[@]}"; do
  case $q in
    plain) flags=(--quantization-report "$REPORT_BLOCKS") ;;
    int8) flags=("${QUANT[@]}") ;;
    feedback) flags=("${QUANT[@]}" --quantize-error-feedback) ;;
    int8_64) flags=("${QUANT[@]}" --quantize-block 64) ;;
    int8_1024) flags=("${QUANT[@]}" --quantize-block 1024) ;;
    fp8) flags=("${FP8_QUANT[@]}") ;;
    fp8_int8) flags=(--quantize-all-gather fp8 --quantize-reduce int8) ;;
    fp8_feedback) flags=("${FP8_QUANT[@]}" --quantize-error-feedback) ;;
  esac
  out=$("$RUN" --master-port "${MASTER_PORT:-29500}" --nproc-per-node 4 "$TRAINER" "${MODEL[@]}" --eval-batches 8 --steps 500 --log-interval 10 \
        --metrics-file "$DIR/$q.jsonl" "${flags[@]}" 2>&1)
  VAL[${#VAL[@]}]=$(grep -oE "validation loss after training: [0-9.]+" <<<"$out" | grep -oE "[0-9.]+$")
  echo "loss $q: ${VAL[-1]}" >&2
  [ "$q" = plain ] && REPORT=$(sed -n 's/^\[rank 0\] //p' <<<"$out" | sed -n '/^quantization error, /,$p')
  /usr/bin/python3 -c 'import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    print(m["step"], m["loss"])' "$DIR/$q.jsonl" >"$DIR/$q.dat"
done
echo
echo "| run | validation loss after 500 steps | relative to unquantized |"
echo "| --- | ---: | ---: |"
for i in "${!RUNS[@]}"; do
  echo "| ${LABEL[${RUNS[$i]}]} | ${VAL[$i]} | $(awk -v a="${VAL[$i]}" -v b="${VAL[0]}" 'BEGIN { printf "%.4f", a / b }') |"
done
echo
echo "$REPORT"
if command -v gnuplot >/dev/null; then
  if [ "${FP8:-0}" = 1 ]; then  # another LibTorch's runs: a plot of their own
    png=quantized_fp8.png
    curves="\"$DIR/int8.dat\" using 1:2 with lines title \"int8 all-gathers and reduce-scatters\", \"$DIR/fp8.dat\" using 1:2 with lines title \"fp8 all-gathers and reduce-scatters\""
  else
    png=quantized.png
    curves="\"$DIR/int8.dat\" using 1:2 with lines title \"int8 all-gathers and reduce-scatters\", \"$DIR/feedback.dat\" using 1:2 with lines title \"int8, error feedback\""
  fi
  gnuplot <<EOF
set terminal pngcairo size 800,450 noenhanced
set output "$(dirname "$0")/results/$png"
set xlabel "step"; set ylabel "training loss (rank mean)"
set title "Example GPT, world 4, FULL_SHARD: unquantized and quantized communication"
plot "$DIR/plain.dat" using 1:2 with lines title "unquantized", $curves
EOF
fi
