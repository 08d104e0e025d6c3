#!/bin/bash
# CPU offload on a GPU machine in one call: build and run the GPU tests (run_gpu.sh), then the
# offload benchmark's FusedAdamW contenders (step after backward; step in backward on its own host
# thread) against FSDP2's fastest offload setting (offload.md), then the host AdamW outside
# training (host_adamw.md). Each phase has its own time limit, so a slow one leaves the earlier
# results in $OUT; bench/results/gpu keeps offload.md and host_adamw.md.
#   scripts/gpu/offload.sh            (env: BUILD_TEST_S, OFFLOAD_S, ADAMW_S, REPS)
set -uo pipefail
export OUT=${OUT:-$PWD/out-gpu} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)
phase() { echo "[$(($(date +%s) - start)) s] $*"; }
timeout "${BUILD_TEST_S:-360}" scripts/gpu/run_gpu.sh --skip-bench
phase "build and GPU tests: exit $?"
[ -x build-gpu/bench/gpu_gpt_bench ] || exit 1
timeout "${OFFLOAD_S:-150}" python3 bench/gpu/offload.py --build-dir build-gpu --out "$OUT" --sections offload \
  --reps "${REPS:-2}" --only "FusedAdamW,AdamW(fused)"
phase "offload benchmark: exit $?"
timeout "${ADAMW_S:-60}" python3 bench/gpu/host_adamw.py --build-dir build-gpu --elements 268435456 --tensors 64 \
  --reps 3 | tee "$OUT/host_adamw.md"
phase "host AdamW: exit $?"
