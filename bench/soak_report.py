#!/usr/bin/python3
"""Summarizes a bench/soak.sh run directory as Markdown (stdout): restarts, RSS and /dev/shm over
time, and the losses of steps that ran twice (before a kill and again after the resume)."""
import csv
import json
import os
import sys


def main(out):
    samples = list(csv.DictReader(open(os.path.join(out, "samples.csv"))))
    restarts = list(csv.DictReader(open(os.path.join(out, "restarts.csv"))))
    segments = {}
    for name in os.listdir(out):
        if name.startswith("metrics-") and name.endswith(".jsonl"):
            k = int(name[len("metrics-"):-len(".jsonl")])
            segments[k] = [json.loads(line) for line in open(os.path.join(out, name)) if line.strip()]

    machine_txt = os.path.join(out, "machine.txt")
    machine = open(machine_txt).read().strip() if os.path.exists(machine_txt) else "machine: not recorded"
    print("# Soak run\n")
    print(f"Run directory: `{out}`; {machine}. Command and settings: bench/results/README.md, \"Soak\".\n")
    print("## Restarts\n")
    print("| segment | started (s) | killed at (s) | victim rank | launcher exit | all ranks gone after (s) "
          "| processes left | /dev/shm segments left | resumed from step | steps trained |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in restarts:
        k = int(r["segment"])
        steps = segments.get(k, [])
        span = f"{steps[0]['step']}-{steps[-1]['step']}" if steps else "none"
        print(f"| {k} | {r['started_s']} | {r['killed_s']} | {r['victim_rank']} | {r['launcher_exit']} | "
              f"{r['exit_seconds']} | {r['procs_left']} | {r['shm_left']} | {r['resumed_from']} | {span} |")

    # Steps logged by two segments: the later one recomputed them from an earlier checkpoint.
    print("\n## Losses across restarts\n")
    by_step = {}
    worst, compared = 0.0, 0
    for k in sorted(segments):
        for m in segments[k]:
            s = m["step"]
            if s in by_step:
                worst = max(worst, abs(m["loss"] - by_step[s]))
                compared += 1
            by_step[s] = m["loss"]
    steps = sorted(by_step)
    print(f"Steps trained in all: {steps[-1] if steps else 0} (over {len(segments)} segments). Steps trained "
          f"twice (after the last checkpoint before a kill, and again after the resume): {compared}; largest "
          f"difference between their two losses: {worst:.3g}.\n")
    if steps:
        marks = [steps[0]] + [steps[len(steps) * i // 8] for i in range(1, 8)] + [steps[-1]]
        print("| step | loss |")
        print("|---|---|")
        for s in sorted(set(marks)):
            print(f"| {s} | {by_step[s]:.4f} |")

    print("\n## Memory and /dev/shm over time\n")
    full = [s for s in samples if int(s["ranks"]) == max(int(x["ranks"]) for x in samples)]
    if full:
        def rss_mib(s):
            return int(s["rss_kib"]) / 1024.0
        n = len(full)
        first, last = full[: max(1, n // 10)], full[-max(1, n // 10):]
        avg = lambda xs: sum(rss_mib(s) for s in xs) / len(xs)
        print(f"Samples with every rank running: {n}. RSS summed over ranks: first tenth of the run "
              f"{avg(first):.0f} MiB, last tenth {avg(last):.0f} MiB (ratio {avg(last) / avg(first):.3f}); "
              f"min {min(rss_mib(s) for s in full):.0f}, max {max(rss_mib(s) for s in full):.0f} MiB.")
        segs = sorted(set(int(s["shm_segments"]) for s in samples))
        shmem = [int(s["shmem_kib"]) / 1024.0 for s in full]
        print(f"Machine-wide shared memory (/proc/meminfo Shmem, unlinked but mapped segments included): "
              f"first {shmem[0]:.0f} MiB, last {shmem[-1]:.0f} MiB, max {max(shmem):.0f} MiB.")
        print(f"/dev/shm segments of ours while running: {segs}; /dev/shm bytes: first "
              f"{int(full[0]['shm_bytes'])}, last {int(full[-1]['shm_bytes'])}.\n")
        print("| t (s) | segment | RSS sum (MiB) | /dev/shm names of ours | Shmem (MiB) |")
        print("|---|---|---|---|---|")
        for s in full[:: max(1, n // 20)]:
            print(f"| {s['t_s']} | {s['segment']} | {rss_mib(s):.0f} | {s['shm_segments']} | "
                  f"{int(s['shmem_kib']) / 1024.0:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])
