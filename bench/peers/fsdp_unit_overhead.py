#!/usr/bin/env python3
"""PyTorch FSDP's per-unit CPU overhead on the model of bench/unit_overhead.cpp.

Many tiny units (Linear(W, W) + tanh, each Linear its own FSDP unit by ModuleWrapPolicy), trained
with and without FSDP in one process, rounds interleaved; (FSDP - plain) / units is the cost per
unit per iteration. Needs PyTorch 2.x (FSDP1 on the CPU over Gloo): run it in the trixie root.

  scripts/trixie.sh run -- env USE_LIBUV=0 build/tools/fsdp-run --nproc-per-node 2 \\
      --threads-per-rank 1 /usr/bin/python3 bench/peers/fsdp_unit_overhead.py [--units 256]

Prints (rank 0) one row per FSDP configuration, in the columns of the C++ benchmark.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn


class Tiny(nn.Module):
    def __init__(self, units, width):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(units))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def seconds_per_step(model, opt, x, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=256)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    torch.manual_seed(1)
    local = Tiny(args.units, args.width)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.01)
    # Its best documented settings for a small model: the rate limiter and prefetching on.
    configs = {
        "FULL_SHARD": dict(sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True),
        "FULL_SHARD+fwd_prefetch": dict(sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
                                        forward_prefetch=True),
        "FULL_SHARD,flat_params": dict(sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=False),
    }
    contenders = {}
    for name, kw in configs.items():
        torch.manual_seed(1)
        m = FSDP(Tiny(args.units, args.width), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                 device_id=torch.device("cpu"), limit_all_gathers=True,
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE, **kw)
        contenders[name] = (m, torch.optim.SGD(m.parameters(), lr=0.01))
    for _ in range(args.warmup):
        seconds_per_step(local, local_opt, x, 1)
        for m, o in contenders.values():
            seconds_per_step(m, o, x, 1)
    t_local, t = [], {name: [] for name in contenders}
    for _ in range(args.reps):
        t_local.append(seconds_per_step(local, local_opt, x, args.steps))
        for name, (m, o) in contenders.items():
            t[name].append(seconds_per_step(m, o, x, args.steps))
    if rank == 0:
        local_us = statistics.median(t_local) * 1e6
        print(f"# PyTorch {torch.__version__} FSDP1, units {args.units}, Linear({args.width},{args.width})+tanh each, "
              f"batch {args.batch}, world {world}, Gloo, limit_all_gathers, BACKWARD_PRE")
        print(f"{'contender':>24} {'local_us':>10} {'fsdp_us':>10} {'ratio':>8} {'us/unit/iter':>14}")
        for name in contenders:
            fsdp_us = statistics.median(t[name]) * 1e6
            # As in the C++ benchmark: the median of the rounds' paired differences.
            extra_us = statistics.median((f - l) * 1e6 for f, l in zip(t[name], t_local))
            print(f"{name:>24} {local_us:10.0f} {fsdp_us:10.0f} {fsdp_us / local_us:8.2f} "
                  f"{extra_us / args.units:14.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
