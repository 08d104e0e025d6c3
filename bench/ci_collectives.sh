#!/usr/bin/env bash
# CI-sized run of the collectives benchmark: 2 ranks, tiny sizes, every section, a few seconds.
# Fails when the benchmark fails (any #wrong > 0 exits 1) or prints no table.
#   ci_collectives.sh PATH/TO/fsdp-run PATH/TO/fsdp_bench_collectives
set -u
LAUNCHER=${1:?usage: ci_collectives.sh fsdp-run fsdp_bench_collectives}
BENCH=${2:?usage: ci_collectives.sh fsdp-run fsdp_bench_collectives}
OUT=$(mktemp "${TMPDIR:-/tmp}/fsdp_bench_ci.XXXXXX")
trap 'rm -f "$OUT"' EXIT

# A port nobody listens on (other test runs on this machine may use fixed ones); retried once
# in case another process takes it between the check and the rendezvous.
pick_port() {
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 30000))
    if ! ss -Htln "sport = :$p" 2>/dev/null | grep -q .; then echo "$p"; return; fi
  done
  echo $((20000 + RANDOM % 30000))
}

for attempt in 1 2; do
  "$LAUNCHER" --nproc-per-node 2 --master-port "$(pick_port)" --no-prefix "$BENCH" \
    --min-bytes 1K --max-bytes 256K --factor 16 --iters 2 --warmup 1 --uneven-shift 1,1000 \
    --split-total 64K --split-min 4K --split-max 64K --split-iters 1 --memcpy-bytes 4M \
    --model gbps=0.05,latency_us=100 --model-min-bytes 64K --model-max-bytes 1M --model-factor 16 \
    >"$OUT" 2>&1
  rc=$?
  grep -q "could not rendezvous" "$OUT" && [ "$attempt" = 1 ] && continue
  break
done
cat "$OUT"
[ "$rc" -eq 0 ] || { echo "FAIL: the benchmark exited with $rc" >&2; exit 1; }
for section in "memcpy bandwidth" "all-gather (paper Fig. 2a)" "reduce-scatter vs raw" "Fig. 2b" "network model (MODELED"; do
  grep -qF "$section" "$OUT" || { echo "FAIL: no '$section' section in the output" >&2; exit 1; }
done
rows=$(grep -cE '^ +[0-9]+ +[0-9]+ +float ' "$OUT")
[ "$rows" -ge 10 ] || { echo "FAIL: only $rows table rows" >&2; exit 1; }
! grep -q "FAILED" "$OUT" || { echo "FAIL: the benchmark reported wrong results" >&2; exit 1; }
echo "bench.collectives_ci ok"
