#!/usr/bin/env bash
# clang-tidy with the repository's .clang-tidy over libfsdp's library sources (src/, and through
# them the headers of src/ and include/fsdp/), using BUILD_DIR's compile_commands.json; any finding
# is an error (exit 1).
#   scripts/tidy.sh [FILE...]   BUILD_DIR (default build); JOBS parallel runs (default 1)
# Without FILEs it checks what the build compiles for the library: each src/**/*.cpp, or, in a
# unity build (FSDP_UNITY_BUILD, the default), each batch of them, which parses LibTorch's headers
# once per batch instead of once per source. The build is configured with
# -DCMAKE_EXPORT_COMPILE_COMMANDS=ON (scripts/setup.sh does). Needs Debian's clang-tidy.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
command -v clang-tidy >/dev/null || { echo "tidy: clang-tidy is missing (apt-get install clang-tidy)" >&2; exit 77; }
[ -f "$BUILD_DIR/compile_commands.json" ] ||
  { echo "tidy: $BUILD_DIR/compile_commands.json is missing; configure with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON" >&2; exit 1; }
if [ $# -eq 0 ]; then
  mapfile -t files < <(sed -nE 's#^ *"file": "(.*(/src/.*\.cpp|/CMakeFiles/fsdp\.dir/Unity/unity_[0-9]+_cxx\.cxx))",?$#\1#p' \
    "$BUILD_DIR/compile_commands.json" | sort -u)
  [ ${#files[@]} -gt 0 ] || { echo "tidy: no library sources in $BUILD_DIR/compile_commands.json" >&2; exit 1; }
else
  files=("$@")
fi
echo "tidy: ${#files[@]} translation units"
# The compile commands are GCC's: clang does not know some of its warning flags.
printf '%s\n' "${files[@]}" |
  xargs -P "${JOBS:-1}" -n 1 clang-tidy -p "$BUILD_DIR" --quiet --warnings-as-errors='*' \
    --extra-arg=-Wno-unknown-warning-option
echo "tidy: no findings"
