#!/usr/bin/env bash
# --deterministic tests for the example trainer fsdp_gpt: the final parameter hash is the same at
# every world size, and after a rank is lost and fsdp-run restarts the job with the ranks left.
#
#   fsdp_gpt_determinism_test.sh PATH/TO/fsdp_gpt PATH/TO/fsdp-run [CASE...]
#
# Each test_<name> function is one case; with no CASE, all run. CMake registers every
# test_<name> as the ctest test gpt.<name>. Exit 0 = pass, 1 = fail.
set -u

# shellcheck source=gpt_test_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpt_test_common.sh"

# A tiny GPT, dropout and clipping on, 12 micro-batches of 2 sequences per step.
DET=(--layers 2 --width 64 --heads 4 --context 32 --eval-batches 1 --sample-bytes 0 --deterministic
     --global-batch 24 --batch-size 2 --dropout 0.1 --clip-grad-norm 0.5 --log-interval 1)

final_hash() { sed -nE 's/^(\[rank 0\] )?final parameter hash ([0-9a-f]{16})$/\2/p' "$TMP/$1"; }
# "STEP LOSS" per logged step of the log $1, as printed.
losses() { sed -nE 's/^(\[rank 0\] )?step +([0-9]+)\/[0-9]+ \| loss ([0-9.]+) \|.*/\2 \3/p' "$TMP/$1"; }

# World 3 (4 micro-batches each) and world 8 (1 or 2 each: the ranks with 1 run a padding pass)
# end with the hash and the losses of one process. The library's own tests (determinism_test.cpp)
# cover worlds 2 to 5 and 8 and every strategy.
test_deterministic_hash_across_world_sizes() {
  run "$TRAINER" "${DET[@]}" --steps 4
  expect_rc 0
  cp "$TMP/out" "$TMP/one.out"
  local one
  one=$(final_hash one.out)
  [ -n "$one" ] || fail "no final parameter hash: $(cat "$TMP/one.out")"
  for world in 3 8; do
    run "$LAUNCHER" --nproc-per-node "$world" --master-port "$PORT" "$TRAINER" "${DET[@]}" --steps 4
    expect_rc 0
    cp "$TMP/out" "$TMP/w$world.out"
    [ "$(final_hash "w$world.out")" = "$one" ] || fail "world $world hash $(final_hash "w$world.out") != $one"
    [ "$(losses "w$world.out")" = "$(losses one.out)" ] || fail "world $world losses differ from one rank's"
  done
}

# Activation checkpointing recomputes each block's forward with the dropout masks of the forward it
# replaces: the hash and the losses equal the run without it.
test_checkpointing_keeps_the_dropout_masks() {
  run "$TRAINER" "${DET[@]}" --steps 3
  expect_rc 0
  cp "$TMP/out" "$TMP/plain.out"
  run "$TRAINER" "${DET[@]}" --steps 3 --activation-checkpointing
  expect_rc 0
  [ -n "$(final_hash out)" ] && [ "$(final_hash out)" = "$(final_hash plain.out)" ] ||
    fail "hash with checkpointing $(final_hash out) != $(final_hash plain.out) without"
  [ "$(losses out)" = "$(losses plain.out)" ] || fail "the losses with checkpointing differ"
}

# Four ranks, one killed (SIGKILL) after a checkpoint: fsdp-run --max-restarts 1 --nproc-per-node
# 3:4 restarts three, which resume from the newest complete checkpoint and end with the hash and
# the losses of an uninterrupted run.
test_elastic_restart_after_a_lost_rank() {
  run "$TRAINER" "${DET[@]}" --steps 16
  expect_rc 0
  cp "$TMP/out" "$TMP/whole.out"
  "$LAUNCHER" --nproc-per-node 3:4 --max-restarts 1 --master-port "$PORT" "$TRAINER" "${DET[@]}" --steps 16 \
      --save-dir "$TMP/ck" --save-every 2 --resume >"$TMP/out" 2>"$TMP/err" &
  local launcher=$! victim=""
  for _ in $(seq 600); do
    if grep -q "checkpoint: saved step 4" "$TMP/out"; then
      victim=$(pgrep -P "$launcher" | tail -n 1)
      break
    fi
    sleep 0.1
  done
  [ -n "$victim" ] || { kill "$launcher"; fail "no checkpoint of step 4: $(cat "$TMP/out" "$TMP/err")"; }
  kill -KILL "$victim"
  wait "$launcher"
  RC=$?
  expect_rc 0
  expect_text err "restarting with 3 ranks (restart 1 of 1)"
  expect_regex out "checkpoint: resumed"
  [ "$(final_hash out)" = "$(final_hash whole.out)" ] || fail "hash $(final_hash out) != $(final_hash whole.out)"
  # Every step the uninterrupted run logged is logged with the same loss (some twice: re-run after the restart).
  local missing
  missing=$(losses whole.out | while read -r line; do losses out | grep -qxF "$line" || echo "$line"; done)
  [ -z "$missing" ] || fail "steps whose losses differ: $missing"
}

