#!/usr/bin/env bash
# The planner's flags in a program of the library's user (examples/quickstart.cpp, through
# fsdp::PlanFlags): --plan prints the table and exits; --memory-budget trains the chosen
# configuration at its predicted FSDP peaks; a budget nothing fits and a bad flag end it with a
# message.
#
#   quickstart_plan_test.sh PATH/TO/fsdp_quickstart PATH/TO/fsdp-run [CASE...]
#
# CMake registers every test_<name> as the ctest test quickstart.<name>. Exit 0 = pass, 1 = fail.
set -u

# shellcheck source=gpt_test_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpt_test_common.sh"

test_plan() {
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" --plan
  expect_rc 0
  expect_regex out "^\[rank 0\] Plan for cpu: 1 node x 2 ranks"
  expect_regex out "^\[rank 0\] \| 1 \| [A-Z_]+, wrap (linear|none), (bf16|fp32), micro-batch 256 x 1 \|"
  expect_regex out "^\[rank 0\] best: "
  ! grep -q "^\[rank 1\] " "$TMP/out" || fail "rank 1 printed"
  ! grep -q "step 1 " "$TMP/out" || fail "the program trained after --plan"
}

test_plan_two_nodes() {
  # Two launchers on this host, each a node of two ranks: this machine is two nodes of two ranks.
  export FSDP_JOB_TOKEN=quickstart-plan-two-nodes-token
  local launch=("$LAUNCHER" --nnodes 2 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$PORT")
  "${launch[@]}" --node-rank 1 "$TRAINER" --plan >"$TMP/node1" 2>&1 &
  local node1=$!
  run "${launch[@]}" --node-rank 0 "$TRAINER" --plan
  wait "$node1" || fail "node 1 failed: $(cat "$TMP/node1")"
  expect_rc 0
  expect_regex out "^\[rank 0\] Plan for cpu: 2 nodes x 2 ranks, "
}

test_memory_budget_trains_at_the_predicted_peaks() {
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" --memory-budget 1GiB --plan-file "$TMP/plan.jsonl"
  expect_rc 0
  expect_regex out "^\[rank 0\] planned for 1.00 GiB per rank: [A-Z_]+, wrap (linear|none), (bf16|fp32), micro-batch 256 x 1; predicted peak"
  expect_regex out "^\[rank 0\] step 20  loss "
  [ "$(wc -l <"$TMP/plan.jsonl")" -eq 1 ] || fail "the plan file holds $(wc -l <"$TMP/plan.jsonl") lines, not the chosen one"
  local params grads peaks
  params=$(grep -oE '"params_bytes":[0-9]+' "$TMP/plan.jsonl" | cut -d: -f2)
  grads=$(grep -oE '"grads_bytes":[0-9]+' "$TMP/plan.jsonl" | cut -d: -f2)
  peaks=$(sed -nE 's/^\[rank 0\] rank 0 FSDP memory: params [0-9]+ B \(peak ([0-9]+) B\), grads [0-9]+ B \(peak ([0-9]+) B\)$/\1 \2/p' "$TMP/out")
  [ -n "$params" ] && [ "$peaks" = "$params $grads" ] ||
    fail "FSDP peaks measured '${peaks:-none}', predicted '${params:-?} ${grads:-?}'"
}

test_calibrated_plan() {
  # Every rank times the quick start's model first; the saved times plan again without measuring.
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" --plan --calibrate \
    --calibration-file "$TMP/calibration.json"
  expect_rc 0
  expect_regex out "^\[rank 0\] best: "
  grep -qE '"precision": *"bf16"' "$TMP/calibration.json" || fail "no bf16 timing in the saved calibration"
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" --memory-budget 1GiB \
    --calibration-file "$TMP/calibration.json"
  expect_rc 0
  expect_regex out "^\[rank 0\] step 20  loss "
}

test_memory_budget_nothing_fits() {
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" --memory-budget 100MiB
  expect_rc 1
  local said
  said=$(cat "$TMP/out" "$TMP/err" | grep -cE "no configuration fits in 100.00 MiB per rank on cpu: .*; the smallest needs [0-9.]+ MiB")
  [ "$said" -eq 1 ] || fail "the budget's refusal printed $said times, not once"
  ! grep -q "step 1 " "$TMP/out" || fail "the program trained without a configuration"
}

test_bad_plan_flag() {
  run "$TRAINER" --memory-budget 12QB
  expect_rc 1
  expect_text err "--memory-budget 12QB: '12QB' is not a size"
  run "$TRAINER" --plan-file "$TMP/plan.jsonl"
  expect_rc 1
  expect_text err "--plan-file $TMP/plan.jsonl writes the predictions of --plan or --memory-budget"
  run "$TRAINER" --memory-budgt 1GiB
  expect_rc 2
  expect_text err "unknown argument --memory-budgt; the quick start takes the planner's flags:"
  expect_text err "--memory-budget SIZE"
}

run_cases "$@"
