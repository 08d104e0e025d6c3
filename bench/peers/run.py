#!/usr/bin/python3
"""libfsdp against its peers: PyTorch DDP, local LibTorch training, the paper's memory formula and
the largest trainable model under a per-rank memory cap.

    bench/peers/run.py                      # the full benchmark; writes bench/results/*.md and *.png
    bench/peers/run.py --preset ci --check  # the CI-sized variant (ctest bench.peers_ci)

Sections (--sections, default all):
  peers    The same GPT (examples/gpt/model.cpp: architecture, initial weights, batches, AdamW) as
           (a) one LibTorch process on the whole machine, (b) libfsdp NO_SHARD, FULL_SHARD,
           SHARD_GRAD_OP, HYBRID_SHARD, (c) PyTorch DDP over Gloo (bench/peers/ddp_gpt.py, Debian's
           python3-torch), for each model size and world size. Contenders are interleaved: every
           repetition runs each once, in an order rotated per repetition; the tables give medians
           over repetitions of each run's median step time, as ratios to DDP measured in the same
           run. Before timing counts, every contender's per-step losses are compared with local
           training's (they start from the same weights and see the same tokens).
  memory   FULL_SHARD at one world size for several wrap granularities: measured peak
           parameter, gradient and AdamW-state bytes per rank against the formula computed from
           the units (FullyShardedModule::units()), and the step time of each granularity.
  malloc   Diagnosis of the step-time gap, in one process (world 1, no communication): the
           compute-bound model in eager Python, in the LibTorch C++ frontend, in the C++ frontend
           with an operator callback like libfsdp's interception, and under libfsdp NO_SHARD, each
           with glibc's default malloc and with the steady setting every other section uses.
  largest  With a fixed per-rank memory cap, the deepest GPT (fixed width) that trains under
           NO_SHARD and under FULL_SHARD, found by doubling then bisection, one short run per probe.

Uses only the Python standard library; the DDP contender needs /usr/bin/python3 with python3-torch
(scripts/setup.sh --bench installs it, and gnuplot-nox for the plots). The work is done by the
modules of bench/peers/peerbench/, one job each; this file is the entry point.
"""
import sys

from peerbench.cli import main

if __name__ == "__main__":
    sys.exit(main(__doc__))