# Two "nodes" (fsdp-run --nnodes 1:2 on this host) of 2 ranks each; node 1's fsdp-run and its
# ranks are SIGKILLed at a random step. Node 0 stops its ranks, the next rendezvous closes
# with node 0 alone, and its 2 ranks resume from the newest complete checkpoint and end with the
# hash and the losses of an uninterrupted run.
test_elastic_nodes_after_a_lost_node() {
  run "$TRAINER" "${DET[@]}" --steps 12
  expect_rc 0
  cp "$TMP/out" "$TMP/whole.out"
  local kill_step=$((3 + RANDOM % 6)) node0 node1 killed=""
  local nodes=(--nnodes 1:2 --nproc-per-node 2 --max-restarts 1 --master-port "$PORT" --node-timeout 3 --grace-seconds 2)
  local job=("$TRAINER" "${DET[@]}" --steps 12 --save-dir "$TMP/ck" --save-every 2 --resume)
  export FSDP_JOB_TOKEN=elastic-gpt-test-0123456789abcdef
  "$LAUNCHER" --node-rank 0 "${nodes[@]}" "${job[@]}" >"$TMP/out" 2>"$TMP/err" &
  node0=$!
  "$LAUNCHER" --node-rank 1 "${nodes[@]}" "${job[@]}" >"$TMP/out1" 2>"$TMP/err1" &
  node1=$!
  for _ in $(seq 900); do
    if grep -qE "^\[rank 0\] step +$kill_step/" "$TMP/out"; then
      # shellcheck disable=SC2046  # one pid per word
      kill -KILL "$node1" $(pgrep -P "$node1")
      killed=1
      break
    fi
    sleep 0.1
  done
  [ -n "$killed" ] || { kill "$node0" "$node1"; fail "step $kill_step was not logged: $(cat "$TMP/err1")"; }
  wait "$node0"
  RC=$?
  expect_rc 0
  expect_text err "rendezvous 0: 2 nodes, world size 4"
  expect_text err "rendezvous 1: 1 node, world size 2; this is node 0 with ranks 0-1"
  expect_regex out "checkpoint: resumed"
  [ "$(final_hash out)" = "$(final_hash whole.out)" ] || fail "hash $(final_hash out) != $(final_hash whole.out)"
  local missing
  missing=$(losses whole.out | while read -r line; do losses out | grep -qxF "$line" || echo "$line"; done)
  [ -z "$missing" ] || fail "steps whose losses differ: $missing"
}

# One process, one micro-batch per step, no dropout: --deterministic runs the same arithmetic as
# the plain loop, so each step logs the same loss. Muon's blocks step at 20 x --lr and its AdamW
# part at --lr; a schedule set on the wrong options shows from the second step on.
test_deterministic_steps_like_the_plain_loop_with_every_optimizer() {
  local one=(--layers 2 --width 64 --heads 4 --context 32 --eval-batches 1 --sample-bytes 0 --global-batch 2
             --batch-size 2 --warmup 2 --steps 5 --log-interval 1)
  local optimizer
  for optimizer in muon lamb adafactor adamw; do
    run "$TRAINER" "${one[@]}" --optimizer "$optimizer"
    expect_rc 0
    cp "$TMP/out" "$TMP/plain.out"
    run "$TRAINER" "${one[@]}" --optimizer "$optimizer" --deterministic
    expect_rc 0
    [ "$(losses out | wc -l)" = 5 ] || fail "$optimizer: not 5 logged steps: $(cat "$TMP/out")"
    [ "$(losses out)" = "$(losses plain.out)" ] ||
      fail "$optimizer: --deterministic logs $(losses out | tr '\n' ' ')but the plain loop $(losses plain.out | tr '\n' ' ')"
  done
}

run_cases "$@"
