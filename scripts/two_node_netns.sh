#!/usr/bin/env bash
# Two-node training on one machine: two network namespaces ("hosts") joined by a veth pair, one
# fsdp-run per namespace (--nnodes 2, 2 ranks each), against a 4-rank run inside one namespace
# with the same configuration. Prints both runs' per-step losses and the largest difference,
# shows which addresses the ranks' Gloo connections use and the bytes that crossed the veth link,
# and fails if the losses differ by more than 1e-6, any Gloo connection avoids the link, or the
# two-node world communicator did not fall back from shared memory to Gloo (node 1 has its own
# /dev/shm, as a second host would).
#
#   scripts/two_node_netns.sh [TRAINER ARGS...]       (as root; needs iproute2 and a built tree)
#
# Exit code: 0 if the runs agree and the link was used, 1 if not, 77 if namespaces or veth
# devices cannot be made here (not root, no CAP_NET_ADMIN).
# Environment: BUILD_DIR (default build; or FSDP_RUN and FSDP_GPT: the two programs), KEEP_LOGS=DIR to keep the logs and metrics files,
# BIND=default|ifname|addr: how the ranks choose their Gloo address (default: the library picks
# the local address that routes to MASTER_ADDR; ifname: GLOO_SOCKET_IFNAME=<veth>; addr:
# FSDP_BIND_ADDR=<veth address>); MASTER=addr|name: --master-addr is node 0's veth address
# (default) or a host name, fsdp-node0, that each namespace resolves through its own /etc/hosts
# (/etc/netns/NS/hosts, which 'ip netns exec' mounts over /etc/hosts).
# Default trainer arguments: 20 steps of the default model.
# The namespaces, and everything still running in them, are removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
# Network namespaces share /dev/shm, so node 1 also gets a /dev/shm of its own (a private mount
# namespace): like a real second host, its ranks cannot map node 0's shared-memory segments, and
# libfsdp's default transport (auto) must find that out and fall back to Gloo over TCP. The
# one-node run uses Gloo too (FSDP_TRANSPORT=tcp), so both runs sum in the same order.
BUILD_DIR=${BUILD_DIR:-build}
BIND=${BIND:-default}
MASTER=${MASTER:-addr}
LAUNCHER=${FSDP_RUN:-$PWD/$BUILD_DIR/tools/fsdp-run}
TRAINER=${FSDP_GPT:-$PWD/$BUILD_DIR/examples/gpt/fsdp_gpt}
for f in "$LAUNCHER" "$TRAINER"; do
  [ -x "$f" ] || { echo "two_node_netns: $f is missing; build first (scripts/setup.sh)" >&2; exit 1; }
done
[ "$(id -u)" -eq 0 ] || { echo "two_node_netns: needs root (ip netns)" >&2; exit 77; }
command -v ip >/dev/null || { echo "two_node_netns: needs iproute2 (apt-get install iproute2)" >&2; exit 77; }
if [ $# -eq 0 ]; then set -- --steps 20; fi

NS0=fsdp-$$-node0 NS1=fsdp-$$-node1
VETH0=fv$$a VETH1=fv$$b  # interface names are at most 15 bytes
ADDR0=10.77.0.1 ADDR1=10.77.0.2
PORT=29555  # the namespaces are fresh: nothing else listens there
WORK=$(mktemp -d "${TMPDIR:-/tmp}/two_node_netns.XXXXXX")
PIDS=()

cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for ns in "$NS0" "$NS1"; do
    if ip netns list | grep -qw "$ns"; then
      # Anything left in the namespace (a rank the launcher could not stop) goes with it.
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || true  # also removes the veth end inside it
    fi
    rm -rf "/etc/netns/$ns"
  done
  if [ -n "${KEEP_LOGS:-}" ]; then
    mkdir -p "$KEEP_LOGS" && cp "$WORK"/* "$KEEP_LOGS"/ 2>/dev/null || true
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- the two "hosts" -------------------------------------------------------------------------
if ! ip netns add "$NS0" 2>"$WORK/err"; then
  echo "two_node_netns: cannot create a network namespace: $(cat "$WORK/err")" >&2
  exit 77
fi
ip netns add "$NS1"
if ! ip link add "$VETH0" netns "$NS0" type veth peer name "$VETH1" netns "$NS1" 2>"$WORK/err"; then
  echo "two_node_netns: cannot create a veth pair: $(cat "$WORK/err")" >&2
  exit 77
fi
ip -n "$NS0" addr add "$ADDR0/24" dev "$VETH0"
ip -n "$NS1" addr add "$ADDR1/24" dev "$VETH1"
for pair in "$NS0 $VETH0" "$NS1 $VETH1"; do
  read -r ns dev <<<"$pair"
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "$dev" up
done
case $MASTER in
  addr) MASTER_ADDR=$ADDR0 ;;
  name)
    MASTER_ADDR=fsdp-node0
    for ns in "$NS0" "$NS1"; do
      mkdir -p "/etc/netns/$ns"
      printf '127.0.0.1 localhost\n%s fsdp-node0\n%s fsdp-node1\n' "$ADDR0" "$ADDR1" >"/etc/netns/$ns/hosts"
    done ;;
  *) echo "two_node_netns: MASTER must be addr or name" >&2; exit 2 ;;
esac
echo "namespaces: $NS0 ($VETH0 $ADDR0/24) <-> $NS1 ($VETH1 $ADDR1/24)"
ip -n "$NS0" -br addr show "$VETH0"
ip -n "$NS1" -br addr show "$VETH1"

bind_env() {  # $1: namespace index
  case $BIND in
    default) ;;
    ifname) if [ "$1" = 0 ]; then echo "GLOO_SOCKET_IFNAME=$VETH0"; else echo "GLOO_SOCKET_IFNAME=$VETH1"; fi ;;
    addr) if [ "$1" = 0 ]; then echo "FSDP_BIND_ADDR=$ADDR0"; else echo "FSDP_BIND_ADDR=$ADDR1"; fi ;;
    *) echo "two_node_netns: BIND must be default, ifname or addr" >&2; exit 2 ;;
  esac
}

veth_bytes() {  # tx bytes of node 0's veth end
  ip -n "$NS0" -s -j link show "$VETH0" 2>/dev/null | sed -nE 's/.*"tx":\{"bytes":([0-9]+).*/\1/p'
}

