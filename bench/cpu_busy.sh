#!/bin/bash
# Runs a command and prints how the machine's CPU time split while it ran (from /proc/stat, all
# cores, every process): user, system, softirq, idle (+ iowait), steal.
#   bench/cpu_busy.sh COMMAND [ARGS...]
set -u
snapshot() { read -r _ user nice system idle iowait irq softirq steal _ < /proc/stat; }
snapshot
u0=$((user + nice)) s0=$((system + irq)) q0=$softirq i0=$((idle + iowait)) t0=$steal
"$@"
rc=$?
snapshot
u=$((user + nice - u0)) s=$((system + irq - s0)) q=$((softirq - q0)) i=$((idle + iowait - i0)) t=$((steal - t0))
all=$((u + s + q + i + t))
[ "$all" -gt 0 ] || all=1
awk -v u=$u -v s=$s -v q=$q -v i=$i -v t=$t -v a=$all 'BEGIN {
  printf "# cpu while it ran: user %.1f%%, system %.1f%%, softirq %.1f%%, idle %.1f%%, steal %.1f%%\n",
         100*u/a, 100*s/a, 100*q/a, 100*i/a, 100*t/a }'
exit $rc
