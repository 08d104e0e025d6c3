#!/usr/bin/env bash
# Soak run (a benchmark, not CI): the example GPT trains at world 4 for DURATION seconds; every
# KILL_EVERY seconds (jittered +-25%) one rank, drawn at random, gets SIGKILL, the job must end,
# and it is restarted with --resume from its newest complete checkpoint. Checks, per restart: the
# launcher and every rank exit (seconds to exit), no fsdp_gpt process and no /dev/shm segment of
# ours is left; over the run: RSS (sum over ranks) and /dev/shm sampled every SAMPLE_S seconds,
# and the losses of steps trained twice (after the last checkpoint before a kill, then again after
# the resume) compared.
#
#   bench/soak.sh BUILD_DIR OUT_DIR
#
# Environment: DURATION (default 1800), KILL_EVERY (180), SAMPLE_S (5), WORLD (4), SAVE_EVERY
# (50 steps), LOG_INTERVAL (10 steps), SEED (1), TRANSPORT (FSDP_TRANSPORT, default auto), and TRAINER_FLAGS (model flags,
# default "--layers 4 --width 128 --heads 4 --context 64 --batch-per-rank 8").
# Checkpoints go to OUT_DIR/checkpoints (the newest 3 kept; removed at the end).
# Writes OUT_DIR/samples.csv, OUT_DIR/restarts.csv, OUT_DIR/metrics-<k>.jsonl, OUT_DIR/run-<k>.log
# and OUT_DIR/soak.md (bench/soak_report.py); bench/results/soak keeps only soak.md.
set -euo pipefail
BUILD=$(cd "${1:?usage: $0 BUILD_DIR OUT_DIR}" && pwd)
OUT=${2:?usage: $0 BUILD_DIR OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DURATION=${DURATION:-1800}
KILL_EVERY=${KILL_EVERY:-180}
SAMPLE_S=${SAMPLE_S:-5}
WORLD=${WORLD:-4}
SAVE_EVERY=${SAVE_EVERY:-50}
SEED=${SEED:-1}
LOG_INTERVAL=${LOG_INTERVAL:-10}
export FSDP_TRANSPORT=${TRANSPORT:-auto}
read -r -a MODEL <<<"${TRAINER_FLAGS:---layers 4 --width 128 --heads 4 --context 64 --batch-per-rank 8}"
TRAINER=$BUILD/examples/gpt/fsdp_gpt
RUN=$BUILD/tools/fsdp-run
CKPT=$OUT/checkpoints
rm -rf "$CKPT" "$OUT"/metrics-*.jsonl "$OUT"/run-*.log
RANDOM=$SEED
export OMP_NUM_THREADS=1

shm_count() { find /dev/shm -maxdepth 1 -name 'fsdp-*' 2>/dev/null | wc -l; }
shm_bytes() { du -sb /dev/shm 2>/dev/null | cut -f1; }
# Shared memory in use on the machine, mapped-but-unlinked segments included.
shmem_kib() { awk '/^Shmem:/ { print $2 }' /proc/meminfo; }
# Pids of the running trainer ranks.
rank_pids() { pgrep -x fsdp_gpt || true; }
# Keeps the newest 3 checkpoints (by name: step-NNNNNNNN) and the saves in progress.
prune() {
  ls -d "$CKPT"/step-* 2>/dev/null | grep -v '\.tmp-' | sort | head -n -3 | xargs -r rm -rf
}
rss_kib() {
  local total=0 pid kib
  for pid in $(rank_pids); do
    kib=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || echo 0)
    total=$((total + ${kib:-0}))
  done
  echo "$total"
}

echo "t_s,segment,ranks,rss_kib,shm_segments,shm_bytes,shmem_kib" >"$OUT/samples.csv"
echo "segment,started_s,killed_s,victim_rank,launcher_exit,exit_seconds,procs_left,shm_left,resumed_from" \
  >"$OUT/restarts.csv"
start=$SECONDS
segment=0
while ((SECONDS - start < DURATION)); do
  segment=$((segment + 1))
  seg_start=$((SECONDS - start))
  "$RUN" --nproc-per-node "$WORLD" --master-port $((29600 + segment % 50)) --grace-seconds 2 "$TRAINER" \
    "${MODEL[@]}" --steps 100000000 --schedule constant --warmup 0 --seed "$SEED" --log-interval "$LOG_INTERVAL" \
    --sample-bytes 0 --save-dir "$CKPT" --save-every "$SAVE_EVERY" --resume \
    --metrics-file "$OUT/metrics-$segment.jsonl" >"$OUT/run-$segment.log" 2>&1 &
  launcher=$!
  left=$((DURATION - (SECONDS - start)))
  span=$((KILL_EVERY * 3 / 4 + RANDOM % (KILL_EVERY / 2 + 1)))
  ((span > left)) && span=$left
  until_kill=$((SECONDS + span))
  while ((SECONDS < until_kill)) && kill -0 "$launcher" 2>/dev/null; do
    echo "$((SECONDS - start)),$segment,$(rank_pids | wc -w),$(rss_kib),$(shm_count),$(shm_bytes),$(shmem_kib)" >>"$OUT/samples.csv"
    ((SECONDS - start - seg_start > 30)) && prune
    sleep "$SAMPLE_S"
  done
  kill -0 "$launcher" 2>/dev/null || { echo "soak: the job of segment $segment ended by itself" >&2; tail -20 "$OUT/run-$segment.log" >&2; exit 1; }
  mapfile -t pids < <(rank_pids)
  victim_pid=${pids[$((RANDOM % ${#pids[@]}))]}
  victim=$(tr '\0' '\n' <"/proc/$victim_pid/environ" | sed -n 's/^RANK=//p')
  killed=$((SECONDS - start))
  t0=$(date +%s.%N)
  kill -KILL "$victim_pid"
  code=0
  wait "$launcher" || code=$?
  # Every rank gone as well as the launcher.
  while [ -n "$(rank_pids)" ] && awk -v t0="$t0" 'BEGIN { exit !(systime() - t0 < 60) }'; do sleep 0.05; done
  t1=$(date +%s.%N)
  resumed=$(grep -o 'resumed from [^ ]* at step [0-9]*' "$OUT/run-$segment.log" | awk '{ print $NF }' || true)
  echo "$segment,$seg_start,$killed,$victim,$code,$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')," \
    "$(rank_pids | wc -w),$(shm_count),${resumed:-none}" | tr -d ' ' >>"$OUT/restarts.csv"
done
rm -rf "$CKPT"
echo "machine: $(nproc --all) cores, $(uname -r); load at the end: $(cut -d' ' -f1-3 /proc/loadavg)" >"$OUT/machine.txt"
/usr/bin/python3 "$(dirname "$0")/soak_report.py" "$OUT" >"$OUT/soak.md"
cat "$OUT/soak.md"