TRAIN_ARGS=(--log-interval 1 --sample-bytes 0 "$@")

# --- two nodes, two ranks each ---------------------------------------------------------------
# The nodes share one job token, as a job across hosts should (docs/security.md).
FSDP_JOB_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
export FSDP_JOB_TOKEN
tx_before=$(veth_bytes)
start=$SECONDS
for node in 0 1; do
  ns=$NS0
  [ "$node" = 1 ] && ns=$NS1
  # shellcheck disable=SC2046  # bind_env prints zero or one NAME=VALUE word
  own_shm=()
  [ "$node" = 1 ] && own_shm=(unshare --mount --propagation private sh -c \
    'mount -t tmpfs -o size=64m fsdp-node1-shm /dev/shm && exec "$@"' own-shm)
  ip netns exec "$ns" "${own_shm[@]}" env $(bind_env "$node") "$LAUNCHER" --nnodes 2 --node-rank "$node" --nproc-per-node 2 \
    --master-addr "$MASTER_ADDR" --master-port "$PORT" \
    "$TRAINER" "${TRAIN_ARGS[@]}" --metrics-file "$WORK/two_nodes.jsonl" >"$WORK/node$node.log" 2>&1 &
  PIDS+=($!)
done

# While it trains: the ranks' TCP connections in each namespace (Gloo's full mesh and the store),
# listed every 0.1 s until a node's launcher exits; a short run may end between two listings.
for ns in "$NS0" "$NS1"; do : >"$WORK/sockets.$ns"; done
while kill -0 "${PIDS[0]}" 2>/dev/null && kill -0 "${PIDS[1]}" 2>/dev/null; do
  for ns in "$NS0" "$NS1"; do
    ip netns exec "$ns" ss -Htnp state established 2>/dev/null | grep fsdp_gpt >>"$WORK/sockets.$ns" || true
  done
  sleep 0.1
done

