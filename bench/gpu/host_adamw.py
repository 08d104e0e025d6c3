#!/usr/bin/env python3
"""The host's optimizer step under CPU offload, outside a training step: fsdp::FusedAdamW's
CPU kernel (bench/cpu_adamw.cpp, built against the same LibTorch) against PyTorch's CPU AdamW, its
default and fused=True, on the same number of float32 elements split into the same number
of tensors, at the same thread count. Run on the GPU machine's host after scripts/gpu/run_gpu.sh
built build-gpu; the elements default to the offload benchmark's 1.211 B-parameter GPT.

    python3 bench/gpu/host_adamw.py --build-dir build-gpu [--elements N] [--tensors T] [--threads K] [--reps R]
"""
import argparse
import os
import statistics
import subprocess
import time

import torch


def torch_step_ms(elements, tensors, threads, reps, fused):
    torch.set_num_threads(threads)
    per = elements // tensors
    params = [torch.randn(per, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused or None)
    opt.step()  # untimed: allocates the moments
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build-gpu")
    ap.add_argument("--elements", type=int, default=1_211_000_000)
    ap.add_argument("--tensors", type=int, default=292)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    ours = subprocess.run([os.path.join(args.build_dir, "bench", "fsdp_bench_cpu_adamw"), "--elements",
                           str(args.elements), "--tensors", str(args.tensors), "--threads", str(args.threads),
                           "--reps", str(args.reps)], check=True, capture_output=True, text=True).stdout
    print(ours)
    rows = {}
    for line in ours.splitlines():
        for name in ("torch::optim::AdamW", "fsdp::FusedAdamW", "roofline (same traffic)"):
            if line.startswith(name):
                rows[name] = float(line[len(name):].split()[0])
    rows["torch.optim.AdamW (Python, default)"] = torch_step_ms(args.elements, args.tensors, args.threads, args.reps,
                                                                False)
    rows["torch.optim.AdamW(fused=True) (Python)"] = torch_step_ms(args.elements, args.tensors, args.threads,
                                                                   args.reps, True)
    gb = 7 * 4 * args.elements / 1e9
    base = rows["torch.optim.AdamW(fused=True) (Python)"]
    print(f"# {args.elements} float32 elements in {args.tensors} tensors, {args.threads} threads, torch "
          f"{torch.__version__}, medians of {args.reps} steps after one untimed step")
    print("| optimizer | step ms | GB/s (28 B per element) | / PyTorch fused |")
    print("| --- | ---: | ---: | ---: |")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.1f} | {gb / (ms / 1e3):.1f} | {ms / base:.2f} |")


if __name__ == "__main__":
    main()
