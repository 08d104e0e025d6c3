#!/bin/bash
# The GPU tests and the largest-model-with-offload comparison in one call on a GPU machine: build
# and run the GPU tests (run_gpu.sh), then bench/gpu/largest_offload.py under a host-memory cap.
# Each phase has its own time limit; $OUT keeps the logs and largest_offload.md.
#   scripts/gpu/largest.sh   (env: BUILD_TEST_S, LARGEST_S, CAP_GIB, PROBE_LAYERS, PROBE_S)
set -uo pipefail
export OUT=${OUT:-$PWD/out-gpu} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)
phase() { echo "[$(($(date +%s) - start)) s] $*"; }
timeout "${BUILD_TEST_S:-330}" scripts/gpu/run_gpu.sh --skip-bench
phase "build and GPU tests: exit $?"
[ -x build-gpu/bench/gpu_gpt_bench ] || timeout 120 cmake --build build-gpu -j 16 --target gpu_gpt_bench > "$OUT/bench_build.log" 2>&1
phase "gpu_gpt_bench: $([ -x build-gpu/bench/gpu_gpt_bench ] && echo built || echo missing)"
timeout "${LARGEST_S:-220}" python3 bench/gpu/largest_offload.py --build-dir build-gpu --out "$OUT" \
  --cap-gib "${CAP_GIB:-16}" --probe-layers "${PROBE_LAYERS:-4,8}" --timeout-s "${PROBE_S:-60}"
phase "largest model with offload: exit $?"