# A node cannot see the other's launcher: if one fails, the other's ranks would wait for the
# lost peers until the Gloo timeout. Stop the other node at once instead, as a cluster would.
declare -A code_of=()
while [ ${#code_of[@]} -lt 2 ]; do
  pending=()
  for pid in "${PIDS[@]}"; do [ -n "${code_of[$pid]:-}" ] || pending+=("$pid"); done
  finished=
  if wait -n -p finished "${pending[@]}"; then rc=0; else rc=$?; fi
  [ -n "$finished" ] || break
  code_of[$finished]=$rc
  if [ "$rc" -ne 0 ]; then
    for pid in "${PIDS[@]}"; do [ -n "${code_of[$pid]:-}" ] || kill -TERM "$pid" 2>/dev/null || true; done
  fi
done
codes=("${code_of[${PIDS[0]}]:-?}" "${code_of[${PIDS[1]}]:-?}")
PIDS=()
two_node_seconds=$((SECONDS - start))
tx_after=$(veth_bytes)
if [ "${codes[*]}" != "0 0" ]; then
  echo "two_node_netns: two-node run failed (exit codes ${codes[*]})" >&2
  tail -n 30 "$WORK/node0.log" "$WORK/node1.log" >&2
  exit 1
fi
echo
echo "== two nodes: node 0 log (first and last lines) =="
head -n 3 "$WORK/node0.log"
echo "..."
tail -n 4 "$WORK/node0.log"
echo "== node 1 log (only rank 0 prints; errors would show here) =="
cat "$WORK/node1.log"

# --- one node, four ranks, same configuration ------------------------------------------------
start=$SECONDS
ip netns exec "$NS0" env FSDP_TRANSPORT=tcp "$LAUNCHER" --nproc-per-node 4 --master-addr 127.0.0.1 --master-port "$PORT" \
  "$TRAINER" "${TRAIN_ARGS[@]}" --metrics-file "$WORK/one_node.jsonl" >"$WORK/one_node.log" 2>&1 ||
  { echo "two_node_netns: one-node run failed" >&2; tail -n 30 "$WORK/one_node.log" >&2; exit 1; }
one_node_seconds=$((SECONDS - start))

# --- comparison ------------------------------------------------------------------------------
losses() { sed -E 's/.*"loss":([-0-9.eE+]+).*"step":([0-9]+).*/\2 \1/' "$1"; }
losses "$WORK/two_nodes.jsonl" >"$WORK/two.txt"
losses "$WORK/one_node.jsonl" >"$WORK/one.txt"
[ -s "$WORK/two.txt" ] && [ "$(wc -l <"$WORK/two.txt")" -eq "$(wc -l <"$WORK/one.txt")" ] ||
  { echo "two_node_netns: the runs logged different steps" >&2; exit 1; }
echo
echo "== per-step training loss (mean over the 4 ranks) =="
printf "%6s  %-22s %-22s %s\n" step "2 nodes x 2 ranks" "1 node x 4 ranks" "|difference|"
join "$WORK/two.txt" "$WORK/one.txt" | awk '
  { d = $2 - $3; if (d < 0) d = -d; if (d > max) max = d
    printf "%6d  %-22.17g %-22.17g %.3g\n", $1, $2, $3, d }
  END { printf "max |difference| over %d steps: %.3g\n", NR, max; print max > "'"$WORK/maxdiff"'" }'
for f in node0 one_node; do
  sed -nE 's/^\[rank 0\] (validation loss after training: .*)/'"$f"': \1/p' "$WORK/$f.log"
done
echo "wall time: two nodes ${two_node_seconds} s, one node ${one_node_seconds} s"

# --- did Gloo use the veth link? -------------------------------------------------------------
echo
echo "== established TCP connections of the ranks during training =="
off_link=0 cross=0
# "ss" columns: Recv-Q Send-Q Local Peer Process. The store listens on [::], so its connections
# show IPv4-mapped addresses ([::ffff:10.77.0.1]:29555); strip that to compare addresses.
connections() {  # prints "kind local-address peer-address" once per rank connection seen in namespace $1
  awk '{print $3, $4}' "$WORK/sockets.$1" | sort -u | awk -v port="$PORT" '{
      l = $1; p = $2; gsub(/\[::ffff:|\]/, "", l); gsub(/\[::ffff:|\]/, "", p)
      split(l, la, ":"); split(p, pa, ":")
      kind = (la[2] == port || pa[2] == port) ? "store" : "gloo"
      print kind, la[1], pa[1] }'
}
for ns in "$NS0" "$NS1"; do
  echo "-- $ns: count, kind, local address -> peer address"
  connections "$ns" | sort | uniq -c | awk '{printf "   %3d %-5s %s -> %s\n", $1, $2, $3, $4}'
  off_link=$((off_link + $(connections "$ns" | awk '$2 !~ /^10\.77\.0\./ || $3 !~ /^10\.77\.0\./' | wc -l)))
done
cross=$(connections "$NS1" | awk -v a="$ADDR0" '$1 == "gloo" && $3 == a' | wc -l)
echo "Gloo connections from node 1 to node 0: $cross; rank connections not on the veth addresses: $off_link"
echo "bytes sent by node 0 over $VETH0 during the two-node run: $((tx_after - tx_before))"

echo "two-node run's communicators (auto transport):"
sed -nE 's/^\[rank 0\]   ((world|shard group|replica group) [a-z]+\[.*)/  \1/p' "$WORK/node0.log"

maxdiff=$(cat "$WORK/maxdiff")
if ! awk -v d="$maxdiff" 'BEGIN { exit !(d <= 1e-6) }'; then
  echo "FAIL: two-node and one-node losses differ by $maxdiff" >&2
  exit 1
fi
if [ "$off_link" -ne 0 ] || [ "$cross" -eq 0 ]; then
  echo "FAIL: the ranks' connections did not all use the veth addresses" >&2
  exit 1
fi
if ! grep -qE '^\[rank 0\]   world world\[0,1,2,3\]: Gloo over TCP' "$WORK/node0.log"; then
  echo "FAIL: the two-node run did not report its world communicator on Gloo over TCP" >&2
  exit 1
fi
echo "OK"
