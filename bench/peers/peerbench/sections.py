"""The peers, malloc and memory sections: which contenders run, in which order, how often."""
import sys

from .config import MALLOC_MODES
from .util import log


def section_peers(bench):
    p = bench.preset
    groups = []
    for size in p["sizes"]:
        for world in p["worlds"]:
            inputs = bench.write_inputs(size, world, p["warmup"], p["steps"])
            cs = bench.contenders(world)
            runs = {c["key"]: [] for c in cs}
            failures = {c["key"]: [] for c in cs}
            for rep in range(p["reps"]):
                order = cs[rep % len(cs):] + cs[:rep % len(cs)]  # rotated: no contender always first
                for c in order:
                    res, wall, failed = bench.run_tried(c, f"{size['name']} w{world} rep {rep + 1}", size, world,
                                                        inputs, p["warmup"], p["steps"])
                    failures[c["key"]] += failed
                    if res is None:
                        continue
                    res.update({"section": "peers", "size": size["name"], "rep": rep, "key": c["key"]})
                    runs[c["key"]].append(res)
                    log(f"{size['name']} w{world} rep {rep + 1}/{p['reps']}: {c['label']:<40} "
                        f"{res['median_step_s'] * 1000:9.1f} ms/step  (load {res['load_before'][0]:.1f}, "
                        f"{wall:.0f} s)")
            groups.append({"size": size, "world": world, "contenders": cs, "runs": runs, "failures": failures})
    return groups


def section_malloc(bench):
    """Diagnosis of the step-time gap without communication: one process, one thread, the
    per-rank batch of the peers section; Python eager, the C++ frontend, the C++ frontend with
    an operator callback, libfsdp NO_SHARD at world 1; glibc default and steady malloc;
    interleaved."""
    m = bench.preset["malloc_diagnosis"]
    size = dict(next(s for s in bench.preset["sizes"] if s["name"] == m["size"]), batch_per_rank=m["batch_per_rank"])
    warmup, steps = bench.preset["warmup"], bench.preset["steps"]
    inputs = bench.write_inputs(size, 1, warmup, steps)
    catalog = {
        "pylocal": {"key": "pylocal", "label": "PyTorch eager (Python, no DDP)", "kind": "pylocal"},
        "local1": {"key": "local1", "label": "LibTorch C++ frontend", "kind": "local"},
        "local_callback": {"key": "local_callback", "label": "LibTorch C++ + operator callback", "kind": "local",
                           "callback": True},
        "NO_SHARD": {"key": "NO_SHARD", "label": "libfsdp NO_SHARD (world 1)", "kind": "fsdp",
                     "strategy": "NO_SHARD", "factor": 0},
    }
    cs = []
    for key in m["contenders"]:
        if key == "pylocal" and not bench.ddp_available:
            continue
        cs.append(dict(catalog[key], threads=1))
    variants = [(c, mode) for mode in ("default", "steady") for c in cs]
    runs = {(c["key"], mode): [] for c, mode in variants}
    for rep in range(m["reps"]):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for c, mode in order:
            res, wall, failed = bench.run_tried(c, f"malloc ({mode})", size, 1, inputs, warmup, steps,
                                                env=MALLOC_MODES[mode])
            if res is None:
                continue
            res.update({"section": "malloc", "size": size["name"], "rep": rep, "key": c["key"], "malloc": mode})
            runs[(c["key"], mode)].append(res)
            log(f"malloc rep {rep + 1}/{m['reps']}: {c['label']:<34} {mode:<8} "
                f"{res['median_step_s'] * 1000:8.1f} ms/step  (load {res['load_before'][0]:.1f})")
    return {"size": size, "contenders": cs, "runs": runs}


def section_memory(bench):
    m = bench.preset["memory"]
    size = next(s for s in bench.preset["sizes"] if s["name"] == m["size"])
    world = m["world"]
    warmup, steps = max(2, bench.preset["warmup"]), bench.preset["steps"]
    c = {"key": "FULL_SHARD", "label": "libfsdp FULL_SHARD", "kind": "fsdp", "strategy": "FULL_SHARD",
         "factor": 0, "threads": bench.preset["threads_per_rank"]}
    inputs = bench.write_inputs(size, world, warmup, steps)
    runs = {w: [] for w in m["wraps"]}
    for rep in range(m["reps"]):
        order = m["wraps"][rep % len(m["wraps"]):] + m["wraps"][:rep % len(m["wraps"])]
        for wrap in order:
            margs = bench.model_args(size, world, warmup, steps)
            argv = [bench.gpt_bench, "--mode", "fsdp", "--strategy", "FULL_SHARD", "--wrap", wrap,
                    "--threads", str(c["threads"]), "--count-allocations", "--inputs", inputs] + margs
            res, rc, tail, wall = bench.launch(argv, world, c["threads"], f"FULL_SHARD wrap={wrap}", 900)
            if res is None:
                sys.exit(f"run.py: memory run failed (exit {rc}):\n{tail}")
            res.update({"section": "memory", "size": size["name"], "rep": rep, "wrap": wrap})
            runs[wrap].append(res)
            log(f"memory w{world} rep {rep + 1}/{m['reps']}: wrap {wrap:<9} {res['median_step_s'] * 1000:9.1f} "
                f"ms/step, {len(res['units'])} units")
    return {"size": size, "world": world, "runs": runs}
