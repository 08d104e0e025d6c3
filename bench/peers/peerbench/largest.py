"""The largest section: the deepest GPT that trains under a per-rank memory cap, by doubling then bisection."""
import math
import os
import sys

from .config import MALLOC_MODES, MiB, ROOT
from .util import log


def section_largest(bench):
    L = bench.preset["largest"]
    world = L["world"]
    cap = L["cap_mib"]
    size0 = {"name": "largest", "layers": 1, "width": L["width"], "heads": L["heads"], "context": L["context"],
             "batch_per_rank": L["batch_per_rank"]}
    # The batches depend on context, global batch and steps only: one file (with a 1-layer
    # model's weights, which the probes ignore) serves every depth.
    bench.largest_inputs = bench.write_inputs(dict(size0, layers=1), world, 1, 1)
    baseline = None
    if not cap:
        # CI: a cap just above the process's own footprint, so a tiny search exercises the logic.
        res, rc, tail, wall = probe(bench, dict(size0, layers=1), "NO_SHARD", world, 0, "default")
        bench.probe_cache[("NO_SHARD", 1, "default")] = (res, rc, tail, wall, 0)
        if res is None:
            sys.exit(f"run.py: baseline probe failed (exit {rc}):\n{tail}")
        baseline = max(r["vmhwm_bytes"] for r in res["ranks"])
        cap = int(math.ceil(baseline / MiB)) + L["cap_over_baseline_mib"]
    searches = []
    for malloc in L["malloc"]:
        for criterion in L["criteria"]:
            for strategy in largest_contenders(bench):
                log(f"largest: {strategy}, cap {cap} MiB per rank ({criterion}, malloc {malloc})")
                searches.append(search(bench, size0, strategy, world, cap, criterion, L["max_layers"], malloc))
    return {"world": world, "cap_mib": cap, "size": size0, "searches": searches, "baseline_bytes": baseline,
            "init": L.get("init", "deferred")}


def largest_contenders(bench):
    """libfsdp NO_SHARD and FULL_SHARD; PyTorch FSDP FULL_SHARD (key py_FULL_SHARD) where the
    Python's torch is 2.x."""
    chosen = bench.preset["largest"].get("contenders")
    if chosen:
        if any(c.startswith("py_") for c in chosen) and not bench.pyfsdp_available:
            sys.exit(f"run.py: PyTorch FSDP contenders need PyTorch 2.x in {bench.python} ({bench.ddp_reason})")
        return chosen
    return ["NO_SHARD", "FULL_SHARD"] + (["py_FULL_SHARD"] if bench.pyfsdp_available else [])


def probe(bench, size, strategy, world, watchdog_mib, malloc):
    if strategy.startswith("py_"):
        # PyTorch FSDP: the model built on the meta device, each unit materialized by FSDP
        # (to_empty + reset_parameters) as it is wrapped: the counterpart of --init deferred.
        argv = [bench.python, os.path.join(ROOT, "bench", "peers", "ddp_gpt.py"), "--fsdp", strategy[3:],
                "--init", "meta", "--layers", str(size["layers"]), "--inputs", bench.largest_inputs,
                "--warmup", "1", "--steps", "1", "--threads", str(bench.preset["threads_per_rank"])]
        if watchdog_mib:
            argv += ["--memory-cap-mib", str(watchdog_mib)]
        return bench.launch(argv, world, bench.preset["threads_per_rank"], f"{strategy} probe L={size['layers']}",
                            1800, extra={"section": "largest", "malloc": malloc}, env=MALLOC_MODES[malloc])
    argv = [bench.gpt_bench, "--mode", "fsdp", "--strategy", strategy, "--wrap", "block", "--threads",
            str(bench.preset["threads_per_rank"]), "--inputs", bench.largest_inputs,
            "--init", bench.preset["largest"].get("init", "deferred")] + bench.model_args(size, world, 1, 1)
    argv += bench.largest_fsdp_args
    if watchdog_mib:
        argv += ["--memory-cap-mib", str(watchdog_mib)]
    return bench.launch(argv, world, bench.preset["threads_per_rank"], f"{strategy} probe L={size['layers']}",
                        1800, extra={"section": "largest", "malloc": malloc}, env=MALLOC_MODES[malloc])


def search(bench, size0, strategy, world, cap_mib, criterion, max_layers, malloc):
    """Deepest model whose peak resident set stays within cap_mib on every rank. criterion
    'whole': the whole process (initialization included); 'steps': the training steps only
    (VmHWM restarted after initialization). The watchdog aborts a rank that passes the cap
    (whole) or twice the cap (steps: initialization may exceed it; a safety limit)."""
    probes = []
    watchdog = cap_mib if criterion == "whole" else 2 * cap_mib
    key = "vmhwm_bytes" if criterion == "whole" else "vmhwm_train_bytes"

    def fits(layers):
        # A completed probe answers every criterion (it reports both peaks), whatever its
        # watchdog; an aborted one only says that the peak passed the watchdog's limit.
        cache_key = (strategy, layers, malloc)
        for attempt in range(2):
            cached = bench.probe_cache.get(cache_key)
            if cached and (cached[0] is not None or cached[4] >= watchdog):
                res, rc, tail, wall, aborted_over = cached
            else:
                cached = None
                res, rc, tail, wall = probe(bench, dict(size0, layers=layers), strategy, world, watchdog, malloc)
                aborted_over = watchdog if res is None and "exceeds the cap" in tail else 0
                if res is not None or aborted_over:
                    bench.probe_cache[cache_key] = (res, rc, tail, wall, aborted_over)
            if res is not None:
                peak = max(r[key] for r in res["ranks"])
                ok = peak <= cap_mib * MiB
                probes.append({"layers": layers, "parameters": res["parameters"], "ok": ok, "peak_bytes": peak,
                               "init_bytes": max(r["vmhwm_init_bytes"] for r in res["ranks"]),
                               "steps_bytes": max(r["vmhwm_train_bytes"] for r in res["ranks"]),
                               "aborted": False, "wall_s": wall, "reused": bool(cached)})
                log(f"  L={layers:<4} {res['parameters'] / 1e6:8.1f} M params  peak {peak / MiB:8.1f} MiB  "
                    f"{'fits' if ok else 'over the cap'}  ({'earlier probe' if cached else f'{wall:.0f} s'})")
                return ok
            if aborted_over:
                probes.append({"layers": layers, "parameters": None, "ok": False, "peak_bytes": None,
                               "aborted": True, "wall_s": wall, "reused": bool(cached)})
                log(f"  L={layers:<4} aborted by the watchdog (over {aborted_over} MiB)  "
                    f"({'earlier probe' if cached else f'{wall:.0f} s'})")
                return False
            log(f"  L={layers}: probe failed (exit {rc}), attempt {attempt + 1}:\n{tail[-800:]}")
        sys.exit("run.py: a largest-model probe failed twice for a reason other than memory")

    lo, hi = 0, None
    layers = 1
    while layers <= max_layers:
        if fits(layers):
            lo = layers
            layers *= 2
        else:
            hi = layers
            break
    if hi is None:
        hi = max_layers + 1
        log(f"  reached --max-layers {max_layers} without passing the cap")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    best = next((p for p in probes if p["layers"] == lo and p["ok"]), None)
    return {"strategy": strategy, "criterion": criterion, "malloc": malloc, "largest_layers": lo,
            "largest_parameters": best["parameters"] if best else 0, "best": best, "probes": probes,
            "capped_by_search_limit": hi > max_layers}

