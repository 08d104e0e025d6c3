#!/usr/bin/env bash
# --deterministic figures (bench/results/determinism.md): the final parameter hash of the example
# GPT at every world size x strategy x transport, an elastic restart after a lost rank, one after a
# lost node, and the CPU time of deterministic against default mode.
#
#   bench/determinism.sh BUILD_DIR [REPEATS] [EXTRA FLAGS...]
#   PARTS=cost bench/determinism.sh BUILD_DIR [REPEATS]     # only part (4); PARTS names any of
#                                                            # hashes elastic nodes variants cost steptime
#   TRANSPORTS="shm" narrows the hash table, cost and steptime parts to those transports (default: shm tcp).
#
# Prints markdown: (1) the hash table (worlds 5 and 8 split the 12 micro-batches unevenly),
# (2) the restart's parts (kill to the launcher seeing it, to every rank stopped, to the checkpoint
# loaded, to the first step done) and its hash and losses against the uninterrupted run's, (3) bf16
# and activation checkpointing at worlds 1, 3 and 4, (4) the CPU seconds (all ranks, user + system)
# of 60 steps in both modes, FULL_SHARD world 4, over shared memory and TCP, and the median of the
# REPEATS ratios (the modes interleaved); (5) with PARTS=nodes, the
# restart after one of two fsdp-run nodes (--nnodes 1:2, 2 ranks each, on this host) is SIGKILLed
# with its ranks.
set -euo pipefail
PARTS=${PARTS:-hashes elastic nodes variants cost}
TRANSPORTS=${TRANSPORTS:-shm tcp}
part() { [[ " $PARTS " == *" $1 "* ]]; }
# shellcheck source=bench/trainer_runs.sh
source "$(dirname "$0")/trainer_runs.sh"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
MODEL=(--layers 2 --width 64 --heads 4 --context 32 --eval-batches 1 --sample-bytes 0 --global-batch 24
       --batch-size 2 --dropout 0.1 --clip-grad-norm 0.5 "${EXTRA[@]}")
DET=("${MODEL[@]}" --deterministic --steps 50 --log-interval 1)
hash_of() { sed -nE 's/^(\[rank 0\] )?final parameter hash ([0-9a-f]{16})$/\2/p' "$1"; }
losses_of() { sed -nE 's/^(\[rank 0\] )?step +([0-9]+)\/[0-9]+ \| loss ([0-9.]+) \|.*/\2 \3/p' "$1"; }
trainer() { # LOG WORLD TRANSPORT FLAGS...
  local log=$1 world=$2 transport=$3
  shift 3
  if [ "$world" -eq 1 ]; then
    FSDP_TRANSPORT=$transport "$TRAINER" "$@" >"$log" 2>&1
  else
    FSDP_TRANSPORT=$transport "$RUN" --nproc-per-node "$world" "$TRAINER" "$@" >"$log" 2>&1
  fi
}

# (1) Hashes.
against_reference() { # LOG: its final hash and logged losses against the reference run's
  local h missing
  h=$(hash_of "$1")
  missing=$(losses_of "$TMP/ref" | while read -r line; do losses_of "$1" | grep -qxF "$line" || echo "$line"; done)
  echo
  echo "Final hash \`$h\` ($([ "$h" = "$REF" ] && echo equal || echo NOT equal) to the reference);" \
    "logged losses $([ -z "$missing" ] && echo "all equal to the reference's" || echo "differ at: $missing")."
}

if part hashes || part elastic || part nodes; then
  trainer "$TMP/ref" 1 shm "${DET[@]}"
  REF=$(hash_of "$TMP/ref")
fi
if part hashes; then
  echo "Reference: one process, hash \`$REF\`."
  echo
  echo "| world | strategy | transport | final parameter hash | equal | losses equal |"
  echo "| ---: | --- | --- | --- | --- | --- |"
  for world in 2 3 4 5 6 8; do
    for strategy in FULL_SHARD SHARD_GRAD_OP NO_SHARD HYBRID_SHARD; do
      [ "$strategy" = HYBRID_SHARD ] && [ "$world" -ne 4 ] && [ "$world" -ne 6 ] && continue
      # World 8 (1 or 2 micro-batches per rank) once: 8 ranks on few cores are slow.
      [ "$world" -eq 8 ] && [ "$strategy" != FULL_SHARD ] && continue
      for transport in $TRANSPORTS; do
        [ "$world" -eq 8 ] && [ "$transport" != shm ] && continue
        flags=(--strategy "$strategy")
        [ "$strategy" = HYBRID_SHARD ] && flags+=(--sharding-factor 2)
        trainer "$TMP/run" "$world" "$transport" "${DET[@]}" "${flags[@]}" || { cat "$TMP/run" >&2; exit 1; }
        h=$(hash_of "$TMP/run")
        same=$([ "$h" = "$REF" ] && echo yes || echo NO)
        lsame=$([ "$(losses_of "$TMP/run")" = "$(losses_of "$TMP/ref")" ] && echo yes || echo NO)
        echo "| $world | $strategy | $transport | \`$h\` | $same | $lsame |"
        echo "hash: world $world $strategy $transport $h" >&2
      done
    done
  done
