#!/usr/bin/env bash
# Sets up (Debian packages), builds, and runs the whole test suite with ctest.
# --bench: python3-torch and gnuplot-nox too (about 30 MB), so the CI-sized peer benchmark
# (ctest bench.peers_ci) runs its PyTorch DDP contender instead of reporting "skipped".
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --bench build
cd build
ctest --output-on-failure -j2 --timeout 900
