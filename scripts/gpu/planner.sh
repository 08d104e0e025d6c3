#!/bin/bash
# The planner's device part in one call on a GPU machine: build and run the GPU tests
# (run_gpu.sh), then bench/gpu/planner.py (calibrate on the device, plan, train, compare), then the
# mixed-precision comparison with FSDP2. Each phase has its own time limit and every phase ends by
# DEADLINE_S after the start, so a slow one leaves the earlier results in $OUT; bench/results/gpu
# keeps planner.md and offload.md.
#   scripts/gpu/planner.sh            (env: BUILD_TEST_S, PLANNER_S, MP_S, REPS, DEADLINE_S)
set -uo pipefail
export OUT=${OUT:-$PWD/out-gpu} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)
phase() { echo "[$(($(date +%s) - start)) s] $*"; }
limit() {  # the smaller of a phase's limit and the time left before the deadline
  local left=$((${DEADLINE_S:-590} - ($(date +%s) - start)))
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
timeout "$(limit "${BUILD_TEST_S:-300}")" scripts/gpu/run_gpu.sh --skip-bench
phase "build and GPU tests: exit $?"
[ -x build-gpu/bench/gpu_gpt_bench ] || timeout "$(limit 120)" cmake --build build-gpu -j 16 --target gpu_gpt_bench > "$OUT/bench_build.log" 2>&1
[ -x build-gpu/bench/gpu_gpt_bench ] || { phase "gpu_gpt_bench missing"; exit 1; }
[ "$(limit 60)" -ge 60 ] || { phase "no time left for the planner"; exit 0; }
timeout "$(limit "${PLANNER_S:-150}")" python3 bench/gpu/planner.py --build-dir build-gpu --out "$OUT" --reps 1
phase "planner: exit $?"
[ "$(limit 60)" -ge 60 ] && [ "${MP_S:-140}" -gt 0 ] || { phase "mixed precision skipped"; exit 0; }
timeout "$(limit "${MP_S:-140}")" python3 bench/gpu/offload.py --build-dir build-gpu --out "$OUT" --sections mp --reps "${REPS:-1}"
phase "mixed precision: exit $?"
