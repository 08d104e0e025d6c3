# Shared part of the script tests of the examples (fsdp_gpt_test.sh, quickstart_plan_test.sh, ...); sourced
# with the script's arguments: PATH/TO/PROGRAM PATH/TO/fsdp-run [CASE...]. It sets TRAINER (the program),
# LAUNCHER, TMP and PORT, the output helpers, and run_cases, which runs the named test_<name>
# functions (all without names) and exits 0 = pass, 1 = fail, 77 = every case skipped.
USAGE="usage: $(basename "$0") PATH/TO/fsdp_gpt PATH/TO/fsdp-run [CASE...]"
TRAINER=${1:?$USAGE}
LAUNCHER=${2:?$USAGE}
shift 2
TMP=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_gpt_test.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# Ranks must not inherit a launcher environment from whoever runs the tests.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT GROUP_RANK NODE_RANK
unset OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_LOCAL_SIZE
unset SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_NTASKS_PER_NODE SLURM_STEP_TASKS_PER_NODE SLURM_NODEID

# One thread per rank (fsdp-run keeps it): the model is too small for more, and CI machines are
# shared; two OpenMP threads per rank on a loaded 2-core machine run many times slower.
export OMP_NUM_THREADS=1

# shellcheck source=../harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/../harness.sh"

PORT=$(free_port)

# Runs a command with stdout/stderr to $TMP/out and $TMP/err; sets RC.
run() {
  "$@" >"$TMP/out" 2>"$TMP/err"
  RC=$?
}

expect_rc() { [ "$RC" -eq "$1" ] || fail "expected exit code $1, got $RC"; }
expect_failure() { [ "$RC" -ne 0 ] || fail "expected a non-zero exit code, got 0"; }
expect_text() { grep -qF -- "$2" "$TMP/$1" || fail "no '$2' in $1"; }
expect_regex() { grep -qE -- "$2" "$TMP/$1" || fail "no line matching '$2' in $1"; }

# x < y for decimal numbers.
less_than() { awk -v x="$1" -v y="$2" 'BEGIN { exit !(x + 0 < y + 0) }'; }

# run_cases [CASE...]: runs each case in a subshell.
run_cases() {
  if [ $# -eq 0 ]; then
    set -- $(declare -F | sed -n 's/^declare -f test_//p')
  fi
  skipped=0
  for case_name in "$@"; do
    declare -F "test_$case_name" >/dev/null || { echo "no such case: $case_name" >&2; exit 2; }
    ("test_$case_name")
    rc=$?
    if [ "$rc" -eq 77 ]; then
      skipped=$((skipped + 1))
    elif [ "$rc" -ne 0 ]; then
      exit "$rc"
    fi
  done
  [ "$skipped" -eq $# ] && exit 77
  echo "PASS"
}
