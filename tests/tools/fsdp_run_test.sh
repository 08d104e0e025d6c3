#!/usr/bin/env bash
# Tests for the fsdp-run launcher.
#
#   fsdp_run_test.sh PATH/TO/fsdp-run [CASE...]
#
# Each test_<name> function is one case; with no CASE, all run. CMake registers
# every test_<name> as the ctest test launcher.<name>. Exit 0 = pass, 77 = skipped.
# The ranks' shell snippets are single-quoted on purpose: they expand in the rank.
# shellcheck disable=SC2016
set -u

LAUNCHER=${1:?usage: fsdp_run_test.sh PATH/TO/fsdp-run [CASE...]}
shift
TMP=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_run_test.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# shellcheck source=../harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/../harness.sh"

# Microseconds since the epoch (bash >= 5).
now_us() { echo "${EPOCHREALTIME/./}"; }

# Runs the launcher with the given arguments; sets RC and ELAPSED_US.
launch() {
  local start
  start=$(now_us)
  "$LAUNCHER" "$@" >"$TMP/out" 2>"$TMP/err"
  RC=$?
  ELAPSED_US=$(($(now_us) - start))
}

expect_rc() { [ "$RC" -eq "$1" ] || fail "expected exit code $1, got $RC"; }
expect_line() { grep -qxF -- "$2" "$TMP/$1" || fail "no line '$2' in $1"; }
expect_text() { grep -qF -- "$2" "$TMP/$1" || fail "no '$2' in $1"; }
expect_faster_than() {
  [ "$ELAPSED_US" -lt $(($1 * 1000000)) ] || fail "took $((ELAPSED_US / 1000)) ms, expected < $1 s"
}

# A sleep whose command line is unique to this run, so pgrep finds exactly the
# processes this test started.
MARKER="6$$.$RANDOM"

# Fails if any process running `sleep $MARKER` is still alive. Processes that
# were just killed may need a moment to disappear, hence the short retry.
expect_no_marker_processes() {
  for _ in $(seq 20); do
    pgrep -f "sleep $MARKER" >/dev/null || return 0
    sleep 0.1
  done
  fail "processes left behind: $(pgrep -af "sleep $MARKER")"
}

test_env() {
  launch --nproc-per-node 3 sh -c \
    'echo "r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK lw=$LOCAL_WORLD_SIZE m=$MASTER_ADDR:$MASTER_PORT g=$GROUP_RANK n=$NODE_RANK"'
  expect_rc 0
  for r in 0 1 2; do
    expect_line out "[rank $r] r=$r w=3 l=$r lw=3 m=127.0.0.1:29500 g=0 n=0"
  done
  [ "$(wc -l <"$TMP/out")" -eq 3 ] || fail "expected exactly 3 lines"
}

test_multinode_env() {
  launch --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 10.1.2.3 --master-port 1234 \
    sh -c 'echo "r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK lw=$LOCAL_WORLD_SIZE g=$GROUP_RANK n=$NODE_RANK m=$MASTER_ADDR:$MASTER_PORT"'
  expect_rc 0
  expect_line out "[rank 2] r=2 w=4 l=0 lw=2 g=1 n=1 m=10.1.2.3:1234"
  expect_line out "[rank 3] r=3 w=4 l=1 lw=2 g=1 n=1 m=10.1.2.3:1234"
}

test_job_token() {
  # One node: a fresh random token per job, the same for all its ranks; an inherited one is kept.
  launch --nproc-per-node 2 sh -c 'echo "token=$FSDP_JOB_TOKEN"'
  expect_rc 0
  local first
  first=$(sed -n 's/^\[rank 0\] token=//p' "$TMP/out")
  [[ "$first" =~ ^[0-9a-f]{64}$ ]] || fail "expected 64 hex digits, got '$first'"
  expect_line out "[rank 1] token=$first"
  launch --nproc-per-node 1 sh -c 'echo "token=$FSDP_JOB_TOKEN"'
  grep -qxF "[rank 0] token=$first" "$TMP/out" && fail "two jobs got the same token"
  FSDP_JOB_TOKEN=given-by-the-user-0123 launch --nproc-per-node 1 sh -c 'echo "token=$FSDP_JOB_TOKEN"'
  expect_line out "[rank 0] token=given-by-the-user-0123"
  # Several nodes must share the user's token: fsdp-run makes none.
  FSDP_JOB_TOKEN= launch --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 10.1.2.3 \
    sh -c 'echo "token=${FSDP_JOB_TOKEN:-unset}"'
  expect_line out "[rank 1] token=unset"
}

