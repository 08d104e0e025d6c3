"""The command line: parses it, runs the chosen sections, writes their reports, plots and raw results."""
import argparse
import datetime
import json
import os
import shlex
import sys

from .checks import check_outputs
from .config import MALLOC_MODES, PRESETS, ROOT
from .largest import section_largest
from .launch import Bench
from .machine import machine_description
from .plots import plot_largest, plot_memory, plot_peers
from .report_largest import report_largest
from .report_malloc import report_malloc
from .report_memory import report_memory
from .report_peers import report_peers
from .sections import section_malloc, section_memory, section_peers
from .tables import header_block
from .util import log


def main(doc):
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--sections", default="peers,malloc,memory,largest",
                    help="comma-separated: peers,malloc,memory,largest")
    ap.add_argument("--reps", type=int, help="override the preset's repetitions (peers section)")
    ap.add_argument("--largest-fsdp-args", default="",
                    help="extra gpt_bench options for every probe of the largest section, e.g. "
                         "'--reductions-in-flight 1 --all-gather-limit 1' (FSDP's memory-saving settings)")
    ap.add_argument("--largest-malloc", help="comma-separated malloc modes of the largest section (default: the "
                                             "preset's, e.g. default,mmap)")
    ap.add_argument("--largest-criteria", help="comma-separated criteria of the largest section: whole, steps")
    ap.add_argument("--largest-contenders",
                    help="comma-separated contenders of the largest section (default: NO_SHARD,FULL_SHARD, and "
                         "py_FULL_SHARD, PyTorch FSDP, where the Python's torch is 2.x)")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--python", default="/usr/bin/python3", help="Python with python3-torch, for DDP")
    ap.add_argument("--check", action="store_true",
                    help="verify the written tables (exit 1 on a problem, 77 if DDP could not run)")
    args = ap.parse_args()
    preset = json.loads(json.dumps(PRESETS[args.preset]))
    if args.reps:
        preset["reps"] = args.reps
    if args.largest_malloc:
        preset["largest"]["malloc"] = args.largest_malloc.split(",")
        for m in preset["largest"]["malloc"]:
            if m not in MALLOC_MODES:
                sys.exit(f"run.py: unknown --largest-malloc {m!r}; choose from {', '.join(MALLOC_MODES)}")
    if args.largest_criteria:
        preset["largest"]["criteria"] = args.largest_criteria.split(",")
        for c in preset["largest"]["criteria"]:
            if c not in ("whole", "steps"):
                sys.exit(f"run.py: unknown --largest-criteria {c!r}; choose from whole, steps")
    if args.largest_contenders:
        preset["largest"]["contenders"] = args.largest_contenders.split(",")
        for c in preset["largest"]["contenders"]:
            if c not in ("NO_SHARD", "FULL_SHARD", "py_FULL_SHARD", "py_NO_SHARD"):
                sys.exit(f"run.py: unknown --largest-contenders {c!r}; choose from NO_SHARD, FULL_SHARD, "
                         "py_FULL_SHARD, py_NO_SHARD")
    sections = [s for s in args.sections.split(",") if s]
    for s in sections:
        if s not in ("peers", "malloc", "memory", "largest"):
            sys.exit(f"run.py: unknown section {s!r}; choose from peers, malloc, memory, largest")

    bench = Bench(args, preset)
    argv = sys.argv[1:]
    bench.command = shlex.join(["bench/peers/run.py"] + argv)
    bench.machine = machine_description(args.python)
    bench.load_start = os.getloadavg()
    bench.gnuplot = next((os.path.join(d, "gnuplot") for d in os.environ.get("PATH", "").split(":")
                          if os.access(os.path.join(d, "gnuplot"), os.X_OK)), None)
    log(f"preset {args.preset}, sections {','.join(sections)}; DDP: "
        f"{bench.ddp_reason if not bench.ddp_available else 'PyTorch ' + bench.ddp_reason}; "
        f"gnuplot: {bench.gnuplot or 'not found (no plots)'}")
    started = datetime.datetime.utcnow()

    groups = []
    if "peers" in sections:
        groups = section_peers(bench)
        lines, summary_rows, cols = report_peers(bench, groups)
        plot_peers(bench, summary_rows, cols, groups)
        with open(os.path.join(bench.out, "peers.md"), "w") as f:
            f.write("\n".join(header_block(bench, "libfsdp against PyTorch DDP and local training", started,
                                           datetime.datetime.utcnow()) + lines) + "\n")
    if "malloc" in sections:
        md = section_malloc(bench)
        with open(os.path.join(bench.out, "malloc.md"), "w") as f:
            f.write("\n".join(header_block(bench, "Diagnosis of the step-time gap: language, allocator and FSDP runtime, without communication", started,
                                           datetime.datetime.utcnow()) + report_malloc(bench, md)) + "\n")
    if "memory" in sections:
        mem = section_memory(bench)
        lines, plot = report_memory(bench, mem)
        plot_memory(bench, plot)
        with open(os.path.join(bench.out, "memory.md"), "w") as f:
            f.write("\n".join(header_block(bench, "FULL_SHARD memory against the formula, by wrap granularity",
                                           started, datetime.datetime.utcnow()) + lines) + "\n")
    if "largest" in sections:
        lg = section_largest(bench)
        lines = report_largest(bench, lg)
        plot_largest(bench, lg)
        with open(os.path.join(bench.out, "largest.md"), "w") as f:
            f.write("\n".join(header_block(bench, "Largest trainable model under a per-rank memory cap",
                                           started, datetime.datetime.utcnow()) + lines) + "\n")
    # Every run's full result, one file per section, so that running one section again leaves the
    # others' raw data alone.
    for section in sections:
        with open(os.path.join(bench.out, f"raw-{section}.jsonl"), "w") as f:
            for r in bench.raw:
                if r.get("section") == section:
                    f.write(json.dumps(r) + "\n")
    log(f"wrote {', '.join(s + '.md' for s in sections)} and raw-*.jsonl to {bench.out}")

    if args.check:
        problems = check_outputs(bench, groups, sections)
        skips = [p for p in problems if p.startswith("skip: ")]
        errors = [p for p in problems if not p.startswith("skip: ")]
        for p in errors:
            print("CHECK FAILED: " + p)
        if errors:
            return 1
        if skips:
            print("SKIPPED (the rest passed): " + "; ".join(p[6:] for p in skips))
            return 77
        print("check passed: every table parses and names every contender; losses agree with local training")
    return 0
