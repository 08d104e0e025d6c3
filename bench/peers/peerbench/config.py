"""The benchmark's presets, contender strategies and glibc malloc settings."""
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
MiB = 1048576.0

# Contender kinds that run PyTorch's own processes (Python); every other kind runs our binaries.
PYTORCH_KINDS = ("pylocal", "ddp", "pyfsdp")

# Model sizes: name -> GPT shape and sequences per rank per step.
#  compute-bound: 3.3 M parameters and 256 tokens per rank: ~5 GFLOP per rank per step against
#                 13 MB of gradients, so the step is dominated by compute.
#  comm-bound:    12.9 M parameters (52 MB) and 32 tokens per rank: ~2.5 GFLOP per rank against
#                 52 MB all-reduced (DDP) or gathered twice and reduce-scattered (FSDP).
PRESETS = {
    "full": {
        "sizes": [
            {"name": "compute-bound", "layers": 4, "width": 256, "heads": 4, "context": 64, "batch_per_rank": 4},
            {"name": "comm-bound", "layers": 4, "width": 512, "heads": 8, "context": 32, "batch_per_rank": 1},
        ],
        "worlds": [2, 4],
        "reps": 7,
        "warmup": 2,
        "steps": 6,
        "threads_per_rank": 1,
        "tcp_strategies": ["NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"],
        "memory": {"world": 4, "size": "comm-bound", "wraps": ["none", "block", "sublayer", "linear"], "reps": 3},
        "malloc_diagnosis": {"size": "compute-bound", "batch_per_rank": 4,
                             "contenders": ["pylocal", "local1", "local_callback", "NO_SHARD"], "reps": 7},
        "contender_malloc": "steady",
        "largest": {"world": 4, "cap_mib": 1024, "width": 512, "heads": 8, "context": 32, "batch_per_rank": 1,
                    "max_layers": 256, "criteria": ["whole", "steps"], "malloc": ["default", "mmap"],
                    "init": "deferred"},
    },
    "ci": {
        "sizes": [{"name": "tiny", "layers": 2, "width": 64, "heads": 4, "context": 32, "batch_per_rank": 2}],
        "worlds": [2],
        "reps": 1,
        "warmup": 1,
        "steps": 2,
        "threads_per_rank": 1,
        "tcp_strategies": ["FULL_SHARD", "HYBRID_SHARD"],
        "memory": {"world": 2, "size": "tiny", "wraps": ["none", "block"], "reps": 1},
        "malloc_diagnosis": {"size": "tiny", "batch_per_rank": 2,
                             "contenders": ["pylocal", "local1", "local_callback", "NO_SHARD"], "reps": 1},
        "contender_malloc": "steady",
        "largest": {"world": 2, "cap_mib": 0, "cap_over_baseline_mib": 16, "width": 256, "heads": 4, "context": 16,
                    "batch_per_rank": 1, "max_layers": 2, "criteria": ["whole"], "malloc": ["default"],
                    # The cap sits just above libfsdp's own 1-layer footprint, below a Python process's.
                    "contenders": ["NO_SHARD", "FULL_SHARD"]},
    },
}

FSDP_STRATEGIES = ["NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"]

# glibc malloc settings for the largest-model search. "default": glibc's dynamic mmap threshold,
# which rises to the size of the largest block freed so far (up to 32 MiB), after which blocks of
# that size come from the heap and freed ones often stay resident. "mmap": a fixed 512 KiB threshold
# (glibc's MALLOC_MMAP_THRESHOLD_ tunable), so every parameter-sized tensor is mapped and unmapped
# on its own and the resident set follows the live tensors. (A 1 MiB threshold leaves one rank's
# AdamW state of a 1,043,968-byte shard piece on the heap, where it fragments and that rank's peak
# grows.)
MALLOC_MODES = {
    "default": {},
    # Every contender of the peers section (DDP's Python process too): glibc's mmap threshold fixed
    # at 32 MiB (the most its dynamic threshold reaches) and the heap trimmed only when more than
    # 64 MiB at its top are free. With glibc's defaults a LibTorch C++ process returns the top of
    # its heap to the kernel after every backward and faults it in again, zero-filled, in the next
    # step (thousands of page faults per step on the compute-bound model); the Python process
    # does not (its own small objects keep the heap top in use). See malloc.md.
    "steady": {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "67108864"},
    "mmap": {"MALLOC_MMAP_THRESHOLD_": "524288"},
    # Diagnosis only (section "malloc"): large blocks come from the heap and freed memory is never
    # returned to the kernel, so a buffer freed and allocated again reuses resident pages instead
    # of faulting in freshly zeroed ones.
    "keep": {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296"},
}

