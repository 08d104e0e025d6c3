"""largest.md: the deepest model each contender trains under the memory cap."""
from .config import MiB
from .tables import table
from .util import fmt, mib


def report_largest(bench, lg):
    cap = lg["cap_mib"]
    size = lg["size"]
    lines = [f"World {lg['world']}, width {size['width']}, {size['heads']} heads, context {size['context']}, "
             f"{size['batch_per_rank']} sequence(s) per rank, wrap block, AdamW; depth found by doubling then "
             f"bisection. Cap: {cap} MiB of resident memory per rank. Each probe trains 2 steps (the first "
             "allocates AdamW state; the second is the steady state) and passes if every rank's VmHWM "
             "(the kernel's exact resident high-water mark) stays within the cap. A watchdog thread in each "
             "rank samples VmRSS every millisecond and aborts a probe that passes the cap early (with the "
             "'steps only' criterion it aborts at twice the cap: initialization may exceed the cap there). "
             "The cap is enforced on measured peaks, not by the kernel (no cgroup or rlimit: the machine's "
             "memory cgroups belong to its sandbox, and RLIMIT_AS/RLIMIT_DATA count reserved address space, "
             "not memory).", ""]
    if bench.largest_fsdp_args:
        lines += [f"libfsdp options of every probe (both strategies): `{' '.join(bench.largest_fsdp_args)}`.", ""]
    if lg.get("baseline_bytes"):
        lines += [f"CI variant: the cap is the 1-layer NO_SHARD footprint ({mib(lg['baseline_bytes'])} MiB) "
                  "plus a small margin.", ""]
    rows = []
    by = {}
    for s in lg["searches"]:
        b = s["best"]
        by[(s["strategy"], s["criterion"], s["malloc"])] = s
        fresh = sum(1 for p in s["probes"] if not p.get("reused"))
        rows.append([s["strategy"], s["criterion"], s["malloc"], s["largest_layers"],
                     f"{s['largest_parameters'] / 1e6:.1f}" if s["largest_parameters"] else "0",
                     mib(b["peak_bytes"]) if b else "n/a", mib(b["init_bytes"]) if b else "n/a",
                     mib(b["steps_bytes"]) if b else "n/a", f"{len(s['probes'])} ({fresh} new)",
                     "yes" if s["capped_by_search_limit"] else "no"])
    lines.append(table(["strategy", "criterion", "malloc", "largest depth", "parameters (M)",
                        "peak MiB (criterion)", "init peak MiB", "steps peak MiB", "probes",
                        "hit search limit"], rows))
    lines.append("")
    ratios = []
    for malloc in dict.fromkeys(s["malloc"] for s in lg["searches"]):
        for crit in ("whole", "steps"):
            n, f = by.get(("NO_SHARD", crit, malloc)), by.get(("FULL_SHARD", crit, malloc))
            if n and f and n["largest_parameters"]:
                ratios.append([crit, malloc, f"{n['largest_parameters'] / 1e6:.1f}",
                               f"{f['largest_parameters'] / 1e6:.1f}",
                               f"{f['largest_parameters'] / n['largest_parameters']:.2f}"])
    if ratios:
        lines += ["Largest trainable model, FULL_SHARD / NO_SHARD (parameters):", "",
                  table(["criterion", "malloc", "NO_SHARD M params", "FULL_SHARD M params", "ratio"], ratios), ""]
    peers = []
    for malloc in dict.fromkeys(s["malloc"] for s in lg["searches"]):
        for crit in ("whole", "steps"):
            f, py = by.get(("FULL_SHARD", crit, malloc)), by.get(("py_FULL_SHARD", crit, malloc))
            if f and py:
                ratio = f["largest_parameters"] / py["largest_parameters"] if py["largest_parameters"] else None
                foot = [min((p["peak_bytes"] for p in s["probes"] if p["layers"] == 1 and p["peak_bytes"]),
                            default=None) for s in (f, py)]

                def per_layer(s):
                    """Peak MiB added per block: from the shallowest completed probe of 8 or more
                    blocks to the deepest one that fits."""
                    done = sorted((p["layers"], p["peak_bytes"]) for p in s["probes"] if p["peak_bytes"])
                    lo = next((d for d in done if d[0] >= 8), None)
                    hi = max((d for d in done if d[1] <= cap * MiB), default=None)
                    return (hi[1] - lo[1]) / MiB / (hi[0] - lo[0]) if lo and hi and hi[0] > lo[0] else None
                peers.append([crit, malloc, f"{f['largest_parameters'] / 1e6:.1f}",
                              f"{py['largest_parameters'] / 1e6:.1f}", fmt(ratio),
                              "met" if ratio and ratio >= 1.2 else "missed",
                              mib(foot[0]) if foot[0] else "n/a", mib(foot[1]) if foot[1] else "n/a",
                              fmt(per_layer(f), 1), fmt(per_layer(py), 1)])
    if peers:
        lines += ["Largest trainable model, libfsdp FULL_SHARD / PyTorch FSDP FULL_SHARD (parameters; goal >= 1.2). "
                  "PyTorch FSDP (FSDP1, `ddp_gpt.py --fsdp FULL_SHARD --init meta`) builds the model on the meta "
                  "device and materializes it unit by unit as it wraps it (`to_empty` + `reset_parameters`), "
                  "with its throughput settings (`limit_all_gathers`, forward prefetch, BACKWARD_PRE); part of "
                  "its footprint is the Python interpreter and PyTorch's Python modules, which a C++ program "
                  "does not have: the 1-layer columns are each contender's peak with a 1-layer model, and the "
                  "per-block columns the peak added by each further block (from the shallowest probe of 8 or "
                  "more blocks to the deepest that fits), which that fixed footprint does not enter.", "",
                  table(["criterion", "malloc", "libfsdp M params", "PyTorch FSDP M params", "ratio", "goal",
                         "libfsdp 1-layer peak MiB", "PyTorch 1-layer peak MiB", "libfsdp MiB per block",
                         "PyTorch MiB per block"], peers), ""]
    lines += ["malloc 'default': glibc as it comes (its mmap threshold rises to the largest block freed so far, "
              "up to 32 MiB; later blocks of that size come from the heap, and freed ones often stay resident). "
              "'mmap': `MALLOC_MMAP_THRESHOLD_=524288` in every rank's environment, so every tensor of 512 KiB or "
              "more (every parameter-sized one here) is mapped and unmapped on its own and the resident set "
              "follows the live tensors.", ""]
    init = lg.get("init", "eager")
    how = ("the model is built under `fsdp::DeferredInit` and `fully_shard` allocates, initializes and shards "
           "it one unit at a time (`gpt_bench --init deferred`)" if init == "deferred" else
           "every rank builds the whole model before `fully_shard` shards it (`gpt_bench --init eager`)")
    lines += [f"Criterion 'whole': the whole process, initialization included ({how}). 'steps': the training "
              "steps only (VmHWM restarted after initialization), i.e. what the model needs once it is sharded.", "",
              "![probes](largest.png)", ""]
    return lines
