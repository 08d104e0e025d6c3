#!/usr/bin/env bash
# Planner tests for the example trainer fsdp_gpt: --plan prints a table for a cluster and exits;
# --memory-budget trains with the fastest planned configuration that fits, and refuses a budget
# nothing fits, naming the smallest; --calibrate plans with this machine's measured times.
#
#   fsdp_gpt_plan_test.sh PATH/TO/fsdp_gpt PATH/TO/fsdp-run [CASE...]
#
# Each test_<name> function is one case; with no CASE, all run. CMake registers every
# test_<name> as the ctest test gpt.<name>. Exit 0 = pass, 1 = fail.
set -u

# shellcheck source=gpt_test_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpt_test_common.sh"

SMALL=(--layers 2 --width 64 --heads 4 --context 32 --batch-per-rank 4 --steps 4 --log-interval 2
       --eval-batches 1 --sample-bytes 0)

test_memory_budget_resume_plans_the_checkpoints_batch() {
  # A resumed run keeps its checkpoint's global batch (6 here, 3 sequences per rank): the plan is
  # for that batch, not for --batch-per-rank's 8.
  local base=(--layers 2 --width 64 --heads 4 --context 32 --steps 4 --log-interval 2 --eval-batches 1
    --sample-bytes 0)
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${base[@]}" --global-batch 6 \
    --stop-after 2 --save-dir "$TMP/ckpt"
  expect_rc 0
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${base[@]}" --batch-per-rank 4 \
    --save-dir "$TMP/ckpt" --resume --memory-budget 1GiB --plan-file "$TMP/plan.jsonl"
  expect_rc 0
  expect_regex out "^\[rank 0\] step +4/4 \| loss "
  local micro accumulation
  micro=$(grep -oE '"micro_batch":[0-9]+' "$TMP/plan.jsonl" | cut -d: -f2)
  accumulation=$(grep -oE '"accumulation":[0-9]+' "$TMP/plan.jsonl" | cut -d: -f2)
  [ -n "$micro" ] && [ $((micro * accumulation)) = 3 ] ||
    fail "the resumed run's plan takes ${micro:-?} x ${accumulation:-?} sequences per rank, not the checkpoint's 3"
}

test_plan_paper_cluster() {
  run "$TRAINER" "${SMALL[@]}" --plan --cluster a100-80g:64x8 --memory-budget 70GiB
  expect_rc 0
  expect_text out "Plan for A100-80GB: 64 nodes x 8 ranks"
  expect_text out "| # | configuration | params MiB | grads MiB | optimizer MiB | activations MiB |"
  expect_regex out "^\| 1 \| [A-Z_]+.*, micro-batch [0-9]+ x [0-9]+[a-z_ -]* \|.*\| yes \|"
  expect_regex out "^best: "
  # Every strategy and both precisions are candidates, hpZ over one node, and accumulation without
  # communication (the parameters kept unsharded or not) or with the replica all-reduce at the last
  # micro-batch only.
  for what in FULL_SHARD SHARD_GRAD_OP NO_SHARD HYBRID_SHARD/8 bf16 fp32 checkpointed offload \
    "reshard to groups of 8" "x 2 no_sync" "x 2 no_sync unsharded" "x 2 replica-deferred"; do
    expect_text out "$what"
  done
}

