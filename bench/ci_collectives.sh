#!/usr/bin/env bash
# CI-sized run of the collectives benchmark: 2 ranks, tiny sizes, every section, a few seconds.
# Fails when the benchmark fails (any #wrong > 0 exits 1) or prints no table.
#   ci_collectives.sh PATH/TO/fsdp-run PATH/TO/fsdp_bench_collectives [--expect-wrong]
# --expect-wrong: runs with --inject-wrong (one corrupted element) and passes only if the
# benchmark reports #wrong > 0 and fails: the correctness check itself is tested.
set -u
LAUNCHER=${1:?usage: ci_collectives.sh fsdp-run fsdp_bench_collectives}
BENCH=${2:?usage: ci_collectives.sh fsdp-run fsdp_bench_collectives}
MODE=${3:-}
OUT=$(mktemp "${TMPDIR:-/tmp}/fsdp_bench_ci.XXXXXX")
trap 'rm -f "$OUT"' EXIT

# A port nobody listens on (other test runs on this machine may use fixed ones), below the
# kernel's ephemeral range and the C++ test harness's ports (26000 up); retried once in case another
# process takes it between the check and the rendezvous.
pick_port() {
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 6000))
    if ! ss -Htln "sport = :$p" 2>/dev/null | grep -q .; then echo "$p"; return; fi
  done
  echo $((20000 + RANDOM % 6000))
}

if [ "$MODE" = "--expect-wrong" ]; then
  ARGS=(--sections allgather --min-bytes 1K --max-bytes 16K --factor 16 --iters 1 --warmup 0 --inject-wrong)
else
  ARGS=(--min-bytes 1K --max-bytes 256K --factor 16 --iters 2 --warmup 1 --max-iters 20 --uneven-shift 1,1000
        --split-total 64K --split-min 4K --split-max 64K --split-iters 1 --memcpy-bytes 4M
        --model gbps=0.05,latency_us=100 --model-min-bytes 64K --model-max-bytes 1M --model-factor 16)
fi
for attempt in 1 2; do
  "$LAUNCHER" --nproc-per-node 2 --master-port "$(pick_port)" --no-prefix "$BENCH" "${ARGS[@]}" >"$OUT" 2>&1
  rc=$?
  grep -q "could not rendezvous" "$OUT" && [ "$attempt" = 1 ] && continue
  break
done
cat "$OUT"
if [ "$MODE" = "--expect-wrong" ]; then
  [ "$rc" -ne 0 ] || { echo "FAIL: a corrupted result did not make the benchmark fail" >&2; exit 1; }
  grep -q "FAILED: some path produced wrong results" "$OUT" || { echo "FAIL: no FAILED line" >&2; exit 1; }
  grep -E '^ +[0-9]+ +[0-9]+ +float +fsdp all_gather_into' "$OUT" | grep -qE ' [1-9][0-9]* +[0-9]+ +[0-9.]+ of ' \
    || { echo "FAIL: #wrong of the corrupted path is not > 0" >&2; exit 1; }
  echo "bench.collectives_ci_detects_wrong ok"
  exit 0
fi
[ "$rc" -eq 0 ] || { echo "FAIL: the benchmark exited with $rc" >&2; exit 1; }
for section in "memcpy bandwidth" "all-gather (paper Fig. 2a)" "reduce-scatter vs raw" "Fig. 2b" "network model (MODELED"; do
  grep -qF "$section" "$OUT" || { echo "FAIL: no '$section' section in the output" >&2; exit 1; }
done
rows=$(grep -cE '^ +[0-9]+ +[0-9]+ +float ' "$OUT")
[ "$rows" -ge 10 ] || { echo "FAIL: only $rows table rows" >&2; exit 1; }
! grep -q "FAILED" "$OUT" || { echo "FAIL: the benchmark reported wrong results" >&2; exit 1; }
echo "bench.collectives_ci ok"
