#!/usr/bin/env bash
# A two-node Slurm cluster on one machine, to run the trainer with 'srun -N2': two network
# namespaces (the nodes snode0 10.78.0.1 and snode1 10.78.0.2) on a bridge (10.78.0.254, where
# slurmctld runs), one slurmd per namespace, munge for authentication. Runs
#
#   srun -N2 -n4 --export=ALL,MASTER_ADDR=snode0,MASTER_PORT=29577 fsdp_gpt TRAINER ARGS
#
# and the same configuration with fsdp-run --nproc-per-node 4 on one node, and compares the
# per-step losses; then stops the daemons and removes the namespaces, bridge and configuration.
#
#   scripts/slurm_two_node_netns.sh [TRAINER ARGS...]     (root; default: --steps 30)
#
# Needs Debian's slurmd, slurmctld, slurm-client and munge (apt-get install slurmd slurmctld
# slurm-client munge); not part of setup.sh, as only this proof uses them. Notes on the set-up:
# - 'ip netns exec' remounts /sys, which hides this machine's cgroup v1 mounts, and slurmd
#   refuses to start without them ("Hybrid mode is not supported" if cgroup2 is mounted
#   instead); so slurmd enters only the network namespace (nsenter --net) plus a private mount
#   namespace in which /etc/hosts is replaced, so that snode0/snode1/vm resolve to the bridge
#   addresses there.
# - The cluster uses its own ports (6917/6918) and files, so a single-node slurm.conf in
#   /etc/slurm is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
TRAINER=$PWD/$BUILD_DIR/examples/gpt/fsdp_gpt
LAUNCHER=$PWD/$BUILD_DIR/tools/fsdp-run
[ "$(id -u)" -eq 0 ] || { echo "slurm_two_node_netns: needs root" >&2; exit 77; }
for tool in slurmctld slurmd srun munged; do
  command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] ||
    { echo "slurm_two_node_netns: $tool is missing (apt-get install slurmd slurmctld slurm-client munge)" >&2; exit 77; }