test_checkpointed_blocks() {
  # The first block of two checkpointed: the same parameters as no checkpointing (recomputation
  # repeats the same operators), the run says which blocks, and its plan entry is that candidate.
  local hash_of='s/^\[rank 0\] final parameter hash ([0-9a-f]{16})$/\1/p'
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}"
  expect_rc 0
  local plain
  plain=$(sed -nE "$hash_of" "$TMP/out")
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --activation-checkpointing \
    --checkpointed-blocks 1 --plan-file "$TMP/plan.jsonl"
  expect_rc 0
  expect_text out "the first 1 blocks (recomputed in backward)"
  [ -n "$plain" ] && [ "$(sed -nE "$hash_of" "$TMP/out")" = "$plain" ] ||
    fail "the first block checkpointed trained other parameters than none"
  grep -q '"checkpointed_units":1' "$TMP/plan.jsonl" && grep -q 'checkpointed first 1' "$TMP/plan.jsonl" ||
    fail "the plan entry is not the first block checkpointed: $(cat "$TMP/plan.jsonl")"
  run "$TRAINER" "${SMALL[@]}" --checkpointed-blocks 1
  expect_failure
  expect_text err "--checkpointed-blocks: says how many blocks --activation-checkpointing checkpoints"
  run "$TRAINER" "${SMALL[@]}" --activation-checkpointing --checkpointed-blocks 3
  expect_failure
  expect_text err "3 is more than the model's 2 blocks (--layers)"
}

test_plan_nothing_fits() {
  run "$TRAINER" "${SMALL[@]}" --plan --memory-budget 1MiB
  expect_rc 0
  expect_regex out "^nothing fits in 1.00 MiB per rank; the smallest needs [0-9.]+ (MiB|GiB)$"
}

test_memory_budget_trains() {
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --memory-budget 1GiB
  expect_rc 0
  expect_regex out "^\[rank 0\] planned for 1.00 GiB per rank: .*; predicted peak [0-9.]+ MiB"
  expect_regex out "^\[rank 0\] step +4/4 \| loss "
}

test_memory_budget_refuses_another_devices_cluster() {
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --cluster h100:1x2 \
    --memory-budget 1GiB
  expect_failure
  expect_text err "--cluster h100:1x2 plans for H100-80GB devices, but this job trains on cpu"
}

test_memory_budget_too_small() {
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --memory-budget 1MiB
  expect_failure
  expect_regex err "no configuration fits in 1.00 MiB per rank on .*; the smallest needs [0-9.]+ MiB"
  [ "$(grep -c "no configuration fits" "$TMP/err")" -eq 1 ] || fail "nothing fitting is not reported exactly once"
}

test_plan_calibrated() {
  # Every rank times the model first; the saved times plan again without measuring.
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --memory-budget 1GiB \
    --calibrate --calibration-file "$TMP/calibration.json"
  expect_rc 0
  expect_regex out "^\[rank 0\] planned for 1.00 GiB per rank: .*; predicted peak [0-9.]+ MiB"
  expect_regex out "^\[rank 0\] step +4/4 \| loss "
  grep -q '"precision": "fp32"' "$TMP/calibration.json" || fail "no fp32 timing in the calibration file"
  grep -q '"precision": "bf16"' "$TMP/calibration.json" || fail "no bf16 timing in the calibration file"
  grep -qE '"link_gbps": (0\.0*[1-9]|[1-9])' "$TMP/calibration.json" || fail "no measured link in the calibration file"
  grep -q '"runtime"' "$TMP/calibration.json" || fail "no runtime timing in the calibration file"
  grep -q '"world": 2' "$TMP/calibration.json" || fail "the runtime timing does not name its world"
  run "$TRAINER" "${SMALL[@]}" --plan --calibration-file "$TMP/calibration.json"
  expect_rc 0
  expect_regex out "^best: "
  expect_text out "runtime timing was made at world 2, not 1"
  # A run wrapped otherwise than the timed copy still predicts from that timing.
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --wrap none \
    --plan-file "$TMP/plan.jsonl" --calibration-file "$TMP/calibration.json"
  expect_rc 0
  grep -q '"configuration":"FULL_SHARD, wrap none' "$TMP/plan.jsonl" || fail "no prediction for the wrap none run"
  run "$TRAINER" "${SMALL[@]}" --plan --calibrate --cluster a100-80g:1x8
  expect_failure
  expect_text err "--cluster a100-80g:1x8 plans for another"
}

