#!/bin/bash
# One call on a GPU machine (PyTorch with CUDA and NCCL installed): configure libfsdp against
# PyTorch's bundled LibTorch, build the CUDA targets, run the GPU tests, then the GPU benchmark.
# Everything it produces goes to $OUT (default ./out-gpu): build and test logs, gpu.md, raw-gpu.jsonl.
#   scripts/gpu/run_gpu.sh [--skip-bench] [benchmark flags for bench/gpu/run.py...]
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
./build-gpu/tests/fsdp_gpu_tests --gtest_color=no 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED) |Failure|error|Expected|Which is|actual" | head -60
TEST_RC=${PIPESTATUS[0]}
echo "gpu tests exit $TEST_RC"
[ "$SKIP_BENCH" = 1 ] && exit $TEST_RC
PYTHONUNBUFFERED=1 python3 bench/gpu/run.py --build-dir build-gpu --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
exit $TEST_RC