test_program_flags_not_parsed() {
  # Flags after PROGRAM belong to the program, even ones the launcher knows.
  launch --nproc-per-node 1 sh -c 'echo "args: $*"' prog --nproc-per-node 7 --help
  expect_rc 0
  expect_line out "[rank 0] args: --nproc-per-node 7 --help"
}

test_omp_threads() {
  launch --nproc-per-node 2 --threads-per-rank 3 sh -c 'echo "omp=$OMP_NUM_THREADS"'
  expect_rc 0
  expect_line out "[rank 1] omp=3"
  # An inherited value is kept...
  OMP_NUM_THREADS=5 launch --nproc-per-node 2 sh -c 'echo "omp=$OMP_NUM_THREADS"'
  expect_line out "[rank 0] omp=5"
  # ...otherwise the cores are split between the ranks, at least 1 each.
  (unset OMP_NUM_THREADS; launch --nproc-per-node 64 sh -c 'echo "omp=$OMP_NUM_THREADS"'
   expect_line out "[rank 63] omp=1") || exit 1
  # (GNU nproc itself honours OMP_NUM_THREADS and OMP_THREAD_LIMIT.)
  (unset OMP_NUM_THREADS OMP_THREAD_LIMIT; launch --nproc-per-node 1 sh -c 'echo "omp=$OMP_NUM_THREADS"'
   expect_line out "[rank 0] omp=$(nproc)") || exit 1
}

test_output_forwarding() {
  # stderr stays stderr; a last line without '\n' is still shown; '\r' pieces
  # (progress bars) are forwarded with the prefix at their start.
  launch --nproc-per-node 2 sh -c \
    'echo "to out $RANK"; echo "to err $RANK" >&2
     if [ "$RANK" = 0 ]; then printf "bar 1\rbar 2\r"; sleep 0.2; echo; else printf "tail"; fi'
  expect_rc 0
  expect_line out "[rank 0] to out 0"
  expect_line err "[rank 1] to err 1"
  expect_line out "[rank 1] tail"
  expect_line out "$(printf '[rank 0] bar 1\r[rank 0] bar 2\r')"
  ! grep -q "to err" "$TMP/out" || fail "stderr leaked into stdout"

  launch --no-prefix sh -c 'echo plain'
  expect_rc 0
  expect_line out "plain"
}

test_lines_never_interleave() {
  # Many long lines from several ranks at once: each must arrive whole.
  launch --nproc-per-node 4 sh -c \
    'line=$(printf "%03000d" 0 | tr 0 "$RANK"); i=0; while [ $i -lt 300 ]; do echo "$line"; i=$((i+1)); done'
  expect_rc 0
  [ "$(wc -l <"$TMP/out")" -eq 1200 ] || fail "expected 1200 lines, got $(wc -l <"$TMP/out")"
  # A whole line is "[rank D] " followed by 3000 copies of the digit D.
  bad=$(awk '{ d = substr($0, 7, 1); rest = substr($0, 10); gsub(d, "", rest)
               if (substr($0, 1, 9) != "[rank " d "] " || rest != "" || length($0) != 3009) bad++ }
             END { print bad + 0 }' "$TMP/out")
  [ "$bad" -eq 0 ] || fail "$bad lines were mixed up"
}

test_failure_stops_others() {
  launch --nproc-per-node 4 sh -c \
    "if [ \"\$RANK\" = 1 ]; then sleep 0.3; echo 'rank 1 gives up' >&2; exit 3; fi; sleep $MARKER"
  expect_rc 3
  expect_faster_than 10
  expect_text err "rank 1 gives up"
  expect_text err "fsdp-run: rank 1 (pid "
  expect_text err ") exited with code 3; stopping the other 3 ranks"
  expect_no_marker_processes
}

test_rank_killed_by_signal() {
  launch --nproc-per-node 3 sh -c \
    "if [ \"\$RANK\" = 2 ]; then sleep 0.3; kill -9 \$\$; fi; sleep $MARKER"
  expect_rc 137
  expect_faster_than 10
  expect_text err "rank 2 (pid "
  expect_text err "killed by signal 9"
  expect_no_marker_processes
}

test_sigkill_after_grace() {
  # Ranks that ignore SIGTERM are killed once the grace period is over.
  launch --nproc-per-node 3 --grace-seconds 1 sh -c \
    "if [ \"\$RANK\" = 0 ]; then sleep 0.3; exit 5; fi; trap '' TERM; sleep $MARKER"
  expect_rc 5
  expect_faster_than 6
  expect_text err "killing 2 ranks still running after 1 s"
  expect_no_marker_processes
}