test_plan_file_replica_deferred() {
  # A HYBRID_SHARD run that reduces across replicas at its last micro-batch only is predicted as such.
  run "$LAUNCHER" --nproc-per-node 4 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --strategy HYBRID_SHARD \
    --sharding-factor 2 --grad-accum 2 --grad-accum-mode replica-deferred --plan-file "$TMP/plan.jsonl"
  expect_rc 0
  expect_regex out "^\[rank 0\] step +4/4 \| loss "
  grep -q '"configuration":"HYBRID_SHARD/2, wrap block, fp32, micro-batch 2 x 2 replica-deferred"' "$TMP/plan.jsonl" ||
    fail "no replica-deferred prediction in the plan file: $(cat "$TMP/plan.jsonl")"
  grep -q '"replica_deferred":true' "$TMP/plan.jsonl" || fail "the plan file does not say replica_deferred"
}

test_plan_file_no_sync_unsharded() {
  # Micro-batches that keep the parameters unsharded between them are predicted as such.
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --grad-accum 2 \
    --grad-accum-mode no-sync-unsharded --plan-file "$TMP/plan.jsonl"
  expect_rc 0
  expect_regex out "^\[rank 0\] step +4/4 \| loss "
  grep -q '"configuration":"FULL_SHARD, wrap block, fp32, micro-batch 2 x 2 no_sync unsharded"' "$TMP/plan.jsonl" ||
    fail "no no_sync unsharded prediction in the plan file: $(cat "$TMP/plan.jsonl")"
  grep -q '"keep_unsharded":true' "$TMP/plan.jsonl" || fail "the plan file does not say keep_unsharded"
  grep -q '"not_modeled":\[\]' "$TMP/plan.jsonl" || fail "the plan file names flags it leaves out"
  if grep -qF "the plan leaves out" "$TMP/out"; then fail "the run names flags its plan leaves out"; fi
}

test_plan_file_reshard_policy() {
  # A run whose blocks reshard after forward by --reshard-after-forward is predicted with that policy.
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --reshard-after-forward except-last \
    --plan-file "$TMP/plan.jsonl"
  expect_rc 0
  expect_regex out "^\[rank 0\] step +4/4 \| loss "
  grep -q '"configuration":"FULL_SHARD, reshard after forward by policy, wrap block, fp32, micro-batch 4 x 1"' \
    "$TMP/plan.jsonl" || fail "no prediction with the policy in the plan file: $(cat "$TMP/plan.jsonl")"
  grep -q '"not_modeled":\[\]' "$TMP/plan.jsonl" || fail "the plan file names flags it leaves out"
  if grep -qF "the plan leaves out" "$TMP/out"; then fail "the run names flags its plan leaves out"; fi
}

test_plan_names_what_it_leaves_out() {
  # Quantized collectives, error feedback's residuals and the step in backward are planned for; flags
  # the planner does not model are named beside the table and in every prediction.
  run "$TRAINER" "${SMALL[@]}" --plan --cluster a100-80g:1x8 --quantize-all-gather int8 --quantize-reduce int8 \
    --quantize-error-feedback --step-in-backward --plan-file "$TMP/plan.jsonl"
  expect_rc 0
  if grep -qF "the plan leaves out" "$TMP/out"; then fail "the plan names flags it models"; fi
  expect_regex out "^best: .*, int8 gathers, int8 reductions with error feedback"
  grep -q '"configuration":"[^"]*, step in backward' "$TMP/plan.jsonl" || fail "no step in backward in the plan"
  grep -q '"not_modeled":\[\]' "$TMP/plan.jsonl" || fail "the plan file names flags it models"
  run "$TRAINER" "${SMALL[@]}" --plan --cluster a100-80g:1x8 --step-in-backward --step-thread own \
    --plan-file "$TMP/plan.jsonl"
  expect_rc 0
  expect_text out "the plan leaves out --step-in-backward with its own thread: the planner does not model it"
  local entries named
  entries=$(wc -l <"$TMP/plan.jsonl")
  named=$(grep -c '"not_modeled":\["--step-in-backward with its own thread"\]' "$TMP/plan.jsonl")
  [ "$entries" -gt 0 ] && [ "$named" = "$entries" ] || fail "$named of $entries predictions name the flag left out"
}