fi

stamp() { python3 -u -c 'import sys, time
for line in sys.stdin: print("%.3f %s" % (time.time(), line), end="")'; }

# (2) Elastic restart: 4 ranks, one SIGKILLed after a random step, fsdp-run restarts 3.
if part elastic; then
  KILL_STEP=$((12 + RANDOM % 30))
  "$RUN" --nproc-per-node 3:4 --max-restarts 1 "$TRAINER" "${DET[@]}" --save-dir "$TMP/ck" --save-every 5 --resume \
    2>&1 | stamp >"$TMP/elastic" &
  pipeline=$!
  for _ in $(seq 3000); do
    grep -qE "\] step +$KILL_STEP/" "$TMP/elastic" && break
    sleep 0.02
  done
  launcher=$(pgrep -f -n "fsdp-run --nproc-per-node 3:4")
  victim=$(pgrep -P "$launcher" | tail -n 1)
  killed_at=$EPOCHREALTIME
  kill -KILL "$victim"
  wait "$pipeline"
  at() { grep -m1 -E "$1" "$TMP/elastic" | cut -d' ' -f1; }
  seen=$(at "was killed by signal 9")
  restarting=$(at "restarting with 3 ranks")
  loaded=$(at "checkpoint: resumed from")
  resumed_step=$(grep -m1 "checkpoint: resumed from" "$TMP/elastic" | sed -E 's/.* at step ([0-9]+).*/\1/')
  # The last step logged before the kill.
  last_step=$(awk -v k="$killed_at" '$1 < k' "$TMP/elastic" | grep -E "\] step +[0-9]+/" | tail -n 1 |
    sed -E 's/.*\] step +([0-9]+)\/.*/\1/')
  first=$(awk -v t="$loaded" '$1 > t' "$TMP/elastic" | grep -m1 -E "\] step +[0-9]+/" | cut -d' ' -f1)
  sed -E 's/^[0-9.]+ //' "$TMP/elastic" >"$TMP/elastic.log"
  echo
  echo "Killed one rank of 4 (SIGKILL, pid $victim) after step $last_step was logged; the 3 ranks of the restart resumed" \
    "from the checkpoint of step $resumed_step (--save-every 5)."

  echo
  echo "| part | seconds |"
  echo "| --- | ---: |"
  awk -v k="$killed_at" -v s="$seen" -v r="$restarting" -v l="$loaded" -v f="$first" 'BEGIN {
    printf "| detection: kill to fsdp-run reporting the lost rank | %.2f |\n", s - k
    printf "| stop: to every rank stopped and the restart begun | %.2f |\n", r - s
    printf "| restart and load: to the newest checkpoint loaded on 3 ranks | %.2f |\n", l - r
    printf "| first step: to the first step after the restart logged | %.2f |\n", f - l
    printf "| **kill to next step** | **%.2f** |\n", f - k }'
  against_reference "$TMP/elastic.log"

fi

# (3) Variants: mixed precision and activation checkpointing, each against its own one-process run.
if part variants; then
  echo
  echo "| variant | world 1 hash | world 3 FULL_SHARD shm | world 4 SHARD_GRAD_OP tcp | equal |"
  echo "| --- | --- | --- | --- | --- |"
  for variant in "--mixed-precision bf16" "--activation-checkpointing" "--mixed-precision bf16 --activation-checkpointing"; do
    # shellcheck disable=SC2086  # the variant's flags are split on purpose
    trainer "$TMP/v1" 1 shm "${DET[@]}" $variant || { cat "$TMP/v1" >&2; exit 1; }
    # shellcheck disable=SC2086
    trainer "$TMP/v3" 3 shm "${DET[@]}" $variant --strategy FULL_SHARD || { cat "$TMP/v3" >&2; exit 1; }
    # shellcheck disable=SC2086
    trainer "$TMP/v4" 4 tcp "${DET[@]}" $variant --strategy SHARD_GRAD_OP || { cat "$TMP/v4" >&2; exit 1; }
    a=$(hash_of "$TMP/v1") b=$(hash_of "$TMP/v3") c=$(hash_of "$TMP/v4")
    echo "| \`$variant\` | \`$a\` | \`$b\` | \`$c\` | $([ "$a" = "$b" ] && [ "$a" = "$c" ] && echo yes || echo NO) |"
    echo "variant: $variant $a $b $c" >&2
  done

