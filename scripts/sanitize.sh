#!/usr/bin/env bash
# Sanitizer jobs: builds libfsdp and its tests with sanitizers in their own build directories and
# runs the tests that exercise libfsdp's own concurrency and memory handling.
#
#   scripts/sanitize.sh [--build-only|--test-only] [asan|tsan]...   (default: both, asan first)
#
#   --build-only  configure and build only (.ci/run builds at idle priority while other tests run)
#   --test-only   run the tests of a build made before (fails if it is missing)
#
#   asan  build-asan, FSDP_SANITIZE=address,undefined (ASan + LeakSanitizer + UBSan): the exactness
#         tests over shared memory (the runtime hands both transports the same buffers; what Gloo
#         TCP does with them, the communicator tests check), overlap and trace order (every prefetch
#         mode's exactness, the order of one: the rate limiter's), communicators
#         (Gloo TCP and shared memory), the network model, the model zoo, and the fault tests that
#         fit its time (desync, ranks stopped, start-up failures, and ranks killed at random
#         moments: four of the eight seeds, which draw worlds 3 and 4 and both transports)
#   tsan  build-tsan, FSDP_SANITIZE=thread: the communicators, the overlap tests (as for asan), and
#         the desync, diverged-collective, killed-at-random (the same four seeds) and start-up fault tests
#
# LibTorch (and Gloo, OpenMP, libstdc++) are not instrumented; what they report on their own is
# suppressed in tools/sanitizers/*.supp, each entry with its reason. The options reach the rank
# processes that the multi-rank tests start through the environment. ASan, LeakSanitizer and TSan
# reports go to files (log_path) in <build>/sanitizer-logs, from the test processes and the ranks
# alike; UBSan's go to stderr and stop the process. The job fails if any test failed or any
# report file was written, and prints the reports.
#
# Needs what scripts/setup.sh installs (CI runs scripts/test.sh first; GCC's sanitizer runtimes
# come with g++).
# Environment: JOBS (parallel ctest jobs and compile jobs, default 2), ASAN_TESTS / TSAN_TESTS
# (ctest -R regular expressions replacing the default selections below), FSDP_TEST_SOURCES (the
# test files to build, as tests/CMakeLists.txt names them; ';'-separated; must hold the selections).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SUPP=$ROOT/tools/sanitizers
JOBS=${JOBS:-2}

# ctest names are gtest's: [Instantiation/]Suite.Test[/Param]
ASAN_TESTS=${ASAN_TESTS:-'ExactTest\.|EmbeddingMaxNorm\.|ModuleZeroGrad\.|StepInBackward\.|OverlapExact\.|^TraceOrder\.|TraceOrder\.ShowsThePromisedOrdering/limit1|TransportTest\.|SharedMemory\.|MemberGoneTest\.|ZooTest\.|NetworkModel|DesyncTest\.|InStepTest\.EveryRankFinishesWithStatusZero/FULL_SHARD_accumulate_no_sync|KilledAtRandomTest\.EverySurvivorFailsWithinSeconds/[1-4]$|StoppedInStepTest\.|^Startup\.|FrozenParameters\.ParametersFrozen|ParameterGradients\.Autograd|PlannerTrace\.'}
TSAN_TESTS=${TSAN_TESTS:-'StepInBackward\.|EmbeddingMaxNorm\.|ModuleZeroGrad\.|TransportTest\.|SharedMemory\.|MemberGoneTest\.|OverlapExact\.|^TraceOrder\.|TraceOrder\.ShowsThePromisedOrdering/limit1|DesyncTest\.|DivergedTest\.|InStepTest\.EveryRankFinishesWithStatusZero/FULL_SHARD_accumulate_no_sync|KilledAtRandomTest\.EverySurvivorFailsWithinSeconds/[1-4]$|KilledHoldingConnectionsTest\.|^DeadMembers\.|^Startup\.|FrozenParameters\.ParametersFrozen|ParameterGradients\.Autograd'}
# Tests that also bound their own wall time (fail-fast within 15 or 30 s of launching the ranks,
# a shared-memory step faster than a modeled 0.13 s): under a sanitizer, rank start-up alone
# (loading LibTorch under ASan/TSan interceptors) can take most of that on 2 busy cores. They still
# run, and their sanitizer reports still fail the job, but a failure on their own timing does not.
ASAN_TIMING_BOUND='NetworkModel\.IntraAndInterHostLinksFromOptions|NetworkModel\.CompletesNoEarlierThanModeled|SharedMemory\.DivergedRanksFailFast|MemberGoneTest\.|DesyncTest\.|KilledAtRandomTest\.|StoppedInStepTest\.|^Startup\.'
TSAN_TIMING_BOUND='SharedMemory\.DivergedRanksFailFast|MemberGoneTest\.|DesyncTest\.|DivergedTest\.|KilledAtRandomTest\.|KilledHoldingConnectionsTest\.|^Startup\.'