test_grandchildren_stopped() {
  # What a rank started in the background dies with it, and its open copy of
  # the output pipe does not keep the launcher waiting.
  launch --nproc-per-node 2 --grace-seconds 1 sh -c "sleep $MARKER & echo started"
  expect_rc 0
  expect_faster_than 5
  expect_line out "[rank 1] started"
  expect_no_marker_processes
}

# Sends `signal` to a launcher whose ranks are sleeping; expects `code`.
check_launcher_signal() {
  local signal=$1 code=$2
  local start
  start=$(now_us)
  "$LAUNCHER" --nproc-per-node 3 sh -c "echo up; sleep $MARKER" >"$TMP/out" 2>"$TMP/err" &
  local pid=$!
  # Wait until all ranks are up, so the signal hits a running job.
  for _ in $(seq 100); do
    [ "$(grep -c up "$TMP/out")" -eq 3 ] && break
    sleep 0.05
  done
  kill "-$signal" "$pid"
  wait "$pid"
  RC=$?
  ELAPSED_US=$(($(now_us) - start))
  expect_rc "$code"
  expect_faster_than 10
  expect_text err "received SIG$signal; stopping 3 ranks"
  expect_no_marker_processes
}

test_sigint() { check_launcher_signal INT 130; }
test_sigterm() { check_launcher_signal TERM 143; }

# --max-restarts with an elastic range: a rank killed by a signal is given up, the rest restart
# with FSDP_RESTART_COUNT set; a failure with no restart left, or below MIN, ends the job.
test_elastic_restart() {
  launch --nproc-per-node 2:3 --max-restarts 2 sh -c \
    'echo "start $FSDP_RESTART_COUNT rank $RANK of $WORLD_SIZE"; if [ "$FSDP_RESTART_COUNT" = 0 ] && [ "$RANK" = 2 ]; then kill -9 $$; fi; sleep 0.2'
  expect_rc 0
  expect_text err "killed by signal 9"
  expect_text err "fsdp-run: restarting with 2 ranks (restart 1 of 2)"
  expect_line out "[rank 1] start 1 rank 1 of 2"
  [ "$(grep -c "start 1" "$TMP/out")" -eq 2 ] || fail "expected 2 ranks after the restart: $(cat "$TMP/out")"

  launch --nproc-per-node 2:2 --max-restarts 3 sh -c 'if [ "$RANK" = 1 ]; then kill -9 $$; fi; sleep 0.2'
  expect_rc 137
  expect_text err "not restarting: 1 rank left, fewer than the 2 --nproc-per-node allows"

  launch --nproc-per-node 2 --max-restarts 1 sh -c 'echo "try $FSDP_RESTART_COUNT"; sleep 0.2; exit 3'
  expect_rc 3
  expect_text err "fsdp-run: restarting with 2 ranks (restart 1 of 1)"
  [ "$(grep -c "try 1" "$TMP/out")" -eq 2 ] || fail "an exit code keeps the world size: $(cat "$TMP/out")"
}

test_bad_input() {
  launch --nproc-per-node 0 true
  expect_rc 2
  expect_text err "--nproc-per-node"

  launch --nproc-per-node 2
  expect_rc 2
  expect_text err "no program given"

  launch --nnodes 2 --node-rank 2 true
  expect_rc 2
  expect_text err "--node-rank"

  launch --master-port 70000 true
  expect_rc 2
  expect_text err "--master-port"

  launch --nproc-per-node two true
  expect_rc 2
  expect_text err "nproc-per-node"

  launch --nproc-per-node 4:2 true
  expect_rc 2
  expect_text err "MIN:MAX"

  launch --nnodes 2 --nproc-per-node 2:4 true
  expect_rc 2
  expect_text err "single node"

  launch --nnodes 3:2 true
  expect_rc 2
  expect_text err "--nnodes must be at least 1, or a range MIN:MAX with 1 <= MIN <= MAX (got 3:2)"

  launch --bogus-option true
  expect_rc 2
  expect_text err "--bogus-option"

  launch --help
  expect_rc 0
  expect_text out "--nproc-per-node"
}

