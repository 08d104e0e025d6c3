#!/usr/bin/env python3
"""The largest GPT each framework trains with CPU offload under the same host-memory cap:
libfsdp (FusedAdamW, step in backward on its own host thread) against PyTorch FSDP2
(CPUOffloadPolicy, AdamW(fused=True)), both with f32 masters and bf16 compute, on one GPU.

A depth fits when a run of warm-up + timed steps succeeds and its host peak (VmHWM, which counts
page-locked memory) stays under the cap. For each contender two probes at --probe-layers fit a
line host_peak(layers); the predicted largest depth is then checked, and the search steps down
(or up) one layer at a time until it holds the boundary: the largest depth that fits, with the
next one failing or over the cap. Probes never exceed about twice the cap's depth, so a cap under
half the host's memory keeps every probe clear of the machine's limit.

    bench/gpu/largest_offload.py --build-dir build-gpu --out OUT [--cap-gib 48] [--width 2048 ...]
"""
import argparse
import json
import os
import subprocess
import sys
import time
from gpt_args import add_gpt_args

HERE = os.path.dirname(os.path.abspath(__file__))
GiB = 2 ** 30


def probe(cmd, env, timeout_s):
    """Runs one depth; the result line, or None when the run failed (out of memory, say)."""
    t = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"    timed out after {timeout_s} s", flush=True)
        return None
    if p.returncode != 0:
        tail = (p.stdout[-600:] + p.stderr[-600:]).strip().splitlines()[-3:]
        print(f"    failed ({p.returncode}): {' | '.join(tail)}", flush=True)
        return None
    r = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    r["wall_s"] = time.time() - t
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build-gpu")
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--cap-gib", type=float, default=48.0)
    add_gpt_args(ap, warmup=1, steps=2, layers=False)  # --layers is what it searches
    ap.add_argument("--probe-layers", default="8,16")
    ap.add_argument("--timeout-s", type=int, default=300)
    ap.add_argument("--only", default="", help="comma-separated substrings of contender names")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cap = args.cap_gib * GiB
    bench = os.path.join(args.build_dir, "bench", "gpu_gpt_bench")
    fsdp2 = [sys.executable, os.path.join(HERE, "fsdp2_gpt.py")]
    contenders = {
        "libfsdp offload, FusedAdamW, step in backward": [bench, "--mode", "fsdp", "--strategy", "FULL_SHARD",
                                                           "--offload", "--optimizer", "fused",
                                                           "--step-in-backward"],
        "PyTorch FSDP2 offload, AdamW(fused)": fsdp2 + ["--offload", "--optimizer", "fused"],
    }
    if args.only:
        keys = [k for k in args.only.split(",") if k]
        contenders = {n: c for n, c in contenders.items() if any(k in n for k in keys)}
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29574", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    raw = open(os.path.join(args.out, "raw-largest-offload.jsonl"), "a")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for name, base in contenders.items():
        runs = {}

        def run(layers):
            if layers not in runs:
                cmd = base + ["--layers", str(layers), "--width", str(args.width), "--heads", str(args.heads),
                              "--context", str(args.context), "--batch", str(args.batch), "--warmup",
                              str(args.warmup), "--steps", str(args.steps), "--dtype", "f32", "--mixed-precision",
                              "--peak-tflops", "1", "--label", name]
                print(f"{name}: {layers} layers", flush=True)
                r = probe(cmd, env, args.timeout_s)
                fits = r is not None and r["host_peak_rss_bytes"] <= cap
                if r is not None:
                    print(f"    host peak {r['host_peak_rss_bytes'] / GiB:.2f} GiB, device peak "
                          f"{r['reserved_peak_bytes'] / GiB:.2f} GiB, {r['step_ms']:.0f} ms/step: "
                          f"{'fits' if fits else 'over the cap'}", flush=True)
                    r.update({"section": "largest-offload", "layers": layers, "cap_bytes": cap, "fits": fits,
                              "command": " ".join(cmd)})
                    raw.write(json.dumps(r) + "\n")
                    raw.flush()
                runs[layers] = (fits, r)
            return runs[layers][0]

        a, b = (int(x) for x in args.probe_layers.split(","))
        if not (run(a) and run(b)):
            rows.append((name, None, runs))
            continue
        ha, hb = runs[a][1]["host_peak_rss_bytes"], runs[b][1]["host_peak_rss_bytes"]
        per_layer = max((hb - ha) / (b - a), 1.0)
        guess = min(max(b, int(b + (cap - hb) // per_layer)), 8 * b)  # a flat line must not probe the host limit
        largest = guess
        if run(guess):
            while run(largest + 1):
                largest += 1
        else:
            while largest > b and not run(largest - 1):
                largest -= 1
            largest -= 1
        rows.append((name, largest, runs))

    lines = [f"# Largest GPT trained with CPU offload under a {args.cap_gib:g} GiB host cap", "",
             f"Produced by `bench/gpu/largest_offload.py`, {started}. Width {args.width}, {args.heads} heads, "
             f"context {args.context}, {args.batch} sequences per step; f32 masters, bf16 compute; "
             f"{args.warmup} warm-up + {args.steps} timed steps per probe. A depth fits when its run succeeds "
             f"and its host peak (VmHWM) is at most the cap. World size 1.", "",
             "| contender | largest depth | parameters (B) | host peak GiB | next depth | device peak reserved GiB "
             "| step ms |", "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for name, largest, runs in rows:
        if largest is None:
            lines.append(f"| {name} | none of the probes fit | | | | | |")
            continue
        r = runs[largest][1]
        nxt = runs.get(largest + 1)
        after = "not run" if nxt is None else ("failed" if nxt[1] is None else
                                               f"{nxt[1]['host_peak_rss_bytes'] / GiB:.2f} GiB, over")
        lines.append(f"| {name} | {largest} | {r['params'] / 1e9:.3f} | {r['host_peak_rss_bytes'] / GiB:.2f} | "
                     f"{after} | {r['reserved_peak_bytes'] / GiB:.2f} | {r['step_ms']:.0f} |")
    done = [(n, l, runs) for n, l, runs in rows if l is not None]
    if len(done) == 2:
        lines += ["", f"Parameters, {done[0][0]} / {done[1][0]}: "
                      f"{done[0][2][done[0][1]][1]['params'] / done[1][2][done[1][1]][1]['params']:.3f}"]
    with open(os.path.join(args.out, "largest_offload.md"), "a") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
