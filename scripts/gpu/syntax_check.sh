#!/usr/bin/env bash
# Compile-checks the CUDA path on a machine without a GPU, so that a GPU lease is spent running,
# not fixing compile errors: every source that FSDP_WITH_CUDA changes, the GPU tests and the GPU
# benchmark, with -fsyntax-only, against Debian trixie's LibTorch 2.6 headers (scripts/trixie.sh)
# and a CUDA toolkit's headers (nccl.h among them). No object is built and nothing is linked.
#
#   scripts/gpu/syntax_check.sh [CUDA_INCLUDE_DIR]    default: the newest /usr/local/cuda-*/include
#
# Left out: src/device_memory.cpp, which names the caching allocator's statistics as LibTorch 2.7
# and later do (2.6 has them under another namespace).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd -P)
CUDA_INCLUDE=${1:-$(ls -d /usr/local/cuda-*/include 2>/dev/null | sort -V | tail -1)}
[ -n "$CUDA_INCLUDE" ] && [ -f "$CUDA_INCLUDE/cuda_runtime_api.h" ] && [ -f "$CUDA_INCLUDE/nccl.h" ] || {
  echo "syntax_check: no CUDA headers with nccl.h; name their folder: scripts/gpu/syntax_check.sh DIR" >&2
  exit 2
}
ROOT=${FSDP_TRIXIE_ROOT:-/var/cache/libfsdp/trixie-root}
"$SRC/scripts/trixie.sh" setup
# The headers go into the root's /tmp for the check; LibTorch's CUDA build generates
# c10/cuda/impl/cuda_cmake_macros.h, which its CPU build does not ship.
STAGE=$(mktemp -d "$ROOT/tmp/syntax-check.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
cp -r "$CUDA_INCLUDE" "$STAGE/cuda"
mkdir -p "$STAGE/stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$STAGE/stub/c10/cuda/impl/cuda_cmake_macros.h"
INSIDE=${STAGE#"$ROOT"}
cd "$SRC"
FILES=(src/comm/nccl_communicator.cpp src/comm/host_staged_communicator.cpp src/cpu_offload.cpp
  src/process_group.cpp src/communicator_factory.cpp tests/gpu/*.cpp bench/gpu/*.cpp)
"$SRC/scripts/trixie.sh" run -- bash -c '
  flags=(-std=gnu++17 -fsyntax-only -Wall -Wextra -Wno-unused-parameter -DFSDP_WITH_CUDA -DFSDP_WITH_NCCL
         -DUSE_DISTRIBUTED -I include -I src -I tests -I examples/gpt -I bench -I .
         -isystem "$0/stub" -isystem /usr/include/torch/csrc/api/include -isystem "$0/cuda")
  failed=0
  for f in "$@"; do
    if out=$(g++ "${flags[@]}" "$f" 2>&1) && [ -z "$out" ]; then echo "ok      $f"
    else echo "FAILED  $f"; echo "$out" | grep -E "error|warning" | head -20; failed=1; fi
  done
  exit $failed' "$INSIDE" "${FILES[@]}"
