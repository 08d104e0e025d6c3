"""Markdown tables, medians of runs and the header every report starts with."""
import os
import statistics


def median_of(runs, field="median_step_s"):
    vals = [r[field] for r in runs]
    return statistics.median(vals) if vals else None


def table(header, rows, align=None):
    align = align or ["l"] + ["r"] * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def header_block(bench, title, started, finished):
    m = bench.machine
    lines = [f"# {title}", "",
             f"Produced by `{bench.command}` from the repository root, {started:%Y-%m-%d %H:%M} to "
             f"{finished:%H:%M} UTC, commit {m['commit']}.", "",
             "Machine: " + "; ".join(m["cpu"]) + f"; {m['usable_cpus']} usable CPUs; memory {m['memory']}; "
             f"Linux {m['kernel']}; Debian {m['debian']}.",
             "Packages: " + ", ".join(f"{k} {v}" for k, v in m["packages"].items()) + ".",
             f"Load average (1 min) at the start {bench.load_start[0]:.2f}, at the end "
             f"{os.getloadavg()[0]:.2f}. Other jobs share this machine: contenders are interleaved and "
             "the tables give medians over repetitions; each run's load average is in the raw data.", ""]
    return lines
