#!/usr/bin/env bash
# Checkpoint and resume tests for the example trainer fsdp_gpt: a run stopped (--stop-after,
# SIGTERM) and resumed, at the same and at another world size, logs what the uninterrupted run logs.
#
#   fsdp_gpt_resume_test.sh PATH/TO/fsdp_gpt PATH/TO/fsdp-run [CASE...]
#
# Each test_<name> function is one case; with no CASE, all run. CMake registers every
# test_<name> as the ctest test gpt.<name>. Exit 0 = pass, 1 = fail.
set -u

# shellcheck source=gpt_test_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpt_test_common.sh"

# A tiny GPT with a global batch of 8 sequences (on 2 ranks: 2 x 4), and its 20 steps.
TINY_RESUME=(--layers 2 --width 64 --heads 4 --context 32 --eval-batches 1 --sample-bytes 8 --prompt "The ")
RS=("${TINY_RESUME[@]}" --batch-per-rank 4 --steps 20)

# "STEP LOSS" per logged step of the log $1, the loss as printed (4 decimals).
printed_losses() { sed -nE 's/^(\[rank 0\] )?step +([0-9]+)\/[0-9]+ \| loss ([0-9.]+) \|.*/\2 \3/p' "$1"; }
# "STEP LOSS" per line of the metrics files $@, the loss with every digit.
metrics_losses() { cat "$@" | sed -E 's/.*"loss":([-0-9.eE+]+).*"step":([0-9]+).*/\2 \1/'; }

# Fails unless every step line of the log $1 has an MFU of at most 100% (or "n/a (over the peak)":
# the matmul peak measured at start can come out low on a busy machine), and its ms/step times its
# tok/s is the tokens of a step, $2 (both count the same steps), to within the rounding of ms/step.
check_throughput() {
  local bad
  bad=$(grep -E "step +[0-9]+/" "$1" | grep -vE "\| MFU (([0-9]|[1-9][0-9]|100)\.[0-9]%|n/a \(over the peak\)) \|")
  [ -z "$bad" ] || fail "step lines without a possible MFU: $bad"
  bad=$(grep -E "step +[0-9]+/" "$1" | sed -E 's/.*\| +([0-9.]+) ms\/step \| +([0-9,]+) tok\/s \|.*/\1 \2/' |
        tr -d , | awk -v t="$2" '{ if ($1 * $2 / 1000 > t * (1 + 0.06 / $1) + 1 || $1 * $2 / 1000 < t * (1 - 0.06 / $1) - 1) print }')
  [ -z "$bad" ] || fail "ms/step x tok/s is not $2 tokens per step: $bad"
}

# ms/step of step $2 in the log $1.
ms_per_step() { sed -nE "s/^(\[rank 0\] )?step +$2\/[0-9]+ \|.*\| +([0-9.]+) ms\/step \|.*/\2/p" "$1"; }

# Checkpoints: --steps 20 stopped with --stop-after 7 and resumed (new processes) logs exactly the
# losses of an uninterrupted --steps 20, in full precision (the one metrics file both parts write),
# the window that spans the interruption included; --export writes a safetensors file; --async-save
# writes the --save-every checkpoints in the background.
test_stop_after_resume() {
  local ck=(--layers 2 --width 64 --heads 4 --context 32 --batch-per-rank 4 --steps 20 --log-interval 5
            --eval-batches 1 --sample-bytes 8 --prompt "The ")
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${ck[@]}" --save-dir "$TMP/whole" \
      --metrics-file "$TMP/whole.jsonl" --export "$TMP/model.safetensors"
  expect_rc 0
  expect_regex out "checkpoint: saved step 20 to $TMP/whole/step-00000020"
  expect_text out "exported the model to $TMP/model.safetensors (safetensors)"
  [ -s "$TMP/model.safetensors" ] || fail "no export"
  head -c 64 "$TMP/model.safetensors" | tail -c +9 | grep -q '^{"' || fail "the export does not start with a JSON header"
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${ck[@]}" --save-dir "$TMP/parts" \
      --stop-after 7 --save-every 3 --async-save --metrics-file "$TMP/part1.jsonl"
  expect_rc 0
  expect_text out "stopped after step 7 of 20; continue with --resume"
  expect_regex out "checkpoint: saving step 3 to $TMP/parts/step-00000003 in the background \(training paused"
  expect_text out "checkpoint: saved step 6 to $TMP/parts/step-00000006 (in the background)"
  for s in 3 6 7; do
    [ -f "$TMP/parts/step-0000000$s/manifest.json" ] || fail "no complete checkpoint for step $s"
  done
  # The resumed run writes on to the same file, which also holds a line logged after the
  # checkpoint it resumes from (as when a rank dies after step 10): that line goes.
  cp "$TMP/part1.jsonl" "$TMP/parts.jsonl"
  echo '{"loss":9.5,"step":10}' >>"$TMP/parts.jsonl"
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${ck[@]}" --save-dir "$TMP/parts" \
      --resume --metrics-file "$TMP/parts.jsonl"
  expect_rc 0
  expect_text out "checkpoint: resumed from $TMP/parts/step-00000007 at step 7"
  local pairs='s/.*"loss":([-0-9.eE+]+).*"step":([0-9]+).*/\2 \1/'
  sed -E "$pairs" "$TMP/whole.jsonl" >"$TMP/whole.loss"
  sed -E "$pairs" "$TMP/parts.jsonl" >"$TMP/parts.loss"
  [ "$(wc -l <"$TMP/whole.loss")" -eq 5 ] || fail "expected 5 logged steps, got $(cat "$TMP/whole.loss")"
  diff "$TMP/whole.loss" "$TMP/parts.loss" >&2 || fail "the resumed run's losses differ from the uninterrupted run's"
}

