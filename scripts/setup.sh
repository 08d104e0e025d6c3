#!/usr/bin/env bash
# Installs everything libfsdp needs on a fresh Debian bookworm machine (run as root) and builds it.
# Usage: scripts/setup.sh [--bench] [build-dir]   (default: build)
#   --bench  also installs what the peer benchmark (bench/peers/run.py) needs beyond the build:
#            python3-torch (PyTorch 1.13 for the DDP baseline, ~30 MB of packages) and gnuplot-nox
#            (its plots). scripts/test.sh passes it so CI runs the benchmark's CI-sized variant.
# FSDP_CMAKE_ARGS: further arguments for the configure step (CI: -DFSDP_WERROR=ON).
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=0
if [ "${1:-}" = "--bench" ]; then
  BENCH=1
  shift
fi
BUILD_DIR=${1:-build}
PKGS=(
  cmake g++ make pkg-config
  ccache                            # CMake compiles through it when found (a warm cache: CI's rebuild in minutes)
  libtorch-dev libgloo-dev          # LibTorch 1.13 (CPU, c10d) and the Gloo headers/library it uses
  libopenblas0-pthread              # optimized BLAS: Debian's reference BLAS is ~30x slower on matmul
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev
  fortunes-min fortunes             # real English text for the example trainer
  iproute2 procps
)
if [ "$BENCH" = 1 ]; then
  PKGS+=(python3-torch gnuplot-nox)
fi
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# compile_commands.json: for scripts/tidy.sh (clang-tidy) and editors.
# shellcheck disable=SC2086  # FSDP_CMAKE_ARGS holds several arguments
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON ${FSDP_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)"