fi

# (4) Cost: deterministic against default mode, FULL_SHARD world 4: the ranks' CPU seconds
# (user + system, through fsdp-run under /usr/bin/time) for 60 steps, a 62-step run's minus a
# 2-step run's (which removes start-up); the modes alternate within each repetition.
cpu_of() { # LOG: the user + system seconds /usr/bin/time wrote last
  tail -n 1 "$1" | awk '{ printf "%.2f", $1 + $2 }'
}
if part cost; then
  declare -A C
  for ((r = 0; r < REPEATS; r++)); do
    for transport in $TRANSPORTS; do
      for mode in default deterministic; do
        flags=()
        [ "$mode" = deterministic ] && flags=(--deterministic)
        for steps in 62 2; do
          FSDP_TRANSPORT=$transport /usr/bin/time -f "%U %S" "$RUN" --nproc-per-node 4 "$TRAINER" "${MODEL[@]}" \
            --warmup 2 --log-interval 10 --steps "$steps" "${flags[@]}" >"$TMP/cost.$steps" 2>&1 ||
            { cat "$TMP/cost.$steps" >&2; exit 1; }
        done
        s=$(awk -v a="$(cpu_of "$TMP/cost.62")" -v b="$(cpu_of "$TMP/cost.2")" 'BEGIN { printf "%.2f", a - b }')
        C[$transport.$mode]="${C[$transport.$mode]:-} $s"
        echo "cost: $transport $mode $s CPU s per 60 steps" >&2
      done
      d=$(echo "${C[$transport.default]}" | awk '{ print $NF }')
      C[$transport.ratio]="${C[$transport.ratio]:-} $(awk -v a="$d" -v b="$s" 'BEGIN { printf "%.3f", b / a }')"
    done
  done
  echo
  echo "| transport | default CPU s | deterministic CPU s | median ratio | ratios | runs (default; deterministic) |"
  echo "| --- | ---: | ---: | ---: | --- | --- |"
  for transport in $TRANSPORTS; do
    a=$(echo "${C[$transport.default]}" | median)
    b=$(echo "${C[$transport.deterministic]}" | median)
    q=$(echo "${C[$transport.ratio]}" | median)
    echo "| $transport | $a | $b | $(printf %.2f "$q") |${C[$transport.ratio]} |${C[$transport.default]};${C[$transport.deterministic]} |"
  done
fi

# (6) Step time of deterministic mode against the default, world 4 FULL_SHARD: the model above
# (12 micro-batches of 2 short sequences: communication-bound) and one micro-batch of 8 sequences of
# 128 tokens per rank (compute-bound); ms/step of rank 0,
# the mean of the logged windows after the first; the modes alternate within each repetition.
if part steptime; then
  declare -A T
  WIDE=(--layers 2 --width 128 --heads 4 --context 128 --eval-batches 1 --sample-bytes 0 --global-batch 32
        --batch-size 8 --dropout 0.1 --clip-grad-norm 0.5 "${EXTRA[@]}")
  for ((r = 0; r < REPEATS; r++)); do
    for model in comm-bound compute-bound; do
      for transport in $TRANSPORTS; do
        for mode in default deterministic; do
          flags=(--steps 25 --log-interval 5 --warmup 2)
          [ "$mode" = deterministic ] && flags+=(--deterministic)
          if [ "$model" = comm-bound ]; then m=("${MODEL[@]}"); else m=("${WIDE[@]}"); fi
          trainer "$TMP/st" 4 "$transport" "${m[@]}" "${flags[@]}" || { cat "$TMP/st" >&2; exit 1; }
          ms=$(grep -E "^\[rank 0\] step +(10|15|20|25)/" "$TMP/st" | sed -E 's/.*\| +([0-9.]+) ms\/step.*/\1/' |
            awk '{ s += $1 } END { printf "%.1f", s / NR }')
          T[$model.$transport.$mode]="${T[$model.$transport.$mode]:-} $ms"
          echo "steptime: $model $transport $mode $ms ms/step" >&2
        done
        a=$(echo "${T[$model.$transport.default]}" | awk '{ print $NF }')
        T[$model.$transport.ratio]="${T[$model.$transport.ratio]:-} $(awk -v a="$a" -v b="$ms" 'BEGIN { printf "%.3f", b / a }')"
      done
    done
  done
  echo
  echo "| model | transport | default ms/step | deterministic ms/step | median ratio | ratios |"
  echo "| --- | --- | ---: | ---: | ---: | --- |"
  for model in comm-bound compute-bound; do
    for transport in $TRANSPORTS; do
      a=$(echo "${T[$model.$transport.default]}" | median)
      b=$(echo "${T[$model.$transport.deterministic]}" | median)
      q=$(echo "${T[$model.$transport.ratio]}" | median)
      echo "| $model | $transport | $a | $b | $(printf %.2f "$q") |${T[$model.$transport.ratio]} |"
    done
  done
