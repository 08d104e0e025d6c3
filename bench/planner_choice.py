#!/usr/bin/python3
"""Does the planner's choice fit, and how fast is it against the fastest run? (bench/results/planner_choice.md)

    bench/planner_choice.py BUILD_DIR [--out bench/results/planner_choice.md] [--rounds 3]

Runs every candidate of a small search space (model XL of bench/planner.py, world 2, 4 sequences per
rank, fp32: 3 strategies x {block, block checkpointed, no wrapping}, FULL_SHARD's first 1, 2 or 3 of its
4 blocks checkpointed, the 3 strategies' block units and
FULL_SHARD's checkpointed ones with the optimizer's step in backward, and FULL_SHARD's block units with
2 micro-batches of 2, each reducing or only the last, checkpointed or not) through the trainer with
--plan-file and one calibration made first (as in bench/planner.py), then, for budgets from the smallest predicted peak to the largest, compares the
planner's choice (the fastest predicted among the candidates predicted to fit with the margin) with the fastest
measured among those whose measured peak resident set fits: whether the choice's measured peak fits
the budget (no OOM), and its measured step time over the fastest's. The candidates run in --rounds
interleaved rounds (this machine's speed drifts by tens of percent within minutes): a candidate's
step time is the median of its rounds, its peak the largest.
"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planner import ROOT, WINDOWS, calibration, run_one  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/planner_choice.md"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    started = datetime.datetime.utcnow()
    load_start = os.getloadavg()[0]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        candidates = []
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            for wrap, checkpointing in (("block", False), ("block", True), ("none", False)):
                candidates.append((["--strategy", strategy, "--wrap", wrap], checkpointing))
        for blocks in ("1", "2", "3"):  # the first blocks checkpointed, of 4
            candidates.append((["--strategy", "FULL_SHARD", "--wrap", "block", "--checkpointed-blocks", blocks], True))
        for strategy, checkpointing in (("FULL_SHARD", False), ("SHARD_GRAD_OP", False), ("NO_SHARD", False),
                                        ("FULL_SHARD", True)):
            candidates.append((["--strategy", strategy, "--wrap", "block", "--step-in-backward"], checkpointing))
        for mode in ("reduce", "no-sync", "no-sync-unsharded"):
            for checkpointing in (False, True):
                candidates.append((["--strategy", "FULL_SHARD", "--wrap", "block", "--batch-size", "2",
                                    "--grad-accum-mode", mode], checkpointing))
        cal = calibration(build, 2, "XL", "none", "shm", tmp)  # one calibration plans every candidate, as at launch
        measured = [[] for _ in candidates]
        for round_ in range(args.rounds):
            for i, (flags, checkpointing) in enumerate(candidates):
                r = run_one(build, 2, "XL", flags, checkpointing, "none", "shm", tmp, cal)
                p, m = r["plan"], r["measured"]
                measured[i].append(m)
                if round_ == 0:
                    runs.append({"config": p["configuration"], "pred_peak": p["peak_bytes"], "pred_step": p["step_s"],
                                 "margin": p["memory_margin"]})
                print(f"round {round_ + 1}, {i + 1}/{len(candidates)} {p['configuration']}: rss "
                      f"{m['rss_peak_bytes'] / 2**20:.1f} MiB, step {m['ms_per_step']:.1f} ms", flush=True)
        for run, ms in zip(runs, measured):
            run["rss"] = max(m["rss_peak_bytes"] for m in ms)
            run["step"] = statistics.median(m["ms_per_step"] for m in ms) / 1e3
            run["steps"] = " ".join(f"{m['ms_per_step']:.0f}" for m in ms)
    finished = datetime.datetime.utcnow()
    margin = runs[0]["margin"]
    lo = min(min(r["pred_peak"], r["rss"]) for r in runs)
    hi = max(max(r["pred_peak"] * (1 + margin), r["rss"]) for r in runs)
    budgets = [int(lo + (hi - lo) * k / 5) for k in range(6)]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [
        "# The planner's choice against the fastest run",
        "",
        f"Produced by `bench/planner_choice.py {os.path.relpath(build, ROOT)} --rounds {args.rounds}` from the repository root, "
        f"{started:%Y-%m-%d %H:%M} to {finished:%H:%M} UTC, commit {commit}. This 2-core CPU machine, shared "
        f"with other jobs (load average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end).",
        "",
        "Candidates: model XL (4 layers, width 512, context 128), world 2, 4 sequences per rank, fp32, each run as "
        f"in [planner.md](planner.md) ({WINDOWS} windows of at least 3 steps; the median ms/step of the windows after the first; rank 0's "
        "peak resident set during "
        "training; every prediction from one calibration, made by a separate job before the first run, as a plan at "
        f"launch has). The candidates run in {args.rounds} interleaved rounds: a candidate's step is the median "
        "of its rounds, its peak the largest. The planner's choice at a budget is the "
        f"fastest predicted candidate whose predicted peak plus the trainer's margin ({margin * 100:.0f}%, "
        "`--memory-margin`) fits it, as `--memory-budget` chooses.",
        "",
        "| candidate | predicted peak MiB | measured training peak RSS MiB | predicted step ms | measured step ms "
        "(median) | each round's ms |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in sorted(runs, key=lambda r: r["step"]):
        lines.append(f"| {r['config']} | {r['pred_peak'] / 2**20:.1f} | {r['rss'] / 2**20:.1f} | "
                     f"{r['pred_step'] * 1e3:.1f} | {r['step'] * 1e3:.1f} | {r['steps']} |")
    lines += ["", "| budget MiB | planner's choice | its measured peak fits | fastest measured that fits | "
              "choice's step / fastest's |", "| ---: | --- | --- | --- | ---: |"]
    for b in budgets:
        planned = [r for r in runs if r["pred_peak"] * (1 + margin) <= b]
        fitting = [r for r in runs if r["rss"] <= b]
        if not planned:
            lines.append(f"| {b / 2**20:.1f} | none fits (predicted) | | "
                         f"{min(fitting, key=lambda r: r['step'])['config'] if fitting else 'none'} | |")
            continue
        choice = min(planned, key=lambda r: r["pred_step"])
        best = min(fitting, key=lambda r: r["step"]) if fitting else None
        speed = f"{choice['step'] / best['step']:.2f}" if best else ""
        lines.append(f"| {b / 2**20:.1f} | {choice['config']} | {'yes' if choice['rss'] <= b else 'no'} | "
                     f"{best['config'] if best else 'none'} | {speed} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