# Ranks run one OpenMP thread (the test harness sets it for them too): LibTorch's OpenMP runtime
# (libgomp) is not instrumented, and TSan cannot see its barriers.
export OMP_NUM_THREADS=1

# The test sources that hold each selection above and the workers its tests launch (OverlapExact runs
# fully_shard_exact_test.cpp's exact_worker); each build's fsdp_tests is built from these only.
ASAN_SOURCES='fully_shard_exact_test.cpp;step_in_backward_test.cpp;runtime/overlap_test.cpp;comm/communicator_test.cpp;comm/network_model_test.cpp;model_zoo_test.cpp;faults/desync_test.cpp;faults/dead_rank_test.cpp;faults/fault_in_step.cpp;faults/stopped_rank_test.cpp;faults/startup_test.cpp;embedding_max_norm_test.cpp;module_zero_grad_test.cpp;failed_backward_test.cpp;frozen_parameters_test.cpp;parameter_gradients_test.cpp;planner_trace_test.cpp'
TSAN_SOURCES='fully_shard_exact_test.cpp;step_in_backward_test.cpp;runtime/overlap_test.cpp;comm/communicator_test.cpp;faults/desync_test.cpp;faults/dead_rank_test.cpp;faults/fault_in_step.cpp;faults/startup_test.cpp;embedding_max_norm_test.cpp;module_zero_grad_test.cpp;failed_backward_test.cpp;frozen_parameters_test.cpp;parameter_gradients_test.cpp'

# Configures and builds fsdp_tests in $2 with FSDP_SANITIZE=$1, from the test sources $3.
build() {
  local sanitize=$1 dir=$2 sources=$3 opt=-O1 tests_o1=ON
  # ASan + UBSan at -O0, the test sources too: the selected tests spend their time in LibTorch (not
  # instrumented) and in the ranks' start-up, so optimizing our code does not shorten them, and -O1
  # costs a third more compile. TSan stays at -O1: at -O0 it instruments every spilled local and
  # compiles slower (bench/results/build.md). -g1: line tables for the reports' stacks at a fraction
  # of -g's compile time. Test batches of 6: each selection's files (and the harness) in two
  # translation units, one per core.
  [ "$sanitize" = thread ] || { opt=-O0; tests_o1=OFF; }
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$opt -g1 -DNDEBUG" \
    -DFSDP_TESTS_O1="$tests_o1" -DFSDP_SANITIZE="$sanitize" -DFSDP_TESTS_UNITY_BATCH=6 -DFSDP_BUILD_TESTS=ON -DFSDP_BUILD_EXAMPLES=OFF -DFSDP_BUILD_BENCHMARKS=OFF \
    -DFSDP_TEST_SOURCES="${FSDP_TEST_SOURCES:-$sources}" >/dev/null || return 1
  cmake --build "$dir" -j"$JOBS" --target fsdp_tests
}

# Runs the ctest selection $2 in build dir $1, except the timing-bound tests $3, which run after
# them in a pass of their own (see TIMING_BOUND). Fails on a failed test of the first pass, and on
# any report file of either.
run_tests() {
  local dir=$1 regex=$2 timing=$3 logs=$1/sanitizer-logs rc=0
  rm -rf "$logs"
  mkdir -p "$logs"
  (cd "$dir" && ctest -R "$regex" -E "$timing" -j"$JOBS" --output-on-failure --timeout 1200) || rc=$?
  # The selected tests that are timing-bound, as one regular expression of exact names.
  local names
  names=$(cd "$dir" && ctest -N -R "$regex" | sed -nE 's/^ *Test +#[0-9]+: (.*)$/\1/p' | grep -E "$timing" |
    sed 's/[]\\.*^$()+?{}|[]/\\&/g' | paste -sd '|' || true)
  if [ -n "$names" ]; then
    echo "== timing-bound tests (failures on their wall-clock bounds are not counted here):"
    local out=$dir/timing-bound.log
    if (cd "$dir" && ctest -R "^($names)\$" -j"$JOBS" --output-on-failure --timeout 1200) >"$out" 2>&1; then
      tail -n 3 "$out"
    else
      grep -E '^ *[0-9]+/[0-9]+ Test|Expected: \(seconds\)|check failed' "$out" || true
      if grep -qE 'runtime error:|Sanitizer' "$out"; then
        echo "a sanitizer reported in the timing-bound tests:"
        cat "$out"
        rc=1
      fi
    fi
  fi
  local reports
  reports=$(find "$logs" -type f -size +0 | sort)
  if [ -n "$reports" ]; then
    echo "== sanitizer reports ($(echo "$reports" | wc -l) files in $logs):"
    for f in $reports; do
      echo "---- $f"
      cat "$f"
    done
    rc=1
  fi
  return "$rc"
}

