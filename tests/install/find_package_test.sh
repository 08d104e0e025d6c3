#!/usr/bin/env bash
# Installs libfsdp from a build tree into a temporary prefix, builds the quick start as a separate
# project with find_package(fsdp), and runs it on 2 ranks.
#   find_package_test.sh BUILD_DIR SOURCE_DIR LAUNCHER
set -euo pipefail
BUILD=${1:?build dir}; SRC=${2:?source dir}; LAUNCHER=${3:?fsdp-run}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_install_test.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
cmake --install "$BUILD" --prefix "$TMP/prefix" >/dev/null
mkdir -p "$TMP/consumer"
cat > "$TMP/consumer/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.18)
project(consumer CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(fsdp 0.1 REQUIRED)
add_executable(quickstart "$SRC/examples/quickstart.cpp")
target_link_libraries(quickstart PRIVATE fsdp::fsdp)
CMAKE
cmake -S "$TMP/consumer" -B "$TMP/consumer/build" -DCMAKE_PREFIX_PATH="$TMP/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$TMP/consumer/build" >/dev/null
out=$("$LAUNCHER" --nproc-per-node 2 --master-port $((20000 + RANDOM % 30000)) "$TMP/consumer/build/quickstart" 2>&1) || { echo "$out"; exit 1; }
echo "$out" | tail -3
echo "$out" | grep -q "FSDP memory" || { echo "FAIL: quickstart output incomplete"; exit 1; }
echo "find_package(fsdp) consumer built and ran"