# --nnodes MIN:MAX on this host: each "node" is an fsdp-run on 127.0.0.1 with its own --node-rank.
# Starts nodes 0 and 1 (output to out/err and out1/err1) running `sh -c PROGRAM` with the
# options given; sets NODE0, NODE1 and ELASTIC_PORT.
ELASTIC_TOKEN=elastic-launcher-test-0123456789
start_two_nodes() {
  local program=$1
  shift
  ELASTIC_PORT=$(free_port)
  local common=(--nnodes 1:2 --nproc-per-node 2 --master-port "$ELASTIC_PORT" --grace-seconds 1 "$@")
  FSDP_JOB_TOKEN=$ELASTIC_TOKEN "$LAUNCHER" --node-rank 0 "${common[@]}" sh -c "$program" >"$TMP/out" 2>"$TMP/err" &
  NODE0=$!
  FSDP_JOB_TOKEN=$ELASTIC_TOKEN "$LAUNCHER" --node-rank 1 "${common[@]}" sh -c "$program" >"$TMP/out1" 2>"$TMP/err1" &
  NODE1=$!
}
# Waits until the logs hold $1 lines matching $2 (15 s at most).
wait_for_lines() {
  for _ in $(seq 150); do
    [ "$(cat "$TMP/out" "$TMP/out1" | grep -c -- "$2")" -ge "$1" ] && return 0
    sleep 0.1
  done
  kill "$NODE0" "$NODE1" 2>/dev/null
  fail "expected $1 lines with '$2': $(cat "$TMP/out1" "$TMP/err1")"
}
ELASTIC_PROGRAM='echo "start $FSDP_RESTART_COUNT rank $RANK of $WORLD_SIZE node $NODE_RANK/$GROUP_RANK port $MASTER_PORT"'

# Node 1's fsdp-run and its ranks are killed: node 0 misses its heartbeat, stops its own ranks
# and runs the job again alone (a new round, world size 2).
test_elastic_nodes_lose_a_node() {
  start_two_nodes "$ELASTIC_PROGRAM"'; [ "$FSDP_RESTART_COUNT" = 0 ] && exec sleep '"$MARKER"'; exit 0' \
    --max-restarts 1 --node-timeout 1
  wait_for_lines 4 "start 0"
  kill -KILL "$NODE1" $(pgrep -P "$NODE1")
  wait "$NODE0"
  RC=$?
  expect_rc 0
  local p=$((ELASTIC_PORT + 1))
  expect_line out1 "[rank 2] start 0 rank 2 of 4 node 1/1 port $p"
  expect_line out "[rank 0] start 0 rank 0 of 4 node 0/0 port $p"
  expect_text err "fsdp-run: node 1 sent no heartbeat for 1 s (its fsdp-run is gone); stopping 2 ranks"
  expect_text err "fsdp-run: rendezvous 1: 1 node, world size 2; this is node 0 with ranks 0-1"
  expect_line out "[rank 0] start 1 rank 0 of 2 node 0/0 port $p"
  expect_line out "[rank 1] start 1 rank 1 of 2 node 0/0 port $p"
  expect_no_marker_processes
}

# A rank that exits with an error stops both nodes; both join the next round and run again.
test_elastic_nodes_restart_together() {
  start_two_nodes "$ELASTIC_PROGRAM"'; [ "$FSDP_RESTART_COUNT$RANK" = 03 ] && exit 3; sleep 0.5' --max-restarts 1
  wait "$NODE0"
  RC=$?
  wait "$NODE1"
  local rc1=$?
  expect_rc 0
  [ "$rc1" -eq 0 ] || fail "node 1 exited with $rc1: $(cat "$TMP/err1")"
  expect_text err "node 1: rank 3 (pid"
  expect_text err1 "fsdp-run: rendezvous 1: 2 nodes, world size 4; this is node 1 with ranks 2-3"
  expect_line out1 "[rank 3] start 1 rank 3 of 4 node 1/1 port $((ELASTIC_PORT + 1))"
  # Without a restart left the job ends with the failure's code on the failing node.
  start_two_nodes "$ELASTIC_PROGRAM"'; [ "$RANK" = 3 ] && exit 3; sleep 0.5'
  wait "$NODE0"
  wait "$NODE1"
  RC=$?
  expect_rc 3
  expect_text err1 "fsdp-run: leaving the job: no restart left (--max-restarts 0)"
}

# Node 0 hosts the store: when its fsdp-run is gone, node 1 stops its ranks and ends.
test_elastic_nodes_lost_store() {
  start_two_nodes "$ELASTIC_PROGRAM"'; exec sleep '"$MARKER" --max-restarts 1
  wait_for_lines 4 "start 0"
  kill -KILL "$NODE0" $(pgrep -P "$NODE0")
  wait "$NODE1"
  RC=$?
  expect_rc 1
  expect_text err1 "node 0's fsdp-run, which hosts it, is gone, and an elastic job ends with it"
  expect_no_marker_processes
}

