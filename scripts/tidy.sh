#!/usr/bin/env bash
# clang-tidy with the repository's .clang-tidy over libfsdp's sources (default: every src/**/*.cpp
# that the build compiles), using BUILD_DIR's compile_commands.json.
#   scripts/tidy.sh [FILE...]           BUILD_DIR (default build); -j via JOBS (default 1)
# The build is configured with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON (scripts/setup.sh does). Needs
# Debian's clang-tidy. Exit code: clang-tidy's (non-zero only for errors: checks are warnings).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
command -v clang-tidy >/dev/null || { echo "tidy: clang-tidy is missing (apt-get install clang-tidy)" >&2; exit 77; }
[ -f "$BUILD_DIR/compile_commands.json" ] ||
  { echo "tidy: $BUILD_DIR/compile_commands.json is missing; configure with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON" >&2; exit 1; }
if [ $# -eq 0 ]; then
  # Every source file of the library that this build compiles.
  mapfile -t files < <(sed -nE 's|^ *"file": "(.*/src/.*\.cpp)",?$|\1|p' "$BUILD_DIR/compile_commands.json" | sort -u)
else
  files=("$@")
fi
# The compile commands are GCC's: clang does not know some of its warning flags.
printf '%s\n' "${files[@]}" |
  xargs -P "${JOBS:-1}" -n 1 clang-tidy -p "$BUILD_DIR" --quiet --extra-arg=-Wno-unknown-warning-option