done
[ $# -gt 0 ] || set -- --steps 30

CONF_DIR=/etc/slurm-fsdp-2node
export SLURM_CONF=$CONF_DIR/slurm.conf
BRIDGE=fsdpbr
CTLD_HOST=$(hostname)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/slurm_two_node.XXXXXX")
STARTED_MUNGE=

cleanup() {
  local rc=$?
  for pidfile in /run/slurmd-snode0.pid /run/slurmd-snode1.pid /run/slurmctld-fsdp-2node.pid; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 1
  for i in 0 1; do
    ip netns del "fsdp-snode$i" 2>/dev/null || true
    rm -rf "/etc/netns/fsdp-snode$i"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  [ -n "$STARTED_MUNGE" ] && kill "$STARTED_MUNGE" 2>/dev/null || true
  rm -rf "$CONF_DIR" /var/spool/slurmctld-fsdp-2node /var/spool/slurmd-snode0 /var/spool/slurmd-snode1
  [ -n "${KEEP_LOGS:-}" ] && { mkdir -p "$KEEP_LOGS"; cp "$WORK"/* "$KEEP_LOGS"/ 2>/dev/null || true; }
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# munge: one daemon for the machine (its socket is a file, visible from every network namespace).
if ! munge -n </dev/null >/dev/null 2>&1; then
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged
  STARTED_MUNGE=$(pgrep -n -x munged)
  sleep 1
fi

# The network: a bridge in this namespace, one veth per node namespace.
ip link add "$BRIDGE" type bridge
ip addr add 10.78.0.254/24 dev "$BRIDGE"
ip link set "$BRIDGE" up
for i in 0 1; do
  ns=fsdp-snode$i
  ip netns add "$ns"
  ip link add "sn$i" netns "$ns" type veth peer name "sn${i}br"
  ip link set "sn${i}br" master "$BRIDGE" up
  ip -n "$ns" addr add "10.78.0.$((i + 1))/24" dev "sn$i"
  ip -n "$ns" link set "sn$i" up
  ip -n "$ns" link set lo up
  mkdir -p "/etc/netns/$ns"
  printf '127.0.0.1 localhost\n10.78.0.254 %s\n10.78.0.1 snode0\n10.78.0.2 snode1\n' "$CTLD_HOST" >"/etc/netns/$ns/hosts"
done

mkdir -p "$CONF_DIR" /var/spool/slurmctld-fsdp-2node /var/spool/slurmd-snode0 /var/spool/slurmd-snode1 /var/log/slurm
cat >"$SLURM_CONF" <<EOF
ClusterName=fsdp2node
SlurmctldHost=$CTLD_HOST(10.78.0.254)
SlurmctldPort=6917
SlurmdPort=6918
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld-fsdp-2node
SlurmdSpoolDir=/var/spool/slurmd-%n
SlurmctldPidFile=/run/slurmctld-fsdp-2node.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd-%n.log
NodeName=snode0 NodeAddr=10.78.0.1 CPUs=2 RealMemory=4000 State=UNKNOWN
NodeName=snode1 NodeAddr=10.78.0.2 CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=two Nodes=snode0,snode1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF

/usr/sbin/slurmctld -f "$SLURM_CONF"
for i in 0 1; do
  ns=fsdp-snode$i
  nsenter --net="/run/netns/$ns" unshare --mount --propagation private \
    bash -c "mount --bind /etc/netns/$ns/hosts /etc/hosts && exec /usr/sbin/slurmd -f $SLURM_CONF -N snode$i"
done
for _ in $(seq 60); do
  [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u)" = "idle" ] && break
  sleep 1
done
echo "== sinfo"
sinfo

echo "== srun -N2 -n4: what each task sees"
srun -N2 -n4 bash -c 'echo "task $SLURM_PROCID: node $SLURM_NODEID ($(ip -br -4 addr show | awk "/^sn/ {print \$3}")), SLURM_LOCALID=$SLURM_LOCALID SLURM_STEP_TASKS_PER_NODE=$SLURM_STEP_TASKS_PER_NODE SLURM_NTASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-(unset)}"' | sort

echo "== srun -N2 -n4 without MASTER_ADDR (must be refused)"
if srun -N2 -n4 "$TRAINER" "$@" >"$WORK/no_master.log" 2>&1; then
  echo "FAIL: a two-node job without MASTER_ADDR ran" >&2
  exit 1
fi
sort -u "$WORK/no_master.log" | head -n 3

echo "== srun -N2 -n4 --export=ALL,MASTER_ADDR=snode0,MASTER_PORT=29577 fsdp_gpt $*"
start=$SECONDS
srun -N2 -n4 --export=ALL,MASTER_ADDR=snode0,MASTER_PORT=29577 \
  "$TRAINER" --log-interval 1 --sample-bytes 0 "$@" --metrics-file "$WORK/srun.jsonl" >"$WORK/srun.log" 2>&1 ||
  { tail -n 30 "$WORK/srun.log" >&2; exit 1; }
echo "($((SECONDS - start)) s)"
head -n 3 "$WORK/srun.log"
echo "..."
tail -n 3 "$WORK/srun.log"

echo "== fsdp-run --nproc-per-node 4 (one node, same configuration)"
start=$SECONDS
ip netns exec fsdp-snode0 "$LAUNCHER" --nproc-per-node 4 --master-port 29578 \
  "$TRAINER" --log-interval 1 --sample-bytes 0 "$@" --metrics-file "$WORK/one_node.jsonl" >"$WORK/one_node.log" 2>&1 ||
  { tail -n 30 "$WORK/one_node.log" >&2; exit 1; }
echo "($((SECONDS - start)) s)"
tail -n 1 "$WORK/one_node.log"

losses() { sed -E 's/.*"loss":([-0-9.eE+]+).*"step":([0-9]+).*/\2 \1/' "$1"; }
maxdiff=$(join <(losses "$WORK/srun.jsonl") <(losses "$WORK/one_node.jsonl") |
  awk '{ d = $2 - $3; if (d < 0) d = -d; if (d > m) m = d } END { printf "%.3g over %d steps", m, NR }')
echo "max |loss difference| srun -N2 -n4 vs fsdp-run 4 ranks: $maxdiff"
case $maxdiff in
  "0 over "*) echo OK ;;
  *) echo "FAIL: the losses differ" >&2; exit 1 ;;
esac
