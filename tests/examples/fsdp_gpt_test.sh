#!/usr/bin/env bash
# Smoke tests for the example trainer fsdp_gpt, run through the launchers it supports.
#
#   fsdp_gpt_test.sh PATH/TO/fsdp_gpt PATH/TO/fsdp-run [CASE...]
#
# Each test_<name> function is one case; with no CASE, all run. CMake registers every
# test_<name> as the ctest test gpt.<name>. Exit 0 = pass, 1 = fail, 77 = skipped (a launcher
# that is not installed). The model is tiny, so each training run takes a few seconds on 2 cores.
set -u

# shellcheck source=gpt_test_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpt_test_common.sh"

# A tiny GPT: 2 blocks of width 64 (~0.1 M parameters); 40 steps lower the loss by well over a nat.
STEPS=40
TINY=(--layers 2 --width 64 --heads 4 --context 32 --batch-per-rank 8 --steps "$STEPS" --log-interval 10
      --lr 3e-3 --eval-batches 2 --sample-bytes 48 --prompt "The ")

# Checks everything rank 0 promises to print, in $TMP/out with prefix $1 ("[rank 0] " under
# fsdp-run, "" otherwise), for a run of $STEPS steps on world size $2, ranks told by launcher
# convention $3 (the end of the world size row).
check_training_output() {
  local prefix=$1 world=$2 source=$3 out="$TMP/out.rank0"
  # Only rank 0 prints.
  if [ -n "$prefix" ]; then
    grep -qv "^\[rank 0\] " "$TMP/out" && fail "lines from ranks other than 0 on stdout"
    sed 's/^\[rank 0\] //' "$TMP/out" >"$out"
  else
    cp "$TMP/out" "$out"
  fi

  # The resolved configuration.
  for key in "fsdp_gpt configuration" "strategy" "sharding factor" "units" "parameters" "model" "batch" \
             "optimizer" "data" "tokens" "seed" "FLOPs per token" "matmul peak"; do
    grep -qE "^  $key  " "$out" || [ "$key" = "fsdp_gpt configuration" ] || fail "no '$key' row in the configuration"
  done
  grep -qx "fsdp_gpt configuration" "$out" || fail "no configuration header"
  grep -qE "^  world size +$world \(" "$out" || fail "world size is not $world"
  grep -qE "^  world size .*; $source\)$" "$out" || fail "the rank variables did not come from $source"
  grep -qE "^  model +2 layers, width 64, 4 heads, context 32" "$out" || fail "model row does not match the flags"
  # --batch-per-rank 8 on each of the ranks: the global batch, a whole number of micro-batches per rank.
  grep -qE "^  batch +global $((world * 8)) sequences \(--global-batch\) = $world ranks? x [0-9]+ micro-batch(es)? x [0-9]+ \(--batch-size\); $((world * 8)) x 32 = [0-9,]+ tokens per step$" "$out" ||
    fail "the batch row does not show the global batch $((world * 8))"

  # One line per logged step: 1, 10, 20, 30, 40. MFU is "n/a (over the peak)" when a step beats the
  # matmul peak measured at start (on a busy machine that measurement can come out low).
  local step_re='^step +([0-9]+)/'"$STEPS"' \| loss ([0-9]+\.[0-9]{4}) \| lr [0-9.]+e[-+][0-9]+ \| +([0-9]+\.[0-9]) ms/step \| +([0-9,]+) tok/s \| ([0-9]+\.[0-9]{4}) TFLOP/s \| MFU ([0-9]+\.[0-9]%|n/a \(over the peak\)) \| fsdp peak ([0-9]+\.[0-9]{2}) MiB \| rss ([0-9]+) MiB$'
  local steps
  steps=$(grep -E "^step " "$out" | sed -E "s#$step_re#\1#" | tr '\n' ' ')
  [ "$steps" = "1 10 20 30 40 " ] || fail "logged steps are '$steps', expected '1 10 20 30 40 '"
  local bad
  bad=$(grep -E "^step " "$out" | grep -vE "$step_re")
  [ -z "$bad" ] || fail "step lines not in the promised format: $bad"
  # Every measured field is a positive number.
  while read -r ms toks tflops peak rss; do
    for v in "$ms" "${toks//,/}" "$tflops" "$peak" "$rss"; do
      less_than 0 "$v" || fail "a step line has a zero or negative field: ms=$ms tok/s=$toks TFLOP/s=$tflops peak=$peak rss=$rss"
    done
  done < <(grep -E "^step " "$out" | sed -E "s#$step_re#\3 \4 \5 \7 \8#")

  local loss_first loss_last
  loss_first=$(grep -E "^step +1/" "$out" | sed -E "s#$step_re#\2#")
  loss_last=$(grep -E "^step +$STEPS/" "$out" | sed -E "s#$step_re#\2#")
  less_than "$loss_last" "$(awk -v x="$loss_first" 'BEGIN { print x - 1.0 }')" ||
    fail "training loss did not fall by a nat: step 1 $loss_first, step $STEPS $loss_last"

  # Validation loss before and after, and the final summary agreeing with them.
  local val_before val_after
  val_before=$(sed -nE 's/^validation loss before training: ([0-9]+\.[0-9]{4})$/\1/p' "$out")
  val_after=$(sed -nE 's/^validation loss after training: ([0-9]+\.[0-9]{4}) \(before: ([0-9]+\.[0-9]{4})\)$/\1/p' "$out")
  [ -n "$val_before" ] && [ -n "$val_after" ] || fail "no validation loss lines"
  # Untrained, a byte-level model predicts ~uniformly over 256 bytes: ln 256 = 5.545.
  less_than 5.0 "$val_before" && less_than "$val_before" 6.5 || fail "validation loss before training is $val_before, not ~5.5"
  less_than "$val_after" "$(awk -v x="$val_before" 'BEGIN { print x - 1.0 }')" ||
    fail "validation loss did not fall by a nat: $val_before -> $val_after"
  grep -qE "^done: $STEPS steps in [0-9]+\.[0-9] s \([0-9]+\.[0-9] s training\) \| final train loss $loss_last \| val loss $val_before -> $val_after \| mean [0-9,]+ tok/s$" "$out" ||
    fail "no final summary line matching the step log and validation losses"

  # The generated sample: starts with the prompt, 48 bytes after it (it may contain newlines).
  grep -qx -- "--- sample (temperature 0.8) ---" "$out" || fail "no sample header"
  local sample
  sample=$(sed -n '/^--- sample/,/^---$/p' "$out" | sed '1d;$d')
  [ "${sample:0:4}" = "The " ] || fail "the sample does not start with the prompt: '$sample'"
  [ "${#sample}" -ge 40 ] || fail "the sample is too short: '$sample'"
}

