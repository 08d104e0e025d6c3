#!/bin/bash
# The planner's device part in one call on a GPU machine: build and run the GPU tests
# (run_gpu.sh), then bench/gpu/planner.py (calibrate on the device, plan, train, compare), then the
# mixed-precision comparison with FSDP2. Each phase has its own time limit, so a slow one leaves
# the earlier results in $OUT; bench/results/gpu keeps planner.md and offload.md.
#   scripts/gpu/planner.sh            (env: BUILD_TEST_S, PLANNER_S, MP_S, REPS)
set -uo pipefail
export OUT=${OUT:-$PWD/out-gpu} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)
phase() { echo "[$(($(date +%s) - start)) s] $*"; }
timeout "${BUILD_TEST_S:-300}" scripts/gpu/run_gpu.sh --skip-bench
phase "build and GPU tests: exit $?"
[ -x build-gpu/bench/gpu_gpt_bench ] || timeout 120 cmake --build build-gpu -j 16 --target gpu_gpt_bench > "$OUT/bench_build.log" 2>&1
[ -x build-gpu/bench/gpu_gpt_bench ] || { phase "gpu_gpt_bench missing"; exit 1; }
timeout "${PLANNER_S:-150}" python3 bench/gpu/planner.py --build-dir build-gpu --out "$OUT" --reps 1
phase "planner: exit $?"
timeout "${MP_S:-140}" python3 bench/gpu/offload.py --build-dir build-gpu --out "$OUT" --sections mp --reps "${REPS:-1}"
phase "mixed precision: exit $?"
