#!/usr/bin/env python3
"""GPU: the planner's world-1 prediction against the run, on the GPU benchmark's GPT.

Each run is `gpu_gpt_bench --mode fsdp --plan`: it first calibrates on the device (a throwaway copy's
forward, backward and AdamW step; the same through the FSDP runtime; the caching allocator's reserved
over allocated bytes at the passes' peak), plans its own configuration, then trains and measures.
Writes planner.md (predicted against measured step time and peak reserved memory; goal: within 10%)
and appends every run to raw-planner.jsonl.

    bench/gpu/planner.py --build-dir build-gpu --out OUT [--reps 1] [--layers 24 ...]
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import run_json  # noqa: E402
from gpt_args import add_gpt_args  # noqa: E402

GIB = 1024 ** 3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build-gpu")
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--reps", type=int, default=1)
    add_gpt_args(ap, warmup=2, steps=5)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bench = os.path.join(args.build_dir, "bench", "gpu_gpt_bench")
    model = ["--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads),
             "--context", str(args.context), "--batch", str(args.batch), "--warmup", str(args.warmup),
             "--steps", str(args.steps), "--dtype", "f32", "--peak-tflops", "1", "--optimizer", "fused"]
    configurations = {
        "FULL_SHARD, bf16 compute (f32 masters)": ["--strategy", "FULL_SHARD", "--mixed-precision"],
        "FULL_SHARD, f32": ["--strategy", "FULL_SHARD"],
    }
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29574", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {name: [] for name in configurations}
    with open(os.path.join(args.out, "raw-planner.jsonl"), "a") as raw:
        for _ in range(args.reps):
            for name, flags in configurations.items():
                r = run_json([bench, "--mode", "fsdp", "--plan", "--label", name] + model + flags, env=env)
                raw.write(json.dumps(r) + "\n")
                raw.flush()
                results[name].append(r)
                print(f"{name}: step {r['step_ms']:.1f} ms (planned {r['planned_step_ms']:.1f}), reserved "
                      f"{r['reserved_peak_bytes'] / GIB:.2f} GiB (planned {r['planned_peak_bytes'] / GIB:.2f})",
                      flush=True)
    device = next(iter(results.values()))[0]["device"]
    lines = ["# The planner on one GPU: predicted against measured", "",
             f"Produced by `python3 bench/gpu/planner.py --build-dir build-gpu --reps {args.reps}`, {started}, "
             f"{device}. GPT {args.layers} layers, width {args.width}, {args.heads} heads, context "
             f"{args.context}, {args.batch} sequences per step, world 1, one unit per block, fused AdamW. Each "
             f"run calibrates on the device first (`gpu_gpt_bench --plan`, bench/gpu/gpu_plan.cpp), then "
             f"trains {args.warmup} warm-up and {args.steps} timed steps (median); peak reserved memory from "
             f"the caching allocator after the warm-up. Medians over {args.reps} run(s).", "",
             "| configuration | planned step ms | measured step ms | measured / planned | planned peak GiB "
             "| measured peak reserved GiB | measured / planned | calibration s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    worst_step = worst_memory = 0.0
    for name, runs in results.items():
        planned_step = statistics.median(r["planned_step_ms"] for r in runs)
        step = statistics.median(r["step_ms"] for r in runs)
        planned_peak = statistics.median(r["planned_peak_bytes"] for r in runs)
        peak = statistics.median(r["reserved_peak_bytes"] for r in runs)
        calibrate = statistics.median(r["calibrate_s"] for r in runs)
        worst_step = max(worst_step, abs(step / planned_step - 1))
        worst_memory = max(worst_memory, abs(peak / planned_peak - 1))
        lines.append(f"| {name} | {planned_step:.1f} | {step:.1f} | {step / planned_step:.3f} | "
                     f"{planned_peak / GIB:.2f} | {peak / GIB:.2f} | {peak / planned_peak:.3f} | {calibrate:.0f} |")
    lines += ["", f"Largest error: step time {100 * worst_step:.1f}%, peak reserved memory "
                  f"{100 * worst_memory:.1f}% (goal: within 10%)."]
    with open(os.path.join(args.out, "planner.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