# A node that never comes: after --join-timeout, node 0 says which are missing and how to go on.
# One that comes after its round closed waits for the next round, or the end of the job.
test_elastic_nodes_missing_or_late() {
  FSDP_JOB_TOKEN=$ELASTIC_TOKEN launch --nnodes 2:2 --join-timeout 1 --master-port "$(free_port)" true
  expect_rc 1
  expect_text err "only 1 of at least 2 nodes joined rendezvous 0 within 1 s (--join-timeout); start the missing"
  local port
  port=$(free_port)
  FSDP_JOB_TOKEN=$ELASTIC_TOKEN "$LAUNCHER" --nnodes 1:2 --last-call 0.2 --master-port "$port" sleep 3 \
    >"$TMP/out" 2>"$TMP/err" &
  local node0=$!
  sleep 1
  FSDP_JOB_TOKEN=$ELASTIC_TOKEN launch --nnodes 1:2 --node-rank 1 --master-port "$port" true
  wait "$node0" || fail "node 0 failed: $(cat "$TMP/err")"
  expect_rc 0
  expect_text err "rendezvous 0 closed before this node joined; waiting for the next one"
  expect_text err "leaving the job: the job ended"
}

# A node with another job's token is refused by node 0's store, which names itself; the job goes on.
test_elastic_nodes_another_jobs_token() {
  local port
  port=$(free_port)
  FSDP_JOB_TOKEN=$ELASTIC_TOKEN "$LAUNCHER" --nnodes 1:2 --last-call 0.2 --master-port "$port" sleep 2 \
    >"$TMP/out" 2>"$TMP/err" &
  local node0=$!
  sleep 0.5
  FSDP_JOB_TOKEN=another-jobs-token-0123456789 "$LAUNCHER" --nnodes 1:2 --node-rank 1 --join-timeout 1 \
    --master-port "$port" true >"$TMP/out1" 2>"$TMP/err1"
  local rc1=$?
  wait "$node0" || fail "node 0 failed: $(cat "$TMP/err")"
  [ "$rc1" -ne 0 ] || fail "a node with another job's token joined: $(cat "$TMP/err1")"
  expect_text err "[fsdp] fsdp-run node 0: the node store refused a connection from 127.0.0.1:"
}

# SIGTERM while node 0 waits for a node that has not come ends it at once, with 128+15.
test_elastic_nodes_interrupted_while_waiting() {
  FSDP_JOB_TOKEN=$ELASTIC_TOKEN "$LAUNCHER" --nnodes 2:2 --master-port "$(free_port)" true >"$TMP/out" 2>"$TMP/err" &
  local node0=$!
  sleep 0.5
  kill -TERM "$node0"
  local start
  start=$(now_us)
  wait "$node0"
  RC=$?
  ELAPSED_US=$(($(now_us) - start))
  expect_rc 143
  expect_text err "fsdp-run: ending the job: received SIGTERM"
  expect_faster_than 3
}

test_cannot_execute() {
  launch --nproc-per-node 2 ./no/such/fsdp_run_program
  expect_rc 127
  expect_line err "fsdp-run: cannot execute './no/such/fsdp_run_program': No such file or directory"
}

test_tty_detection() {
  launch sh -c 'echo "tty=${FSDP_RUN_STDOUT_IS_TTY:-unset}"'
  expect_line out "[rank 0] tty=unset"
  # Run under a pseudo-terminal if this machine can make one.
  command -v script >/dev/null || { echo "SKIP: no 'script' command"; exit 77; }
  script -qec "'$LAUNCHER' sh -c 'echo tty=\$FSDP_RUN_STDOUT_IS_TTY'" /dev/null >"$TMP/out" 2>"$TMP/err" ||
    { echo "SKIP: cannot open a pseudo-terminal"; exit 77; }
  expect_text out "[rank 0] tty=1"
}

cases=("$@")
if [ ${#cases[@]} -eq 0 ]; then
  mapfile -t cases < <(declare -F | sed -n 's/^declare -f test_//p')
fi
for c in "${cases[@]}"; do
  declare -F "test_$c" >/dev/null || { echo "unknown case: $c" >&2; exit 2; }
  echo "== $c"
  "test_$c"
done
echo "PASS"