test_plan_file_step_in_backward() {
  # The step in backward drops the pieces' gradients, and with micro-batches steps in the last one
  # (NO_SHARD in float32: accumulating in the FlatParameter's own storage): predicted to the byte
  # as the run holds them.
  local flags configuration predicted measured
  for flags in "" "--strategy NO_SHARD --grad-accum 2"; do
    configuration="FULL_SHARD, wrap block, fp32, micro-batch 4 x 1, step in backward"
    [ -n "$flags" ] && configuration="NO_SHARD, wrap block, fp32, micro-batch 2 x 2 no_sync, step in backward"
    rm -f "$TMP/plan.jsonl" "$TMP/metrics.jsonl"
    # shellcheck disable=SC2086  # $flags holds several arguments
    run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --step-in-backward $flags \
      --plan-file "$TMP/plan.jsonl" --metrics-file "$TMP/metrics.jsonl"
    expect_rc 0
    grep -qF "\"configuration\":\"$configuration\"" "$TMP/plan.jsonl" ||
      fail "no '$configuration' in the plan file: $(cat "$TMP/plan.jsonl")"
    grep -q '"not_modeled":\[\]' "$TMP/plan.jsonl" || fail "the plan file names flags it leaves out"
    predicted=$(grep -oE '"grads_bytes":[0-9]+' "$TMP/plan.jsonl" | cut -d: -f2)
    measured=$(tail -1 "$TMP/metrics.jsonl" | grep -oE '"fsdp_grad_peak_bytes":[0-9]+' | cut -d: -f2)
    [ -n "$predicted" ] && [ "$predicted" = "$measured" ] ||
      fail "$configuration: gradient peak predicted '$predicted' bytes, measured '$measured'"
  done
}

test_plan_file_deterministic() {
  # Deterministic training's exact sums, with a rank's padding pass (8 sequences in micro-batches of 4
  # over 3 ranks), and at 2 ranks with the optimizer's step in backward: both peaks predicted to the
  # byte as the run holds them.
  local world flags kind predicted measured
  for world in 3 2; do
    flags=()
    [ "$world" = 2 ] && flags=(--step-in-backward)
    rm -f "$TMP/plan.jsonl" "$TMP/metrics.jsonl"
    run "$LAUNCHER" --nproc-per-node "$world" --master-port "$PORT" "$TRAINER" "${SMALL[@]/--batch-per-rank/--batch-size}" \
      --global-batch 8 --deterministic "${flags[@]}" --plan-file "$TMP/plan.jsonl" --metrics-file "$TMP/metrics.jsonl"
    expect_rc 0
    grep -qE '"configuration":"FULL_SHARD, wrap block, fp32, micro-batch 4 x 1,( step in backward,)? deterministic"' \
      "$TMP/plan.jsonl" || fail "no deterministic prediction in the plan file: $(cat "$TMP/plan.jsonl")"
    grep -q '"not_modeled":\[\]' "$TMP/plan.jsonl" || fail "the plan file names flags it leaves out"
    for kind in params grads; do
      predicted=$(grep -oE "\"${kind}_bytes\":[0-9]+" "$TMP/plan.jsonl" | cut -d: -f2)
      measured=$(tail -1 "$TMP/metrics.jsonl" | grep -oE "\"fsdp_${kind%s}_peak_bytes\":[0-9]+" | cut -d: -f2)
      [ -n "$predicted" ] && [ "$predicted" = "$measured" ] ||
        fail "world $world: the $kind peak predicted '$predicted' bytes, measured '$measured'"
    done
  done
}