test_train_two_ranks() {
  local start=$SECONDS
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${TINY[@]}" \
      --metrics-file "$TMP/metrics.jsonl" --show-memory
  expect_rc 0
  check_training_output "[rank 0] " 2 "RANK, WORLD_SIZE from fsdp-run or torchrun"
  expect_text out "model-state memory per rank"
  expect_regex out "FULL_SHARD \(this run, F=2\)"
  expect_regex out "^\[rank 0\] rank 0 FSDP peak during training: parameters [0-9.]+ MiB, gradients [0-9.]+ MiB$"

  # The metrics file: one JSON object per logged step, with every field, agreeing with the log.
  [ "$(wc -l <"$TMP/metrics.jsonl")" -eq 5 ] || fail "metrics file has $(wc -l <"$TMP/metrics.jsonl") lines, expected 5"
  for key in step loss lr ms_per_step tokens_per_s model_tflops mfu fsdp_param_peak_bytes fsdp_grad_peak_bytes \
             rss_bytes rss_peak_bytes exposed_comm_share elapsed_s; do
    [ "$(grep -c "\"$key\":" "$TMP/metrics.jsonl")" -eq 5 ] || fail "metrics field '$key' missing in some lines"
  done
  local json_loss log_loss
  json_loss=$(grep "\"step\":$STEPS[,}]" "$TMP/metrics.jsonl" | sed -E 's/.*"loss":([-0-9.eE+]+).*/\1/')
  log_loss=$(grep -E "^\[rank 0\] step +$STEPS/" "$TMP/out" | sed -E 's/.*\| loss ([0-9.]+) \|.*/\1/')
  [ "$(awk -v x="$json_loss" 'BEGIN { printf "%.4f", x }')" = "$log_loss" ] ||
    fail "metrics loss $json_loss does not round to the logged $log_loss"
  echo "trained 2 ranks in $((SECONDS - start)) s"
}

