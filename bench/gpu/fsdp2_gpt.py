#!/usr/bin/env python3
"""PyTorch FSDP2 contender of the GPU benchmark (bench/gpu/run.py).

The GPT of examples/gpt/model.cpp (the module definitions are bench/peers/ddp_gpt.py's), in one
dtype on one CUDA device, each block and then the root wrapped with torch.distributed.fsdp's
fully_shard (FSDP2) over a NCCL process group of WORLD_SIZE ranks (1 on the benchmark machine),
trained with AdamW (PyTorch's default implementation on CUDA, foreach). The step and the reported
figures are gpu_gpt_bench's: zero_grad, forward, loss, backward, optimizer step and reading the
loss; one JSON line per run.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 RANK=0 WORLD_SIZE=1 python3 fsdp2_gpt.py --layers 24 ...
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from ddp_gpt import GPT, Block  # noqa: E402
from gpt_args import add_gpt_args


def gpt2_init(model, layers):
    """GPT-2's scheme, as gpt::initialize: N(0, 0.02) weights, residual projections / sqrt(2L)."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear):
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn.proj", "mlp.proj")) else 0.02
                m.weight.normal_(0.0, std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, torch.nn.Embedding):
                m.weight.normal_(0.0, 0.02)
            elif isinstance(m, torch.nn.LayerNorm):
                m.weight.fill_(1.0)
                m.bias.zero_()


def main():
    ap = argparse.ArgumentParser()
    add_gpt_args(ap, warmup=3, steps=10)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--result", default="")
    ap.add_argument("--label", default="PyTorch FSDP2")
    ap.add_argument("--optimizer", choices=["adamw", "fused"], default="adamw",
                    help="adamw: torch.optim.AdamW's default (foreach on CUDA); fused: AdamW(fused=True)")
    ap.add_argument("--mixed-precision", action="store_true",
                    help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32) over --dtype masters (use --dtype f32)")
    ap.add_argument("--offload", action="store_true",
                    help="CPUOffloadPolicy(): shards, gradients and the optimizer step in host memory")
    args = ap.parse_args()

    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    torch.manual_seed(args.seed)
    built = time.perf_counter()
    with torch.device(device):  # built and initialized on the GPU, as gpu_gpt_bench's deferred init
        model = GPT(256, args.context, args.width, args.layers, args.heads)
    gpt2_init(model, args.layers)
    model.to(dtype)
    n_params = sum(p.numel() for p in model.parameters())  # the tied weight once
    policies = {}
    if args.mixed_precision:
        policies["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policies["offload_policy"] = CPUOffloadPolicy() if args.offload else OffloadPolicy()
    for block in model.blocks:
        fully_shard(block, **policies)
    fully_shard(model, **policies)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=True if args.optimizer == "fused" else None)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - built

    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed + 1000)
    per_rank = args.batch // world
    step_s, losses, phases = [], [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            torch.cuda.reset_peak_memory_stats(device)
        tokens = torch.randint(0, 256, (args.batch, args.context + 1), generator=gen, device=device)
        tokens = tokens[rank * per_rank:(rank + 1) * per_rank]
        torch.cuda.synchronize()
        start = time.perf_counter()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]  # phase boundaries, device timeline
        ev[0].record()
        optimizer.zero_grad()
        logits = model(tokens[:, :args.context])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256).float(), tokens[:, 1:].reshape(-1))
        ev[1].record()
        loss.backward()
        ev[2].record()
        opt_start = time.perf_counter()
        optimizer.step()
        opt_wall = time.perf_counter() - opt_start
        ev[3].record()
        value = loss.item()
        secs = time.perf_counter() - start
        losses.append(value)
        if step >= args.warmup:
            step_s.append(secs)
            ev[3].synchronize()
            phases.append([ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2]), ev[2].elapsed_time(ev[3]),
                           opt_wall * 1e3])

    stats = torch.cuda.memory_stats(device)
    step = statistics.median(step_s)
    tokens_per_s = args.batch * args.context / step
    flops_per_token = 6.0 * n_params + 12.0 * args.layers * args.context * args.width
    tflops = flops_per_token * tokens_per_s / 1e12
    peak = args.peak_tflops
    out = {"mode": "fsdp2", "label": args.label, "device": torch.cuda.get_device_name(device), "world": world,
           "torch": torch.__version__, "strategy": "fully_shard", "dtype": args.dtype, "optimizer": args.optimizer, "layers": args.layers,
           "width": args.width, "heads": args.heads, "context": args.context, "batch": args.batch,
           "params": n_params, "warmup": args.warmup, "steps": args.steps, "build_s": build_s,
           "step_ms": step * 1e3, "step_ms_all": step_s,
           "forward_ms": statistics.median(p[0] for p in phases), "backward_ms": statistics.median(p[1] for p in phases),
           "optimizer_ms": statistics.median(p[2] for p in phases),
           "optimizer_wall_ms": statistics.median(p[3] for p in phases),
           "mixed_precision": args.mixed_precision, "offload": args.offload,
           "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "tokens_per_s": tokens_per_s, "tflops": tflops,
           "peak_tflops": peak, "mfu": tflops / peak if peak > 0 else 0.0, "losses": losses,
           "allocated_peak_bytes": stats.get("allocated_bytes.all.peak", 0),
           "reserved_peak_bytes": stats.get("reserved_bytes.all.peak", 0),
           "num_alloc_retries": stats.get("num_alloc_retries", 0)}
    if rank == 0:
        print(json.dumps(out), flush=True)
        if args.result:
            with open(args.result, "a") as f:
                f.write(json.dumps(out) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