# SIGTERM (preemption): every rank finishes its step, saves, and exits 0; --resume continues.
test_sigterm_saves_and_exits() {
  local ck=(--layers 2 --width 64 --heads 4 --context 32 --batch-per-rank 4 --steps 100000 --log-interval 1
            --eval-batches 1 --sample-bytes 8 --prompt "The " --save-dir "$TMP/preempt")
  "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" --grace-seconds 60 "$TRAINER" "${ck[@]}" \
      >"$TMP/out" 2>"$TMP/err" &
  local launcher=$!
  for _ in $(seq 600); do
    grep -qE "^\[rank 0\] step +3/" "$TMP/out" 2>/dev/null && break
    sleep 0.1
  done
  grep -qE "^\[rank 0\] step +3/" "$TMP/out" || { kill -KILL "$launcher"; fail "training did not start"; }
  kill -TERM "$launcher"
  wait "$launcher"
  RC=$?
  expect_rc 143  # fsdp-run reports the signal it got; the ranks themselves exited 0
  local stopped
  stopped=$(sed -nE 's/^\[rank 0\] stopped after step ([0-9]+) of 100000; continue with --resume$/\1/p' "$TMP/out")
  [ -n "$stopped" ] || fail "the ranks did not report a clean stop"
  grep -qE "exited with code [1-9]|killed" "$TMP/err" && fail "a rank did not exit cleanly"
  [ -f "$TMP/preempt/step-$(printf %08d "$stopped")/manifest.json" ] || fail "no checkpoint of step $stopped"
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${ck[@]}" --resume --stop-after $((stopped + 1))
  expect_rc 0
  expect_text out "resumed from $TMP/preempt/step-$(printf %08d "$stopped") at step $stopped"
  expect_text out "stopped after step $((stopped + 1)) of 100000"
}

# A run resumed at the same world size logs the uninterrupted run's losses in full precision, with
# --log-interval 1 and with a window that spans the stop (--log-interval 10, stopped after step 9:
# the resumed step 10 closes a window of 9 steps, 1 of them timed in the new process, whose
# ms/step is of that one step, not of the window's 9).
test_resume_same_world() {
  for li in 1 10; do
    run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${RS[@]}" --log-interval $li \
        --metrics-file "$TMP/whole$li.jsonl"
    expect_rc 0
    run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${RS[@]}" --log-interval $li \
        --save-dir "$TMP/ck$li" --stop-after 9 --metrics-file "$TMP/part1_$li.jsonl"
    expect_rc 0
    run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${RS[@]}" --log-interval $li \
        --save-dir "$TMP/ck$li" --resume --metrics-file "$TMP/part2_$li.jsonl"
    expect_rc 0
    expect_text out "checkpoint: resumed from $TMP/ck$li/step-00000009 at step 9 (saved by 2 ranks, resumed on 2)"
    check_throughput "$TMP/out" 256
    metrics_losses "$TMP/whole$li.jsonl" >"$TMP/whole.loss"
    metrics_losses "$TMP/part1_$li.jsonl" "$TMP/part2_$li.jsonl" >"$TMP/parts.loss"
    [ "$(wc -l <"$TMP/parts.loss")" -eq "$([ $li = 1 ] && echo 20 || echo 3)" ] || fail "logged steps: $(cat "$TMP/parts.loss")"
    diff "$TMP/whole.loss" "$TMP/parts.loss" >&2 || fail "--log-interval $li: the resumed run's losses differ"
  done
  # Step 10 ran first in its process (no faster than later steps); a window counting the 8 steps
  # of the first process in its ms/step would show a ninth of that.
  local first later
  first=$(ms_per_step "$TMP/out" 10) later=$(ms_per_step "$TMP/out" 20)
  less_than "$(awk -v x="$later" 'BEGIN { print x / 3 }')" "$first" ||
    fail "ms/step of the resumed window (step 10: $first) is not of the step timed in its process (step 20: $later)"
}