# Deferred initialization (the default) and an eager build give the same weights, so the same
# losses step for step; the deferred run says so in its configuration.
test_init_deferred_matches_eager() {
  local short=(--layers 2 --width 64 --heads 4 --context 32 --batch-per-rank 4 --steps 6 --log-interval 1
               --eval-batches 1 --sample-bytes 8 --prompt "The ")
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${short[@]}" --init eager
  expect_rc 0
  grep -E "^\[rank 0\] step +[0-9]+/" "$TMP/out" | sed -E 's/.*(\| loss [0-9.]+) \|.*/\1/' >"$TMP/eager.loss"
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${short[@]}"
  expect_rc 0
  expect_regex out "initialization deferred \(unit by unit in fully_shard\)"
  grep -E "^\[rank 0\] step +[0-9]+/" "$TMP/out" | sed -E 's/.*(\| loss [0-9.]+) \|.*/\1/' >"$TMP/deferred.loss"
  [ "$(wc -l <"$TMP/eager.loss")" -eq 6 ] || fail "expected 6 logged steps, got $(wc -l <"$TMP/eager.loss")"
  diff "$TMP/eager.loss" "$TMP/deferred.loss" >&2 || fail "deferred and eager initialization train differently"
}

# The optimizer step in backward steps exactly as a step after backward: the same losses step for
# step (AdamW with weight-decay groups, micro-batches under no_sync), on backward's thread and on
# its own; it refuses clipping by name.
test_step_in_backward() {
  local short=(--layers 2 --width 64 --heads 4 --context 32 --batch-per-rank 4 --steps 6 --log-interval 1
               --eval-batches 1 --sample-bytes 8 --prompt "The " --grad-accum 2)
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${short[@]}"
  expect_rc 0
  grep -E "^\[rank 0\] step +[0-9]+/" "$TMP/out" | sed -E 's/.*(\| loss [0-9.]+) \|.*/\1/' >"$TMP/after.loss"
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${short[@]}" --step-in-backward
  expect_rc 0
  expect_regex out "optimizer step +in backward, unit by unit as gradients are reduced"
  grep -E "^\[rank 0\] step +[0-9]+/" "$TMP/out" | sed -E 's/.*(\| loss [0-9.]+) \|.*/\1/' >"$TMP/during.loss"
  [ "$(wc -l <"$TMP/after.loss")" -eq 6 ] || fail "expected 6 logged steps, got $(wc -l <"$TMP/after.loss")"
  diff "$TMP/after.loss" "$TMP/during.loss" >&2 || fail "the step in backward trains differently"
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${short[@]}" --step-in-backward \
      --step-thread own
  expect_rc 0
  expect_regex out "optimizer step +in backward, unit by unit as gradients are reduced \(thread: own\)"
  grep -E "^\[rank 0\] step +[0-9]+/" "$TMP/out" | sed -E 's/.*(\| loss [0-9.]+) \|.*/\1/' >"$TMP/own.loss"
  diff "$TMP/after.loss" "$TMP/own.loss" >&2 || fail "the step in backward on its own thread trains differently"
  run "$TRAINER" "${short[@]}" --step-in-backward --clip-grad-norm 1
  expect_failure
  expect_text err "cannot clip: each unit is stepped before the total norm exists"
}

# --fused-adamw steps AdamW in one pass per parameter: the same losses to float rounding, after
# backward and in it; another optimizer is refused with it.
test_fused_adamw() {
  local short=(--layers 2 --width 64 --heads 4 --context 32 --batch-per-rank 4 --steps 6 --log-interval 1
               --eval-batches 1 --sample-bytes 0)
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${short[@]}"
  expect_rc 0
  grep -E "^\[rank 0\] step +[0-9]+/" "$TMP/out" | sed -E 's/.*\| loss ([0-9.]+) \|.*/\1/' >"$TMP/plain.loss"
  for extra in "" "--step-in-backward"; do
    run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${short[@]}" --fused-adamw $extra
    expect_rc 0
    expect_regex out "optimizer +AdamW \(fsdp::FusedAdamW\), lr"
    grep -E "^\[rank 0\] step +[0-9]+/" "$TMP/out" | sed -E 's/.*\| loss ([0-9.]+) \|.*/\1/' >"$TMP/fused.loss"
    [ "$(wc -l <"$TMP/fused.loss")" -eq 6 ] || fail "expected 6 logged steps, got $(wc -l <"$TMP/fused.loss")"
    paste "$TMP/plain.loss" "$TMP/fused.loss" |
      awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 2e-4) bad = 1 } END { exit bad }' ||
      fail "--fused-adamw $extra trains differently: $(paste "$TMP/plain.loss" "$TMP/fused.loss" | tr '\n' ' ')"
  done
  run "$TRAINER" "${short[@]}" --optimizer lamb --fused-adamw
  expect_failure
  expect_text err "is AdamW's step, but --optimizer is lamb"
}

