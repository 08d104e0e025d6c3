#!/usr/bin/env bash
# The LibTorch 2.6 leg: scripts/test.sh's build and whole test suite, against Debian trixie's
# LibTorch 2.6 (CPU, Gloo) instead of bookworm's 1.13. Sets up the trixie root (scripts/trixie.sh:
# made once by debootstrap and apt, then reused), configures and builds libfsdp inside it into
# build-trixie/ (GCC 14; the root's own ccache), and runs ctest there. Prints each phase's wall
# time. Run as root on a Debian host.
#
#   scripts/test-trixie.sh [--build-only|--test-only] [ctest selection...]   e.g. -R 'ExactTest' or -L gpt
#
#   --build-only  the root and the build only (.ci/run builds at low priority while other tests run)
#   --test-only   ctest only, in a build made before (fails if it is missing)
#
# The build makes the test binary and the targets the selected tests run (scripts/ctest_targets.py),
# not the rest: without a selection, every target.
#
# Environment: FSDP_TRIXIE_ROOT, FSDP_TRIXIE_MIRROR (scripts/trixie.sh), BUILD_DIR (default
# build-trixie), JOBS (compile jobs, default: the number of cores), FSDP_TRIXIE_O1=1 (every target
# at -O1, FSDP_ALL_O1: CI's build, to test and not to time; otherwise the build type's flags).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=all
case ${1:-} in
  --build-only) STEPS=build; shift ;;
  --test-only) STEPS=test; shift ;;
esac
BUILD_DIR=${BUILD_DIR:-build-trixie}
ALL_O1=OFF
[ "${FSDP_TRIXIE_O1:-0}" = 1 ] && ALL_O1=ON
JOBS=${JOBS:-$(nproc)}
if [ "$STEPS" != test ] && ! command -v debootstrap >/dev/null; then
  echo "test-trixie: installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq debootstrap >/dev/null ||
    { apt-get -o DPkg::Lock::Timeout=900 update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq debootstrap >/dev/null; }
fi
phase() {
  local name=$1 start=$SECONDS rc=0
  shift
  echo "==== test-trixie: $name"
  "$@" || rc=$?
  echo "==== test-trixie: $name: $([ "$rc" = 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - start)) s"
  [ "$rc" = 0 ] || exit "$rc"
}
if [ "$STEPS" = test ]; then
  [ -x "$BUILD_DIR/tests/fsdp_tests" ] || { echo "test-trixie: $BUILD_DIR is not built; run scripts/test-trixie.sh --build-only first" >&2; exit 1; }
else
  phase root scripts/trixie.sh setup
  # The code model's query: scripts/ctest_targets.py reads which target makes which file.
  mkdir -p "$BUILD_DIR/.cmake/api/v1/query"
  touch "$BUILD_DIR/.cmake/api/v1/query/codemodel-v2"
  phase configure scripts/trixie.sh run -- sh -c \
    'cmake -S . -B "$1" -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DFSDP_ALL_O1="$2" >/dev/null' \
    sh "$BUILD_DIR" "$ALL_O1"
  targets=()
  if [ $# -gt 0 ]; then
    # Inside the root, whose python3 the packages bring (the host may have none yet).
    mapfile -t targets < <(scripts/trixie.sh run -- sh -c 'dir=$1; shift
      ctest --test-dir "$dir" --show-only=json-v1 "$@" | python3 scripts/ctest_targets.py "$dir" fsdp_tests' sh "$BUILD_DIR" "$@")
    [ ${#targets[@]} -gt 0 ] || { echo "test-trixie: no targets for the selection $*" >&2; exit 1; }
    echo "test-trixie: building what the selection runs: ${targets[*]}"
    targets=(--target "${targets[@]}")
  fi
  phase build scripts/trixie.sh run -- cmake --build "$BUILD_DIR" -j"$JOBS" "${targets[@]}"
fi
[ "$STEPS" != build ] || exit 0
phase ctest scripts/trixie.sh run -- ctest --test-dir "$BUILD_DIR" --output-on-failure -j2 --timeout 900 "$@"