# A run resumed at another world size keeps its global batch (8 sequences; gradient accumulation
# makes up for fewer ranks) and so trains on the same rows: its logged losses match the
# uninterrupted run's to within one unit in the last printed digit, with --log-interval 1 (resumed
# on 4 ranks) and 10 (on 1 process). The sums run in another order (other micro-batches, another
# number of ranks), so the losses differ in float32 rounding, which can carry a printed digit over.
test_resume_other_world() {
  for li in 1 10; do
    run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${RS[@]}" --log-interval $li
    expect_rc 0
    printed_losses "$TMP/out" >"$TMP/whole.loss"
    run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${RS[@]}" --log-interval $li \
        --save-dir "$TMP/ck$li" --stop-after 9
    expect_rc 0
    printed_losses "$TMP/out" >"$TMP/parts.loss"
    if [ $li = 1 ]; then
      run "$LAUNCHER" --nproc-per-node 4 --master-port "$PORT" "$TRAINER" "${RS[@]}" --log-interval $li \
          --save-dir "$TMP/ck$li" --resume
      expect_regex out "batch +global 8 sequences \(--global-batch\) = 4 ranks x 1 micro-batch x 2 \(--batch-size\)"
      expect_text out "(saved by 2 ranks, resumed on 4)"
    else
      run "$TRAINER" "${RS[@]}" --log-interval $li --save-dir "$TMP/ck$li" --resume
      expect_regex out "batch +global 8 sequences \(--global-batch\) = 1 rank x 2 micro-batches x 4 \(--batch-size\)"
      expect_regex out "grad accumulation +2 micro-batches of 4 per step"
      expect_text out "(saved by 2 ranks, resumed on 1)"
    fi
    expect_rc 0
    check_throughput "$TMP/out" 256
    printed_losses "$TMP/out" >>"$TMP/parts.loss"
    [ "$(cut -d' ' -f1 "$TMP/whole.loss")" = "$(cut -d' ' -f1 "$TMP/parts.loss")" ] ||
      fail "--log-interval $li: logged steps $(cut -d' ' -f1 "$TMP/parts.loss" | tr '\n' ' ')"
    local worst  # in units of the last printed digit
    worst=$(paste -d' ' "$TMP/whole.loss" "$TMP/parts.loss" | tr -d . |
            awk '{ d = $2 - $4; if (d < 0) d = -d; if (d > w) w = d } END { print w + 0 }')
    echo "--log-interval $li: largest loss difference $worst in the last printed digit"
    [ "$worst" -le 1 ] || {
      paste -d' ' "$TMP/whole.loss" "$TMP/parts.loss" >&2
      fail "--log-interval $li: the resumed losses differ from the uninterrupted run's by $worst in the last digit"
    }
  done
}

# The global batch is the run's: a resume that names another one is refused, naming both; one that
# does not split over the world size is refused, naming the world size.
test_global_batch_resume_errors() {
  run "$TRAINER" "${TINY_RESUME[@]}" --batch-per-rank 4 --steps 4 --stop-after 2 --save-dir "$TMP/ck"
  expect_rc 0
  expect_regex out "batch +global 4 sequences \(--global-batch\) = 1 rank x 1 micro-batch x 4 \(--batch-size\)"
  run "$TRAINER" "${TINY_RESUME[@]}" --steps 4 --save-dir "$TMP/ck" --resume --global-batch 8
  expect_failure
  expect_text err "--global-batch 8 differs from the global batch 4 of $TMP/ck/step-00000002"
  run "$LAUNCHER" --nproc-per-node 3 --master-port "$PORT" "$TRAINER" "${TINY_RESUME[@]}" --steps 4 --save-dir "$TMP/ck" --resume
  expect_failure
  expect_text err "the global batch 4 of $TMP/ck/step-00000002 does not split evenly over 3 ranks"
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${TINY_RESUME[@]}" --steps 4 --save-dir "$TMP/ck" --resume
  expect_rc 0
  expect_regex out "batch +global 4 sequences \(--global-batch\) = 2 ranks x 1 micro-batch x 2 \(--batch-size\)"
}

# What the checkpoint's shapes do not show is recorded and kept: a resume with other --heads, or
# with --deterministic switched, is refused naming the flag; one past --steps says so.
test_resume_refuses_other_heads_or_determinism() {
  local model=(--layers 2 --width 64 --context 32 --eval-batches 1 --sample-bytes 0 --batch-per-rank 4)
  run "$TRAINER" "${model[@]}" --heads 4 --steps 4 --stop-after 2 --save-dir "$TMP/ck"
  expect_rc 0
  run "$TRAINER" "${model[@]}" --heads 2 --steps 4 --save-dir "$TMP/ck" --resume
  expect_failure
  expect_text err "was written with --heads 4"
  run "$TRAINER" "${model[@]}" --heads 4 --steps 4 --deterministic --save-dir "$TMP/ck" --resume
  expect_failure
  expect_text err "was written without --deterministic"
  run "$TRAINER" "${model[@]}" --heads 4 --steps 2 --save-dir "$TMP/ck" --resume
  expect_rc 0
  expect_text out "checkpoint: step 2 is at or past --steps 2: nothing left to train"
}

run_cases "$@"
