#!/usr/bin/env python3
"""GPU benchmark: libfsdp FULL_SHARD vs plain LibTorch vs PyTorch FSDP2, on one CUDA device.

Runs, interleaved and repeated, (a) gpu_gpt_bench --mode local (plain LibTorch), (b) gpu_gpt_bench
--mode fsdp (libfsdp, NCCL, world of one) and (c) fsdp2_gpt.py (PyTorch FSDP2 fully_shard), all on
the same GPT in bf16 with the same step, after measuring the device's bf16 matmul peak once
(gpu_gpt_bench --mode peak) for MFU. Writes every run's JSON line and a markdown table with the
medians and the ratios to FSDP2 and to plain LibTorch.

    bench/gpu/run.py --build-dir build-gpu --out results/ [--reps 3] [--layers 24 --width 2048 ...]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from gpt_args import add_gpt_args

HERE = os.path.dirname(os.path.abspath(__file__))


def run_json(cmd, env=None):
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}")
    line = [l for l in p.stdout.splitlines() if l.startswith("{")][-1]
    r = json.loads(line)
    r["wall_s"] = time.time() - t
    r["command"] = " ".join(cmd)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build-gpu")
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--reps", type=int, default=3)
    add_gpt_args(ap, warmup=3, steps=10)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bench = os.path.join(args.build_dir, "bench", "gpu_gpt_bench")
    model = ["--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads),
             "--context", str(args.context), "--batch", str(args.batch), "--warmup", str(args.warmup),
             "--steps", str(args.steps), "--dtype", "bf16"]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    peak = run_json([bench, "--mode", "peak"])
    print(f"peak bf16 matmul: {peak['peak_tflops']:.1f} TFLOP/s on {peak['device']}", flush=True)
    pk = ["--peak-tflops", f"{peak['peak_tflops']:.3f}"]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    # Each contender with its framework's default AdamW (LibTorch's per-parameter kernels; PyTorch's
    # foreach) and with a fused AdamW kernel (fsdp::FusedAdamW; torch AdamW(fused=True)).
    contenders = {}
    for opt, tag in (("adamw", ""), ("fused", ", fused AdamW")):
        o = ["--optimizer", opt]
        contenders["LibTorch (plain)" + tag] = [bench, "--mode", "local"] + o + model + pk
        contenders["libfsdp FULL_SHARD" + tag] = [bench, "--mode", "fsdp", "--strategy", "FULL_SHARD"] + o + model + pk
        contenders["PyTorch FSDP2" + tag] = [sys.executable, os.path.join(HERE, "fsdp2_gpt.py")] + o + model + pk
    results = {k: [] for k in contenders}
    raw = open(os.path.join(args.out, "raw-gpu.jsonl"), "w")
    raw.write(json.dumps(peak) + "\n")
    names = list(contenders)
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotate who goes first
        for name in order:
            r = run_json(contenders[name], env=env)
            results[name].append(r)
            raw.write(json.dumps(r) + "\n")
            raw.flush()
            print(f"rep {rep + 1}/{args.reps} {name:20s} {r['step_ms']:8.1f} ms/step {r['tokens_per_s']:9.0f} tok/s "
                  f"MFU {100 * r['mfu']:.1f}% peak alloc {r['allocated_peak_bytes'] / 2**30:.2f} GiB", flush=True)

    def med(name, key):
        return statistics.median(r[key] for r in results[name])

    first = results[names[0]][0]
    lines = [
        "# GPU: libfsdp against plain LibTorch and PyTorch FSDP2",
        "",
        f"Produced by `bench/gpu/run.py` (through `scripts/gpu/run_gpu.sh`), {started}, on "
        f"{peak['device']}; PyTorch {results['PyTorch FSDP2'][0].get('torch', '?')} (its bundled LibTorch for "
        f"the C++ contenders), world size 1.",
        "",
        f"Model: the example GPT, {args.layers} layers, width {args.width}, {args.heads} heads, context "
        f"{args.context}, {first['params'] / 1e9:.3f} B parameters, all in bf16 (parameters, gradients, AdamW "
        f"state; no mixed-precision policy); {args.batch} sequences = {args.batch * args.context} tokens per step; "
        f"AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1; LibTorch's for the C++ contenders, PyTorch's default "
        f"foreach for FSDP2). Wrapping: each block a unit, the root holds the embeddings and final norm. "
        f"Step = zero_grad, forward, loss, backward, optimizer step, reading the loss; {args.warmup} warm-up "
        f"steps then the median of {args.steps} timed steps per run; the table gives the median over "
        f"{args.reps} interleaved runs (min-max of the runs' medians in brackets). Ratios compare contenders "
        f"with the same optimizer setting. MFU against the measured bf16 "
        f"matmul peak, {peak['peak_tflops']:.0f} TFLOP/s ({peak['peak_n']}^3 products); FLOPs per token "
        f"6N + 12 L T d. Phases: device time between CUDA events recorded at the phase boundaries (forward "
        f"includes zero_grad and the loss). Peak memory: PyTorch's CUDA caching allocator during the timed steps.",
        "",
        "| contender | step ms | tokens/s | TFLOP/s | MFU | throughput / FSDP2 | throughput / plain LibTorch "
        "| forward + loss ms | backward ms | optimizer ms | peak allocated GiB | peak reserved GiB | alloc retries "
        "| loss first -> last |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name in names:
        tag = ", fused AdamW" if name.endswith(", fused AdamW") else ""
        base_f2 = med("PyTorch FSDP2" + tag, "tokens_per_s")
        base_lt = med("LibTorch (plain)" + tag, "tokens_per_s")
        steps = [r["step_ms"] for r in results[name]]
        tps = med(name, "tokens_per_s")
        r0 = results[name][0]
        lines.append(
            f"| {name} | {med(name, 'step_ms'):.1f} [{min(steps):.1f}-{max(steps):.1f}] | {tps:,.0f} | "
            f"{med(name, 'tflops'):.0f} | {100 * med(name, 'mfu'):.1f}% | {tps / base_f2:.3f} | {tps / base_lt:.3f} | "
            f"{med(name, 'forward_ms'):.1f} | {med(name, 'backward_ms'):.1f} | {med(name, 'optimizer_ms'):.1f} | "
            f"{med(name, 'allocated_peak_bytes') / 2**30:.2f} | {med(name, 'reserved_peak_bytes') / 2**30:.2f} | "
            f"{int(med(name, 'num_alloc_retries'))} | {r0['losses'][0]:.4f} -> {r0['losses'][-1]:.4f} |")
    lines.append("")
    for tag in ("", ", fused AdamW"):
        f = med("libfsdp FULL_SHARD" + tag, "tokens_per_s")
        lines.append(f"Targets{tag or ', default AdamW'}: libfsdp throughput / FSDP2 = "
                     f"{f / med('PyTorch FSDP2' + tag, 'tokens_per_s'):.3f} (goal >= 1.05), / plain LibTorch = "
                     f"{f / med('LibTorch (plain)' + tag, 'tokens_per_s'):.3f} (goal >= 0.97); libfsdp with fused AdamW "
                     f"/ FSDP2 with its default AdamW = "
                     f"{med('libfsdp FULL_SHARD, fused AdamW', 'tokens_per_s') / med('PyTorch FSDP2', 'tokens_per_s'):.3f}.")
    lines.append("")
    with open(os.path.join(args.out, "gpu.md"), "w") as fh:
        fh.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