test_plan_file_error_feedback() {
  # Error feedback's residuals: predicted to the byte as the run holds them.
  run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" --quantize-reduce int8 \
    --quantize-error-feedback --plan-file "$TMP/plan.jsonl" --metrics-file "$TMP/metrics.jsonl"
  expect_rc 0
  local predicted measured
  predicted=$(grep -oE '"feedback_bytes":[0-9]+' "$TMP/plan.jsonl" | cut -d: -f2)
  measured=$(tail -1 "$TMP/metrics.jsonl" | grep -oE '"fsdp_feedback_bytes":[0-9]+' | cut -d: -f2)
  [ -n "$predicted" ] && [ "$predicted" -gt 0 ] && [ "$predicted" = "$measured" ] ||
    fail "error feedback's residuals predicted '$predicted' bytes, measured '$measured'"
  grep -q '"not_modeled":\[\]' "$TMP/plan.jsonl" || fail "the plan file names flags it leaves out"
}

test_plan_calibrated_quantization() {
  # --calibrate times the flags' quantization format once; a plan from that file charges its loops:
  # packing at a microsecond per value makes the run's predicted step a tenth of a second longer.
  local q=(--quantize-all-gather int8 --quantize-reduce int8 --quantize-error-feedback)
  run "$TRAINER" "${SMALL[@]}" "${q[@]}" --plan --calibrate --calibration-file "$TMP/calibration.json"
  expect_rc 0
  [ "$(grep -c '"pack_feedback_s"' "$TMP/calibration.json")" = 1 ] || fail "not one quantization timing"
  grep -qE '"sum_s": [0-9.]*[1-9]' "$TMP/calibration.json" || fail "no time per summed value"
  sed -E 's/"(pack_s|pack_feedback_s)": [0-9.e+-]+/"\1": 1e-06/' "$TMP/calibration.json" >"$TMP/slow.json"
  local file predicted=()
  for file in calibration slow; do
    run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" "$TRAINER" "${SMALL[@]}" "${q[@]}" \
      --plan-file "$TMP/$file.jsonl" --calibration-file "$TMP/$file.json"
    expect_rc 0
    predicted+=("$(grep -oE '"step_s":[0-9.e+-]+' "$TMP/$file.jsonl" | cut -d: -f2)")
  done
  awk -v a="${predicted[0]}" -v b="${predicted[1]}" 'BEGIN { exit !(a > 0 && b > a + 0.1) }' ||
    fail "predicted steps ${predicted[*]}: the slow packing is not charged"
}

test_plan_holds_the_optimizers_state() {
  # --optimizer's state goes into every prediction: Adafactor's factored moments below Muon's one
  # momentum for the blocks' matrices, below AdamW's two moments (or equal, where rank 0's shard
  # holds only the embedding); a step time never timed is named.
  local kind
  for kind in adamw adafactor muon; do
    run "$TRAINER" "${SMALL[@]}" --plan --cluster a100-80g:1x8 --optimizer "$kind" --plan-file "$TMP/$kind.jsonl"
    expect_rc 0
    sed -E 's/.*"configuration":"([^"]*)".*"optimizer_bytes":([0-9]+).*/\1\t\2/' "$TMP/$kind.jsonl" | sort >"$TMP/$kind.tsv"
  done
  expect_text out "the plan leaves out --optimizer muon's step time: the planner does not model it"
  # AdamW's plan also tries the step in backward, which the trainer allows AdamW only.
  grep -q ', step in backward' "$TMP/adamw.tsv" || fail "AdamW's plan tries no step in backward"
  if grep -q ', step in backward' "$TMP/adafactor.tsv" "$TMP/muon.tsv"; then fail "a step in backward planned for another optimizer"; fi
  grep -v ', step in backward' "$TMP/adamw.tsv" >"$TMP/adamw-after.tsv"
  join -t $'\t' "$TMP/adafactor.tsv" "$TMP/muon.tsv" | join -t $'\t' - "$TMP/adamw-after.tsv" >"$TMP/all.tsv"
  [ "$(wc -l <"$TMP/all.tsv")" -eq "$(wc -l <"$TMP/adamw-after.tsv")" ] || fail "the optimizers' plans have other configurations"
  # Strictly where rank 0 holds every parameter (NO_SHARD); a shard may hold only the embedding.
  awk -F '\t' '$1 !~ /offload/ && !($2 > 0 && $2 <= $3 && $3 <= $4) ||
      $1 ~ /^NO_SHARD/ && $1 !~ /offload/ && !($2 < $3 && $3 < $4) { print "optimizer bytes " $2 ", " $3 ", " $4 ": " $1; bad = 1 }
    END { exit bad }' "$TMP/all.tsv" || fail "the optimizers' states are not ordered adafactor < muon < adamw"
}