# The optimizers that need whole parameters train, and the configuration names each; the step in
# backward is refused, naming why.
test_optimizers() {
  local -A names=([lamb]="LAMB" [adafactor]="Adafactor" [muon]="Muon \\(blocks' matrices, lr x20\\) with AdamW")
  for o in lamb adafactor muon; do
    run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${TINY[@]}" --optimizer "$o"
    expect_rc 0
    expect_regex out "optimizer +${names[$o]}, lr"
  done
  run "$TRAINER" "${TINY[@]}" --optimizer muon --step-in-backward
  expect_failure
  expect_text err "muon needs every parameter's whole gradient"
}

test_bad_flags() {
  # Each bad value gets a message naming the flag and a non-zero exit; nothing trains.
  local cases=(
    "--layers 0|--layers"
    "--strategy FULLSHARD|--strategy"
    "--width 64 --heads 5|--heads"
    "--steps 10 --warmup 20|--warmup"
    "--no-such-flag|--no-such-flag"
    "--batch-per-rank 8 --grad-accum 3|--grad-accum"
    "--global-batch 12 --batch-size 8|--batch-size 8 does not divide the 12 sequences per rank"
    "--global-batch 12|the micro-batch 8 (--batch-per-rank / --grad-accum); pass a --batch-size"
    "--global-batch 8 --batch-per-rank 4|--global-batch"
    "--batch-size 2 --grad-accum 2|--grad-accum"
    "--global-batch 6 --grad-accum 4|--grad-accum 4 does not divide the 6 sequences per rank"
    "--steps 3 --stop-after 10|--stop-after: 10 is past --steps 3"
    "--save-dir /proc/no-such-dir|--save-dir /proc/no-such-dir: cannot make"
    "--mixed-precision fp8|--mixed-precision"
    "--reshard-after-forward sometimes|--reshard-after-forward"
    "--clip-grad-norm -1|--clip-grad-norm"
    "--quantize-all-gather int8 --quantize-error-feedback|--quantize-error-feedback"
    "--quantize-block 64|--quantize-block"
    "--measure-exposed-comm|--metrics-file"
    "--deterministic --quantize-all-gather int8|drop --quantize-all-gather and --quantize-reduce, or --deterministic"
    "--plan-trace|--plan-trace"
    "--memory-margin 0.2|--memory-margin"
    "--plan --memory-budget 0x10|--memory-budget"
  )
  for c in "${cases[@]}"; do
    local flags=${c%|*} name=${c#*|}
    # shellcheck disable=SC2086  # the flags are split on purpose
    run "$TRAINER" $flags
    expect_failure
    grep -qF -- "$name" "$TMP/err" || fail "'fsdp_gpt $flags': the error does not name $name"
    grep -q "^fsdp_gpt configuration" "$TMP/out" && fail "'fsdp_gpt $flags' started training"
  done
  # With 2 ranks under fsdp-run: reported once, and the launcher fails.
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" --layers 0
  expect_failure
  [ "$(grep -c -- "--layers" "$TMP/err")" -eq 1 ] || fail "the bad flag is not reported exactly once"
  # A global batch that does not split over the ranks names the world size.
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" --global-batch 7
  expect_failure
  expect_text err "--global-batch 7 does not split evenly over 2 ranks"
}

# The training controls together (bf16 mixed precision, 2 micro-batches with no_sync, clipping,
# every block but the last resharded after forward, activation checkpointing): the configuration shows them, and the run
# trains as the plain one does (the loss falls by over a nat, the sample is generated).
test_training_controls() {
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${TINY[@]}" --mixed-precision bf16 \
      --grad-accum 2 --clip-grad-norm 1.0 --reshard-after-forward except-last --activation-checkpointing
  expect_rc 0
  expect_regex out "activation checkpointing +every block"
  check_training_output "[rank 0] " 2 "RANK, WORLD_SIZE from fsdp-run or torchrun"
  expect_regex out "mixed precision +bf16 gathers and compute, float32 reduction and master weights"
  expect_regex out "grad accumulation +2 micro-batches of 4 per step \(no-sync: all but the last without communication\)"
  expect_regex out "gradient clipping +total 2-norm 1.000"
  expect_regex out "reshard after forward +except-last"
}

# Quantized communication (int8 all-gathers and reduce-scatters) over a modeled network: the
# configuration says so, the run trains as the plain one does, and the modeled bytes are reported.
test_quantized_communication() {
  FSDP_NETWORK_MODEL="gbps=10" run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${TINY[@]}" \
      --quantize-all-gather int8 --quantize-reduce int8 --quantize-block 64
  expect_rc 0
  check_training_output "[rank 0] " 2 "RANK, WORLD_SIZE from fsdp-run or torchrun"
  expect_regex out "quantized communication +all-gathers int8, reductions int8, 64 values per scale"
  expect_regex out "modeled network, bytes rank 0 sent per step: all-gathers [0-9.]+ MB, reduce-scatters [0-9.]+ MB"
  # NO_SHARD's all-reduce quantized (every unit but the root), with error feedback.
  FSDP_NETWORK_MODEL="gbps=10" run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${TINY[@]}" \
      --strategy NO_SHARD --quantize-reduce int8 --quantize-error-feedback
  expect_rc 0
  check_training_output "[rank 0] " 2 "RANK, WORLD_SIZE from fsdp-run or torchrun"
  expect_regex out "quantized communication +all-gathers none, reductions int8 with error feedback, 256 values per scale"
}

# --quantization-report: after training, a table per kind of collective with each parameter's
# relative error per block size; the root unit's parameters are not quantized; over all the
# quantized ones int8's error is small but not zero, and smaller with smaller blocks. One rank
# quantizes nothing, which the flag says.
test_quantization_report() {
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${TINY[@]}" --quantization-report 32,1024
  expect_rc 0
  expect_regex out "quantization error, int8 all-gathers: "
  expect_regex out "quantization error, int8 reductions: "
  expect_regex out "^\[rank 0\] \| token_embedding.weight \| not quantized \| not quantized \|$"
  expect_regex out "^\[rank 0\] \| blocks.1.mlp.fc.weight \| [0-9.]+e-[0-9]+ \| [0-9.]+e-[0-9]+ \|$"
  local rows
  rows=$(grep -E "^\[rank 0\] \| all quantized parameters \|" "$TMP/out" | head -2 |
         sed -E 's/.*parameters \| ([^ ]+) \| ([^ ]+) \|$/\1 \2/')
  [ "$(wc -l <<<"$rows")" -eq 2 ] || fail "no 'all quantized parameters' row for gathers and reductions"
  while read -r small large; do
    less_than 1e-4 "$small" && less_than "$small" "$large" && less_than "$large" 0.05 ||
      fail "int8 relative errors out of bounds: block 32 $small, block 1024 $large"
  done <<<"$rows"
  # NO_SHARD gathers nothing: its gathers' table says so.
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${TINY[@]}" --strategy NO_SHARD \
      --quantization-report 256
  expect_rc 0
  expect_regex out "^\[rank 0\] \| blocks.1.mlp.fc.weight \| not quantized \|$"
  expect_regex out "^\[rank 0\] \| all quantized parameters \| none \|$"
  run "$TRAINER" "${TINY[@]}" --quantization-report 256
  expect_failure
  expect_text err "a world of one rank moves nothing and quantizes nothing"
}

# The other accumulation modes train, and the configuration names each; replica-deferred needs
# HYBRID_SHARD and says so.
test_grad_accum_modes() {
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${TINY[@]}" --grad-accum 2 \
      --grad-accum-mode no-sync-unsharded
  expect_rc 0
  check_training_output "[rank 0] " 2 "RANK, WORLD_SIZE from fsdp-run or torchrun"
  expect_regex out "grad accumulation +2 micro-batches .*no-sync-unsharded: all but the last without communication, parameters kept unsharded"
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${TINY[@]}" --grad-accum 2 --grad-accum-mode reduce
  expect_rc 0
  expect_regex out "grad accumulation +2 micro-batches .*reduce: every one reduce-scattered"
  run "$LAUNCHER" --nproc-per-node 4 --master-port "$PORT" "$TRAINER" "${TINY[@]}" --grad-accum 2 \
      --grad-accum-mode replica-deferred --strategy HYBRID_SHARD --sharding-factor 2
  expect_rc 0
  check_training_output "[rank 0] " 4 "RANK, WORLD_SIZE from fsdp-run or torchrun"
  expect_regex out "replica-deferred: every one reduce-scattered in the shard group, the replica all-reduce on the last"
  run "$TRAINER" "${TINY[@]}" --grad-accum 2 --grad-accum-mode replica-deferred
  expect_failure
  expect_text err "replica-deferred needs --strategy HYBRID_SHARD"
  # With --global-batch, --grad-accum splits each rank's share of it.
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" --layers 2 --width 64 --heads 4 --context 32 \
      --steps 2 --log-interval 1 --eval-batches 1 --sample-bytes 0 --global-batch 16 --grad-accum 4
  expect_rc 0
  expect_regex out "grad accumulation +4 micro-batches of 2 "
}

# Blocks kept sharded over pairs of ranks between forward and backward (hpZ) at world 4: the
# configuration says so and the run trains as the plain one does. A size that does not divide the
# world is refused on every rank, naming the option.
test_reshard_after_forward_size() {
  run "$LAUNCHER" --nproc-per-node 4 --master-port "$PORT" "$TRAINER" "${TINY[@]}" --reshard-after-forward-size 2
  expect_rc 0
  check_training_output "[rank 0] " 4 "RANK, WORLD_SIZE from fsdp-run or torchrun"
  expect_regex out "reshard after forward +the strategy's choice, then sharded over groups of 2 ranks until backward"
  run "$LAUNCHER" --nproc-per-node 4 --master-port "$PORT" "$TRAINER" "${TINY[@]}" --reshard-after-forward-size 3
  expect_failure
  expect_text err "reshard_after_forward_size must divide the shard group's size 4"
}

test_missing_data() {
  run "$TRAINER" --data "$TMP/no-such-file.txt"
  expect_failure
  expect_text err "--data"
  expect_text err "no-such-file.txt"
  # A file too short for the context is refused with a clear message, not a crash.
  printf 'too short\n' >"$TMP/short.txt"
  run "$TRAINER" --data "$TMP/short.txt"
  expect_failure
  expect_text err "Use a longer text or a shorter context"
}

# --malloc keep (the default) keeps glibc's heap between steps: after the first steps none
# faults its memory in again. The control trims the heap after every free (MALLOC_TRIM_THRESHOLD_=0,
# which takes precedence over the flag): the same model then faults thousands of pages per step.
test_malloc_keeps_the_heap() {
  local model=(--layers 4 --width 512 --heads 8 --context 128 --batch-per-rank 4 --steps 12 --log-interval 4
               --eval-batches 1 --sample-bytes 0)
  run "$TRAINER" "${model[@]}" --metrics-file "$TMP/keep.jsonl"
  expect_rc 0
  expect_regex out "^  malloc +heap kept between steps \(--malloc keep"
  local keep trim
  mapfile -t keep < <(grep -oE '"page_faults_per_step":[0-9.e+-]+' "$TMP/keep.jsonl" | cut -d: -f2)
  run env MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=0 "$TRAINER" "${model[@]}" --metrics-file "$TMP/trim.jsonl"
  expect_rc 0
  expect_regex out "^  malloc +glibc's, as the environment sets them \(MALLOC_MMAP_THRESHOLD_\)$"
  mapfile -t trim < <(grep -oE '"page_faults_per_step":[0-9.e+-]+' "$TMP/trim.jsonl" | cut -d: -f2)
  echo "minor page faults per step by window: kept ${keep[*]}; trimmed ${trim[*]}"
  # Windows: step 1, steps 2-4 (the heap still growing), 5-8 and 9-12.
  [ "${#keep[@]}" -eq 4 ] && [ "${#trim[@]}" -eq 4 ] || fail "expected 4 windows of page faults per step"
  less_than 1000 "${trim[3]}" || fail "the trimmed heap faulted ${trim[3]} pages per step; the case needs a model that trims"
  # Steps 5-8 may still grow the heap once (an arena's first few pages); by steps 9-12 it has settled.
  less_than "${keep[3]}" 100 || fail "the kept heap faulted ${keep[3]} pages per step in steps 9-12"
  less_than "$(awk -v k="${keep[2]}" 'BEGIN { print k * 10 }')" "${trim[2]}" ||
    fail "the kept heap faulted ${keep[2]} pages per step in steps 5-8, not a tenth of the trimmed ${trim[2]}"
}

# A text file as --data: the trainer reads it instead of the fortunes.
test_data_file_single_process() {
  for i in $(seq 3000); do echo "Line $i: the quick brown fox jumps over the lazy dog."; done >"$TMP/text.txt"
  run "$TRAINER" "${TINY[@]}" --data "$TMP/text.txt"
  expect_rc 0
  check_training_output "" 1 "no launcher"
  grep -qE "^  data +$TMP/text.txt$" "$TMP/out.rank0" || fail "the data row does not name the file"
}

# srun's environment, set by hand: two "nodes" of one task each (SLURM_STEP_TASKS_PER_NODE=1(x2)),
# as srun -N2 -n2 would set it, both on this host. The ranks must see one local rank each.
test_slurm_environment() {
  for r in 0 1; do
    SLURM_PROCID=$r SLURM_NTASKS=2 SLURM_LOCALID=0 SLURM_NODEID=$r SLURM_STEP_TASKS_PER_NODE="1(x2)" \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT "$TRAINER" "${TINY[@]}" >"$TMP/out.$r" 2>"$TMP/err.$r" &
  done
  local codes=()
  for job in $(jobs -p); do
    wait "$job"
    codes+=($?)
  done
  cp "$TMP/out.0" "$TMP/out"
  cat "$TMP/err.0" "$TMP/err.1" >"$TMP/err"
  [ "${codes[*]}" = "0 0" ] || fail "exit codes ${codes[*]}"
  [ ! -s "$TMP/out.1" ] || fail "rank 1 printed to stdout"
  check_training_output "" 2 "SLURM_\* from srun"
  grep -qE "^  world size +2 \(1 on this host" "$TMP/out" || fail "SLURM_STEP_TASKS_PER_NODE was not read"
}

test_mpirun() {
  command -v mpirun >/dev/null || { echo "SKIP: mpirun is not installed (apt-get install openmpi-bin)"; exit 77; }
  run mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT="$PORT" -x OMP_NUM_THREADS \
      "$TRAINER" "${TINY[@]}"
  expect_rc 0
  check_training_output "" 2 "OMPI_COMM_WORLD_\* from mpirun"
}

# torchrun from Debian's python3-torch (1.13 on bookworm). Its default '--redirects 0 --tee 0' crash on
# Python 3.11 (Std.from_str("0") returns None: 3.11 no longer iterates the zero flag), so pass
# '--redirects 1 --tee 1' (stdout also to a log file in a temporary directory, and to the console).
test_torchrun() {
  command -v torchrun >/dev/null || { echo "SKIP: torchrun is not installed (apt-get install python3-torch)"; exit 77; }
  # torchrun's rendezvous (2.4 and later) asks TCPStore for its libuv backend whatever USE_LIBUV
  # says; a PyTorch built without libuv (Debian trixie's 2.6) cannot start any torchrun job.
  local probe python
  python=$(sed -n '1s/^#! *//p' "$(command -v torchrun)")  # the interpreter torchrun runs under
  if ! probe=$(${python:-python3} -c 'from torch.distributed import TCPStore; TCPStore("127.0.0.1", 0, 1, True)' 2>&1) &&
      grep -q "without libuv" <<<"$probe"; then
    echo "SKIP: this torchrun cannot start a job: its TCPStore asks for libuv, which this PyTorch lacks ($(tail -n 1 <<<"$probe"))"
    exit 77
  fi
  run torchrun --standalone --nproc_per_node 2 --redirects 1 --tee 1 --log_dir "$TMP/torchrun_logs" \
      --no_python "$TRAINER" "${TINY[@]}"
  expect_rc 0
  # torchrun prefixes each line of local rank 0 with "[default0]:".
  grep '^\[default0\]:' "$TMP/out" | sed 's/^\[default0\]://' >"$TMP/out.torchrun"
  mv "$TMP/out.torchrun" "$TMP/out"
  check_training_output "" 2 "RANK, WORLD_SIZE from fsdp-run or torchrun"
}

run_cases "$@"
