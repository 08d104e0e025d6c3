#!/usr/bin/env python3
"""GPU benchmark: mixed precision and CPU offload on one device, libfsdp vs PyTorch FSDP2.

Two sections, each run interleaved and repeated on the same GPT (bench/gpu/run.py's model and step),
float32 master weights and a bf16 compute policy (param bf16, reduce f32) for every contender:
  mp       no offload: libfsdp FULL_SHARD with MixedPrecision vs FSDP2 with MixedPrecisionPolicy,
           each with its framework's fused AdamW on the device.
  offload  shards, gradients and the optimizer step in host memory: libfsdp CpuOffload vs FSDP2
           CPUOffloadPolicy, with each framework's CPU AdamW (LibTorch's / PyTorch's default) and
           with its fastest (fsdp::FusedAdamW's CPU kernel / torch AdamW(fused=True) on the CPU); and
           libfsdp with FusedAdamW stepping each unit in backward, on a host thread beside the
           device's backward (set_step_in_backward), with shards cast to bf16 on the host (the
           default) and on the device.
Appends to raw-offload.jsonl and offload.md (medians, ratios, host memory, optimizer wall time, the
bytes each step moves between host and device).

    bench/gpu/offload.py --build-dir build-gpu --out OUT [--sections mp,offload] [--reps 2] [--layers 24 ...]
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
from gpt_args import add_gpt_args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build-gpu")
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--sections", default="mp,offload")
    ap.add_argument("--reps", type=int, default=2)
    add_gpt_args(ap, warmup=2, steps=5)
    ap.add_argument("--only", default="",
                    help="comma-separated substrings: run only contenders whose name contains one (the last one "
                         "kept stays the baseline)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bench = os.path.join(args.build_dir, "bench", "gpu_gpt_bench")
    fsdp2 = [sys.executable, os.path.join(HERE, "fsdp2_gpt.py")]
    model = ["--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads),
             "--context", str(args.context), "--batch", str(args.batch), "--warmup", str(args.warmup),
             "--steps", str(args.steps), "--dtype", "f32", "--mixed-precision", "--peak-tflops", "1"]
    ours = [bench, "--mode", "fsdp", "--strategy", "FULL_SHARD"]
    sections = {
        "mp": {"libfsdp, fused AdamW": ours + ["--optimizer", "fused"],
               "PyTorch FSDP2, fused AdamW": fsdp2 + ["--optimizer", "fused"]},
        "offload": {"libfsdp offload, LibTorch AdamW": ours + ["--offload", "--optimizer", "adamw"],
                    "libfsdp offload, FusedAdamW": ours + ["--offload", "--optimizer", "fused"],
                    "libfsdp offload, FusedAdamW, step in backward": ours + ["--offload", "--optimizer", "fused",
                                                                              "--step-in-backward"],
                    "libfsdp offload, FusedAdamW, step in backward, cast on the device":
                        ours + ["--offload", "--optimizer", "fused", "--step-in-backward", "--device-cast"],
                    "PyTorch FSDP2 offload, AdamW": fsdp2 + ["--offload", "--optimizer", "adamw"],
                    "PyTorch FSDP2 offload, AdamW(fused)": fsdp2 + ["--offload", "--optimizer", "fused"]},
    }
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29573", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    raw = open(os.path.join(args.out, "raw-offload.jsonl"), "a")
    lines = ["# Mixed precision and CPU offload on one GPU: libfsdp against PyTorch FSDP2", "",
             f"Produced by `bench/gpu/offload.py`, {started}. GPT {args.layers} layers, width {args.width}, "
             f"{args.heads} heads, context {args.context}, {args.batch} sequences per step; float32 masters, "
             f"bf16 compute (param bf16, reduce f32); AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1; "
             f"{args.warmup} warm-up then the median of {args.steps} steps per run, median over {args.reps} "
             f"interleaved runs (min-max in brackets). World size 1.", ""]
    for sec in [s for s in args.sections.split(",") if s]:
        contenders = sections[sec]
        if args.only:
            keys = [k for k in args.only.split(",") if k]
            contenders = {n: c for n, c in contenders.items() if any(k in n for k in keys)}
        results = {k: [] for k in contenders}
        names = list(contenders)
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                r = run_json(contenders[name] + model + ["--label", name], env=env)
                r["section"] = sec
                results[name].append(r)
                raw.write(json.dumps(r) + "\n")
                raw.flush()
                print(f"{sec} rep {rep + 1} {name:38s} {r['step_ms']:9.1f} ms/step {r['tokens_per_s']:9.0f} tok/s "
                      f"opt wall {r.get('optimizer_wall_ms', 0):8.1f} ms host RSS {r['host_peak_rss_bytes'] / 2**30:.1f} GiB "
                      f"dev peak {r['reserved_peak_bytes'] / 2**30:.2f} GiB", flush=True)

        def med(name, key):
            return statistics.median(r[key] for r in results[name])

        base = names[-1] if sec == "offload" else names[1]
        first = results[names[0]][0]
        n = first["params"]
        lines += [f"## {sec}: {n / 1e9:.3f} B parameters", "",
                  f"| contender | step ms | tokens/s | throughput / {base} | forward ms | backward ms | optimizer ms "
                  "(device events) | optimizer wall ms | peak allocated GiB | peak reserved GiB | host peak RSS GiB "
                  "| loss first -> last |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for name in names:
            steps = [r["step_ms"] for r in results[name]]
            r0 = results[name][0]
            lines.append(
                f"| {name} | {med(name, 'step_ms'):.1f} [{min(steps):.1f}-{max(steps):.1f}] | "
                f"{med(name, 'tokens_per_s'):,.0f} | {med(name, 'tokens_per_s') / med(base, 'tokens_per_s'):.3f} | "
                f"{med(name, 'forward_ms'):.1f} | {med(name, 'backward_ms'):.1f} | {med(name, 'optimizer_ms'):.1f} | "
                f"{med(name, 'optimizer_wall_ms'):.1f} | {med(name, 'allocated_peak_bytes') / 2**30:.2f} | "
                f"{med(name, 'reserved_peak_bytes') / 2**30:.2f} | {med(name, 'host_peak_rss_bytes') / 2**30:.1f} | "
                f"{r0['losses'][0]:.4f} -> {r0['losses'][-1]:.4f} |")
        if sec == "offload":
            # FULL_SHARD at world 1 with offload: each unit's shard goes to the device for forward and
            # again for backward, in bf16 where libfsdp casts on the host (Note [Cast on the host]), in
            # f32 otherwise; each f32 gradient shard comes back once.
            lines += ["", "Host-device bytes per step, by construction: to the device "
                          f"{2 * 4 * n / 2**30:.2f} GiB for FSDP2 and libfsdp casting on the device (f32 parameters "
                          f"twice), {2 * 2 * n / 2**30:.2f} GiB for libfsdp stepping after backward (bf16 twice), "
                          f"{(2 + 4) * n / 2**30:.2f} GiB for libfsdp stepping in backward on its own thread (bf16 "
                          f"for forward, f32 for backward); back {4 * n / 2**30:.2f} GiB (f32 gradients) for all."]
        lines.append("")
    with open(os.path.join(args.out, "offload.md"), "a") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
