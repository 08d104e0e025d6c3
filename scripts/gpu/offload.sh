#!/bin/bash
# CPU offload on a GPU machine in one call: build and run the offload GPU suites (run_gpu.sh),
# then the offload benchmark's FusedAdamW contenders (step after backward; step in backward on its
# own host thread) against FSDP2's fastest offload setting (offload.md), then the other GPU suites
# and the host AdamW outside training (host_adamw.md), each while DEADLINE_S leaves time for it.
# Every phase has its own limit, so a slow one leaves the earlier results in $OUT; bench/results/gpu
# keeps offload.md and host_adamw.md.
#   scripts/gpu/offload.sh    (env: DEADLINE_S, BUILD_TEST_S, OFFLOAD_S, REST_S, ADAMW_S, REPS)
set -uo pipefail
export OUT=${OUT:-$PWD/out-gpu} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)
phase() { echo "[$(($(date +%s) - start)) s] $*"; }
left() { echo $((${DEADLINE_S:-540} - ($(date +%s) - start))); }
# A phase's limit: its own, or what the deadline leaves, whichever is less.
limit() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
OFFLOAD_SUITES="GpuCpuOffload GpuOffload GpuStepInBackward GpuMixedPrecision"
GPU_ONLY=$OFFLOAD_SUITES GPU_TEST_JOBS=4 timeout "$(limit "${BUILD_TEST_S:-330}")" scripts/gpu/run_gpu.sh --skip-bench
phase "build and offload GPU suites: exit $?"
[ -x build-gpu/bench/gpu_gpt_bench ] || exit 1
timeout "$(limit "${OFFLOAD_S:-170}")" python3 bench/gpu/offload.py --build-dir build-gpu --out "$OUT" --sections offload \
  --reps "${REPS:-2}" --only "FusedAdamW,AdamW(fused)"
phase "offload benchmark: exit $?"
if [ "$(left)" -gt 20 ]; then
  filter="-$(echo "$OFFLOAD_SUITES" | sed 's/\([A-Za-z][A-Za-z]*\)/\1.*/g; s/ /:/g')"
  timeout "$(limit "${REST_S:-300}")" build-gpu/tests/fsdp_gpu_tests --gtest_color=no --gtest_filter="$filter" \
    > "$OUT/gpu_tests_rest.log" 2>&1
  echo "other GPU suites: exit $?"
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED) |Failure|Expected|Which is|actual" "$OUT/gpu_tests_rest.log" | head -60
  phase "other GPU suites done"
fi
if [ "$(left)" -gt 30 ] && [ "${ADAMW_S:-60}" -gt 0 ]; then
  timeout "$(limit "${ADAMW_S:-60}")" python3 bench/gpu/host_adamw.py --build-dir build-gpu --elements 268435456 \
    --tensors 64 --reps 3 | tee "$OUT/host_adamw.md"
  phase "host AdamW: exit $?"
fi