fi

# (5) Elastic across nodes: two fsdp-run "nodes" of 2 ranks on this host; node 1's fsdp-run and its
# ranks SIGKILLed after a random step; node 0 restarts alone (world 2).
if part nodes; then
  KILL_STEP=$((12 + RANDOM % 30))
  port=$((20000 + RANDOM % 12000))  # below the ephemeral range
  export FSDP_JOB_TOKEN=determinism-bench-nodes-0123456789
  nodes=(--nnodes 1:2 --nproc-per-node 2 --max-restarts 1 --master-port "$port" --node-timeout 3)
  job=("$TRAINER" "${DET[@]}" --save-dir "$TMP/nck" --save-every 5 --resume)
  "$RUN" --node-rank 0 "${nodes[@]}" "${job[@]}" 2>&1 | stamp >"$TMP/node0" &
  pipeline=$!
  "$RUN" --node-rank 1 "${nodes[@]}" "${job[@]}" >"$TMP/node1" 2>&1 &
  node1=$!
  for _ in $(seq 3000); do
    grep -qE "\] step +$KILL_STEP/" "$TMP/node0" && break
    sleep 0.02
  done
  killed_at=$EPOCHREALTIME
  # shellcheck disable=SC2046  # one pid per word
  kill -KILL "$node1" $(pgrep -P "$node1")
  wait "$pipeline"
  at() { grep -m1 -E "$1" "$TMP/node0" | cut -d' ' -f1; }
  # Node 0's first word on the failure: one of its ranks failing (a peer died), or node 1's
  # missing heartbeat.
  detected="fsdp-run: (rank [0-9]+ \(pid|node 1 sent no heartbeat)"
  seen=$(at "$detected")
  round=$(at "rendezvous 1:")
  loaded=$(at "checkpoint: resumed from")
  resumed_step=$(grep -m1 "checkpoint: resumed from" "$TMP/node0" | sed -E 's/.* at step ([0-9]+).*/\1/')
  last_step=$(awk -v k="$killed_at" '$1 < k' "$TMP/node0" | grep -E "\] step +[0-9]+/" | tail -n 1 |
    sed -E 's/.*\] step +([0-9]+)\/.*/\1/')
  first=$(awk -v t="$loaded" '$1 > t' "$TMP/node0" | grep -m1 -E "\] step +[0-9]+/" | cut -d' ' -f1)
  why=$(grep -m1 -E "$detected" "$TMP/node0" | sed -E 's/^[0-9.]+ fsdp-run: //')
  sed -E 's/^[0-9.]+ //' "$TMP/node0" >"$TMP/node0.log"
  echo
  echo "Killed node 1's fsdp-run and its 2 ranks (SIGKILL) after step $last_step was logged; node 0 said" \
    "\`$why\`; its 2 ranks resumed from the checkpoint of step $resumed_step (--save-every 5)."
  echo
  echo "| part | seconds |"
  echo "| --- | ---: |"
  awk -v k="$killed_at" -v s="$seen" -v r="$round" -v l="$loaded" -v f="$first" 'BEGIN {
    printf "| detection: kill to node 0 reporting the failure | %.2f |\n", s - k
    printf "| stop and rendezvous: to rendezvous 1 closed with node 0 alone | %.2f |\n", r - s
    printf "| restart and load: to the newest checkpoint loaded on 2 ranks | %.2f |\n", l - r
    printf "| first step: to the first step after the restart logged | %.2f |\n", f - l
    printf "| **kill to next step** | **%.2f** |\n", f - k }'
  against_reference "$TMP/node0.log"
fi
