#!/usr/bin/env bash
# libfsdp as a dependency of a separate CMake project: the quick start, built with nothing but
#   find_package(fsdp 0.1 REQUIRED)  +  target_link_libraries(quickstart PRIVATE fsdp::fsdp)
# twice, and each run on 2 ranks:
#   1. against an install prefix (cmake --install BUILD_DIR --prefix TMP; CMAKE_PREFIX_PATH=TMP):
#      the quick start compiled against the installed headers
#   2. against the build tree (-Dfsdp_DIR=BUILD_DIR: export(EXPORT) wrote fsdpTargets.cmake there):
#      the object compiled in 1, linked through the build tree's package (the headers are the
#      source tree's, which every test compiles against; a second compile would check nothing new)
# Everything the static libfsdp.a needs at link time (LibTorch, Gloo, Threads) must come from the
# package; libfsdp's own warning flags must not reach the consumer (each consumer also compiles a
# one-line source, whose command line shows the flags the package passes on).
#   find_package_test.sh BUILD_DIR SOURCE_DIR LAUNCHER
set -euo pipefail
BUILD=${1:?build dir}; SRC=${2:?source dir}; LAUNCHER=${3:?fsdp-run}
BUILD=$(cd "$BUILD" && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_install_test.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
source "$(dirname "$0")/../harness.sh"  # free_port

mkdir -p "$TMP/consumer"
cat > "$TMP/consumer/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.18)
project(consumer CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(fsdp 0.1 REQUIRED)
message(STATUS "consumer: fsdp from \${fsdp_DIR}")
set(QUICKSTART "$SRC/examples/quickstart.cpp" CACHE FILEPATH "the quick start's source, or its object file")
add_executable(quickstart "\${QUICKSTART}" probe.cpp)
target_link_libraries(quickstart PRIVATE fsdp::fsdp)
CMAKE
echo 'int consumer_probe() { return 0; }' >"$TMP/consumer/probe.cpp"

# consume NAME CMAKE-ARGS...: configures, builds and runs the consumer against one package.
consume() {
  local name=$1; shift
  local dir=$TMP/consumer-build-$name
  echo "== $name"
  # Unoptimized: this checks that the package is found, compiles, links and runs, not its speed.
  cmake -S "$TMP/consumer" -B "$dir" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-DNDEBUG \
    -DCMAKE_EXPORT_COMPILE_COMMANDS=ON "$@" \
    >"$TMP/$name-configure.log" 2>&1 || { cat "$TMP/$name-configure.log"; echo "FAIL: $name: configure"; exit 1; }
  grep "consumer: fsdp from" "$TMP/$name-configure.log"
  cmake --build "$dir" >"$TMP/$name-build.log" 2>&1 || { cat "$TMP/$name-build.log"; echo "FAIL: $name: build"; exit 1; }
  if grep -E -- '-Wextra|-Werror|-fsanitize' "$dir/compile_commands.json" >/dev/null; then
    echo "FAIL: $name: libfsdp's own build flags reached the consumer's compile:"
    grep '"command"' "$dir/compile_commands.json"
    exit 1
  fi
  local out
  out=$("$LAUNCHER" --nproc-per-node 2 --master-port "$(free_port)" "$dir/quickstart" 2>&1) ||
    { echo "$out"; echo "FAIL: $name: the consumer did not run"; exit 1; }
  echo "$out" | tail -2
  echo "$out" | grep -q "FSDP memory" || { echo "FAIL: $name: quickstart output incomplete"; exit 1; }
  echo "$name: find_package(fsdp) consumer built and ran"
}

# 1. An install prefix.
[ -f "$BUILD/fsdpTargets.cmake" ] || { echo "FAIL: $BUILD/fsdpTargets.cmake is missing (export(EXPORT ...))"; exit 1; }
cmake --install "$BUILD" --prefix "$TMP/prefix" >/dev/null
targets=$(find "$TMP/prefix" -name fsdpTargets.cmake)
if grep -q fsdp_warnings "$targets" "$BUILD/fsdpTargets.cmake"; then
  echo "FAIL: the exported targets name fsdp_warnings"; exit 1
fi
consume install-prefix -DCMAKE_PREFIX_PATH="$TMP/prefix"

# 2. The build tree, linking the object compiled in 1.
object=$(find "$TMP/consumer-build-install-prefix/CMakeFiles/quickstart.dir" -name 'quickstart.cpp.o' | head -1)
[ -n "$object" ] || { echo "FAIL: the quick start's object file from the install-prefix build is missing"; exit 1; }
consume build-tree -Dfsdp_DIR="$BUILD" -DQUICKSTART="$object"