STEPS=all
case ${1:-} in
  --build-only) STEPS=build; shift ;;
  --test-only) STEPS=test; shift ;;
esac

# Builds $2 with FSDP_SANITIZE=$1 from the test sources $5 and/or runs its tests (selection $3,
# timing-bound $4), as STEPS says.
job() {
  local sanitize=$1 dir=$2 tests=$3 timing=$4 sources=$5 name=${1%%,*} start=$SECONDS rc=0
  [ "$name" = address ] && name=asan || name=tsan
  if [ "$STEPS" != test ]; then
    # (set -e does not apply here: the job runs as an `if` condition)
    build "$sanitize" "$dir" "$sources" || { echo "sanitize: $name build FAILED" >&2; return 1; }
    echo "sanitize: $name build $((SECONDS - start)) s"
  elif [ ! -x "$dir/tests/fsdp_tests" ]; then
    echo "sanitize: $dir/tests/fsdp_tests is missing; build it first (scripts/sanitize.sh --build-only $name)" >&2
    return 1
  fi
  [ "$STEPS" != build ] || return 0
  start=$SECONDS
  run_tests "$dir" "$tests" "$timing" || rc=$?
  echo "sanitize: $name tests $((SECONDS - start)) s"
  return "$rc"
}

asan() {
  local dir=build-asan logs
  logs=$ROOT/$dir/sanitizer-logs
  # Only where ASan itself needs it; everything else is at its default (halt on the first error).
  export ASAN_OPTIONS="log_path=$logs/asan:suppressions=$SUPP/asan.supp:detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1"
  export LSAN_OPTIONS="suppressions=$SUPP/lsan.supp:print_suppressions=0"
  # UBSan (GCC 12's, inside the ASan runtime) prints its reports to stderr whatever log_path says;
  # halt_on_error makes the process exit 1 there, so the test fails and ctest shows the report
  # (the harness prints each rank's output when a rank fails).
  export UBSAN_OPTIONS="suppressions=$SUPP/ubsan.supp:print_stacktrace=1:halt_on_error=1"
  mkdir -p "$logs"
  local rc=0
  job address,undefined "$dir" "$ASAN_TESTS" "$ASAN_TIMING_BOUND" "$ASAN_SOURCES" || rc=$?
  unset ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS
  return "$rc"
}

tsan() {
  local dir=build-tsan logs
  logs=$ROOT/$dir/sanitizer-logs
  # Uninstrumented libraries (LibTorch, Gloo) still synchronize through intercepted pthread calls,
  # which TSan sees; what they report on their own is suppressed by library (called_from_lib).
  export TSAN_OPTIONS="log_path=$logs/tsan:suppressions=$SUPP/tsan.supp:second_deadlock_stack=1:history_size=4"
  mkdir -p "$logs"
  local rc=0
  job thread "$dir" "$TSAN_TESTS" "$TSAN_TIMING_BOUND" "$TSAN_SOURCES" || rc=$?
  unset TSAN_OPTIONS
  return "$rc"
}

[ $# -gt 0 ] || set -- asan tsan
status=0
for job in "$@"; do
  case $job in
    asan | tsan)
      echo "== sanitize: $job"
      if "$job"; then echo "sanitize: $job passed"; else echo "sanitize: $job FAILED"; status=1; fi ;;
    *) echo "usage: scripts/sanitize.sh [--build-only|--test-only] [asan|tsan]..." >&2; exit 2 ;;
  esac
done
exit "$status"