test_plan_calibrated_beneath_network_model() {
  # Under a modeled network --calibrate also times the flags' configuration on the transport beneath
  # it, and the training after it runs on the modeled network again. A saved calibration also times
  # the flags' strategy without wrapping, for plans that search the wrapping.
  FSDP_NETWORK_MODEL="gbps=1.25,ranks_per_host=1" run "$LAUNCHER" --nproc-per-node 2 --master-port "$PORT" \
    "$TRAINER" "${SMALL[@]}" --calibrate --calibration-file "$TMP/calibration.json" --plan-file "$TMP/plan.jsonl"
  expect_rc 0
  [ "$(grep -c '"beneath_network_model": true' "$TMP/calibration.json")" = 1 ] || fail "not one timing beneath the model"
  [ "$(grep -c '"beneath_network_model": false' "$TMP/calibration.json")" = 3 ] || fail "not three timings on the model"
  [ "$(grep -c '"wrap": "none"' "$TMP/calibration.json")" = 1 ] || fail "not one timing without wrapping"
  grep -qE '"link_copy_latency_us": [0-9.]*[1-9]' "$TMP/calibration.json" || fail "no latency beneath the model"
  grep -qE '"step_s":[0-9.e+-]+' "$TMP/plan.jsonl" || fail "no predicted step"
  expect_regex out "modeled network, bytes rank 0 sent per step: all-gathers [0-9.]+ MB.*links busy [0-9.]*[1-9][0-9.]* ms"
}

# configuration<TAB>activations_bytes<TAB>tflops_per_device, one line per --plan-file entry.
plan_figures() {
  sed -E 's/.*"activations_bytes":([0-9]+).*"configuration":"([^"]*)".*"tflops_per_device":([0-9.e+-]+).*/\2\t\1\t\3/' "$1" | sort
}

test_plan_trace() {
  # The traced forward and loss count what the example's rules and module_cost count: the same
  # FLOPs, and without checkpointing the same activations within 2% (the trace also sees the
  # layer norms' statistics, the attention mask and the token indices).
  run "$TRAINER" "${SMALL[@]}" --plan --cluster a100-80g:1x8 --plan-file "$TMP/rules.jsonl"
  expect_rc 0
  run "$TRAINER" "${SMALL[@]}" --plan --plan-trace --cluster a100-80g:1x8 --plan-file "$TMP/trace.jsonl"
  expect_rc 0
  expect_regex out "^best: "
  plan_figures "$TMP/rules.jsonl" >"$TMP/rules.tsv"
  plan_figures "$TMP/trace.jsonl" >"$TMP/trace.tsv"
  [ "$(wc -l <"$TMP/trace.tsv")" -gt 10 ] || fail "too few configurations in the traced plan"
  join -t $'\t' "$TMP/rules.tsv" "$TMP/trace.tsv" >"$TMP/both.tsv"
  [ "$(wc -l <"$TMP/both.tsv")" -eq "$(wc -l <"$TMP/trace.tsv")" ] || fail "the traced plan has other configurations"
  awk -F '\t' '{
      if ($5 < $3 * (1 - 1e-9) || $5 > $3 * (1 + 1e-9)) { print "TFLOP/s " $3 " by rule, " $5 " traced: " $1; bad = 1 }
      if ($1 !~ /checkpointed/ && ($4 < $2 || $4 > 1.02 * $2)) { print "activations " $2 " by rule, " $4 " traced: " $1; bad = 1 }
    } END { exit bad }' "$TMP/both.tsv" || fail "the trace and the rules disagree"
}

run_cases "$@"
