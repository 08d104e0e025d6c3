#!/bin/bash
# One call on a GPU machine (PyTorch with CUDA and NCCL installed): configure libfsdp against
# PyTorch's bundled LibTorch, build the CUDA targets, run the GPU tests, then the GPU benchmark.
# Everything it produces goes to $OUT (default ./out-gpu): build and test logs, gpu.md, raw-gpu.jsonl.
#   scripts/gpu/run_gpu.sh [--skip-bench] [benchmark flags for bench/gpu/run.py...]
#   (env: GPU_FIRST suites run first, GPU_ONLY only these suites, GPU_TEST_JOBS, GPU_SUITE_S)
set -uo pipefail
OUT=${OUT:-$PWD/out-gpu}; mkdir -p "$OUT"
SKIP_BENCH=0
if [ "${1:-}" = "--skip-bench" ]; then SKIP_BENCH=1; shift; fi
PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
NCCL_ROOT=$(python3 -c 'import nvidia.nccl,os;print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || echo /usr)
GEN=""; command -v ninja >/dev/null && GEN="-G Ninja"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  echo "NCCL_ROOT=$NCCL_ROOT"; } | tee "$OUT/machine.txt"
cmake -S . -B build-gpu $GEN -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIX" -DNCCL_ROOT="$NCCL_ROOT" \
  -DFSDP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DFSDP_UNITY_BUILD=OFF > "$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
grep "libfsdp:" "$OUT/configure.log"
KEEP_GOING=""; [ -n "$GEN" ] && KEEP_GOING="-- -k 0"  # every compile error in one log
time cmake --build build-gpu -j 16 --target fsdp_gpu_tests gpu_gpt_bench fsdp_bench_cpu_adamw $KEEP_GOING > "$OUT/build.log" 2>&1 \
  || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
echo "build ok"
# Each suite runs as its own process under its own limit, GPU_TEST_JOBS at a time (the multi-rank
# tests draw their own ports): the suites never run on a device (GPU_FIRST) start first, and a
# hang costs one suite, not the rest.
export TESTS=./build-gpu/tests/fsdp_gpu_tests OUT GPU_SUITE_S=${GPU_SUITE_S:-300}
run_suite() {  # one suite under its limit, its log appended whole to $OUT/gpu_tests.log when it ends
  local log start; log=$(mktemp); start=$(date +%s)
  timeout "$GPU_SUITE_S" "$TESTS" --gtest_color=no --gtest_filter="$1.*" > "$log" 2>&1
  echo "suite $1: exit $? after $(($(date +%s) - start)) s" | tee -a "$log"
  cat "$log" >> "$OUT/gpu_tests.log"; rm -f "$log"
}
export -f run_suite
SUITES=$({ for s in ${GPU_FIRST:-}; do echo "$s"; done
           "$TESTS" --gtest_list_tests | grep -v '^ ' | sed 's/\.$//'; } | awk '!seen[$0]++')
# GPU_ONLY: run just these suites (the rest can follow in a later call of the test binary).
if [ -n "${GPU_ONLY:-}" ]; then SUITES=$(for s in $GPU_ONLY; do echo "$s"; done); fi
: > "$OUT/gpu_tests.log"
echo "$SUITES" | xargs -P "${GPU_TEST_JOBS:-3}" -I{} bash -c 'run_suite "$1"' _ {}
TEST_RC=0
[ "$(grep -c ': exit 0 after' "$OUT/gpu_tests.log")" = "$(echo "$SUITES" | wc -l)" ] || TEST_RC=1
grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED) |^suite |Failure|error|Expected|Which is|actual" "$OUT/gpu_tests.log" | head -80
echo "gpu tests exit $TEST_RC"
[ "$SKIP_BENCH" = 1 ] && exit $TEST_RC
PYTHONUNBUFFERED=1 python3 bench/gpu/run.py --build-dir build-gpu --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
exit $TEST_RC
