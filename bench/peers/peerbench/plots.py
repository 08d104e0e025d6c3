"""The gnuplot data, scripts and PNGs of the peers, memory and largest sections."""
import os
import statistics
import subprocess

from .config import MiB
from .util import log


def gnuplot(bench, name, script, data):
    gp = os.path.join(bench.out, "plots")
    os.makedirs(gp, exist_ok=True)
    with open(os.path.join(gp, f"{name}.dat"), "w") as f:
        f.write(data)
    with open(os.path.join(gp, f"{name}.gp"), "w") as f:
        f.write(script)
    if not bench.gnuplot:
        return False
    r = subprocess.run([bench.gnuplot, f"{name}.gp"], cwd=gp, capture_output=True, text=True)
    if r.returncode != 0:
        log(f"gnuplot failed for {name}: {r.stderr[-500:]}")
        return False
    return True


PNG = "set terminal pngcairo noenhanced size 1000,560 font 'DejaVu Sans,10'\n"


# Bar colours by strategy; PyTorch's contenders and libfsdp's Gloo TCP runs are told apart by fill.
STRATEGY_COLOURS = {"NO_SHARD": "#d62728", "FULL_SHARD": "#1f77b4", "SHARD_GRAD_OP": "#9467bd",
                    "HYBRID_SHARD": "#2ca02c", "DDP": "#17becf", "local": "#7f7f7f"}


def histogram_clause(dat, labels):
    """gnuplot plot clause: one bar per column of `dat` (labels in column order), styled by label."""
    parts = []
    for i, label in enumerate(labels, start=2):
        strategy = next((k for k in STRATEGY_COLOURS if k in label), "local")
        fill = ("fs pattern 2" if label.startswith("PyTorch FSDP") else
                "fs pattern 4" if "(Gloo TCP)" in label else "fs solid 0.8")
        parts.append(f"'{dat}' using {i}:xtic(1) title columnhead({i}) lc rgb '{STRATEGY_COLOURS[strategy]}' {fill}")
    return ", \\\n     ".join(parts)


def plot_peers(bench, summary_rows, cols, groups):
    keys = list(summary_rows)
    data = "group " + " ".join(f'"{summary_rows[k]["label"]}"' for k in keys) + "\n"
    for s, w in cols:
        data += f'"{s}, w{w}" ' + " ".join(
            "NaN" if summary_rows[k].get((s, w)) is None else f"{summary_rows[k][(s, w)]:.4f}" for k in keys) + "\n"
    script = PNG + f"""set output '../peers_step_ratio.png'
set title 'Step time / PyTorch DDP (median of interleaved runs; lower is faster)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set key below
set ylabel 'step time / DDP'
set yrange [0:*]
set grid ytics
plot {histogram_clause('peers_step_ratio.dat', [summary_rows[k]['label'] for k in keys])}, \\
     1 with lines lc 'black' dt 2 notitle
"""
    ok = gnuplot(bench, "peers_step_ratio", script, data)
    data = "group " + " ".join(f'"{summary_rows[k]["label"]}"' for k in keys) + "\n"
    for s, w in cols:
        data += f'"{s}, w{w}" ' + " ".join(
            "NaN" if summary_rows[k]["cpu"].get((s, w)) is None else f"{summary_rows[k]['cpu'][(s, w)]:.4f}"
            for k in keys) + "\n"
    script = script.replace("peers_step_ratio", "peers_cpu_ratio").replace(
        "Step time / PyTorch DDP (median of interleaved runs; lower is faster)",
        "CPU time per step (all ranks) / PyTorch DDP (median of interleaved runs; lower is cheaper)").replace(
        "ylabel 'step time / DDP'", "ylabel 'CPU time / DDP'")
    ok = gnuplot(bench, "peers_cpu_ratio", script, data) and ok
    # Peak RSS per contender and group.
    data = "group " + " ".join(f'"{summary_rows[k]["label"]}"' for k in keys) + "\n"
    for g in groups:
        vals = []
        for k in keys:
            runs = g["runs"].get(k, [])
            vals.append("NaN" if not runs else
                        f"{statistics.median(max(x['vmhwm_bytes'] for x in r['ranks']) for r in runs) / MiB:.1f}")
        data += f'"{g["size"]["name"]}, w{g["world"]}" ' + " ".join(vals) + "\n"
    script = PNG + f"""set output '../peers_rss.png'
set title 'Peak resident memory per rank (VmHWM, largest over ranks, MiB)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set key below
set ylabel 'MiB'
set yrange [0:*]
set grid ytics
plot {histogram_clause('peers_rss.dat', [summary_rows[k]['label'] for k in keys])}
"""
    return gnuplot(bench, "peers_rss", script, data) and ok


def plot_memory(bench, plot):
    data = "# wrap(units) params grads adamw measured formula step_ms\n"
    for wrap, n, p, g, a, meas, form, med in plot:
        data += f"{wrap}({n}) {p / MiB:.3f} {g / MiB:.3f} {a / MiB:.3f} {meas / MiB:.3f} {form / MiB:.3f} " \
                f"{med * 1000:.2f}\n"
    script = PNG + """set output '../memory_wrap.png'
set title 'FULL_SHARD per-rank model state at peak (formula, stacked; points: measured) and step time'
set style data histograms
set style histogram rowstacked
set style fill solid 0.7 border -1
set boxwidth 0.6
set key outside right top
set ylabel 'MiB per rank'
set y2label 'step time (ms)'
set yrange [0:*]
set y2range [0:*]
set ytics nomirror
set y2tics
set grid ytics
plot 'memory_wrap.dat' using 2:xtic(1) title 'parameters peak', '' using 3 title 'gradients peak', \\
     '' using 4 title 'AdamW state', \\
     '' using 0:5 with points pt 7 ps 2 lc 'black' title 'measured total', \\
     '' using 0:7 axes x1y2 with linespoints pt 5 lw 2 lc 'red' title 'step time (right axis)'
"""
    return gnuplot(bench, "memory_wrap", script, data)


def plot_largest(bench, lg):
    """Every completed probe (from any search) of each strategy and malloc mode: the whole
    process's peak (solid) and the steps' own peak (dashed) per rank, largest over ranks."""
    series = {}
    for r in bench.raw:
        if r.get("section") != "largest" or not r.get("malloc"):
            continue
        key = (r["label"].split()[0], r["malloc"])
        series.setdefault(key, {})[r["parameters"]] = (max(x["vmhwm_bytes"] for x in r["ranks"]),
                                                       max(x["vmhwm_train_bytes"] for x in r["ranks"]))
    data, plots, colors = "", [], ["'#1f77b4'", "'#d62728'", "'#2ca02c'", "'#ff7f0e'"]
    for i, (key, points) in enumerate(sorted(series.items())):
        data += f"# {key[0]} malloc {key[1]}: parameters (M), whole-process peak MiB, steps peak MiB\n"
        for n in sorted(points):
            data += f"{n / 1e6:.3f} {points[n][0] / MiB:.1f} {points[n][1] / MiB:.1f}\n"
        data += "\n\n"
        color = colors[i % len(colors)]
        plots.append(f"'largest.dat' index {i} using 1:2 with linespoints pt 7 lc rgb {color} "
                     f"title '{key[0]}, malloc {key[1]}: whole process'")
        plots.append(f"'largest.dat' index {i} using 1:3 with linespoints pt 6 dt 2 lc rgb {color} "
                     f"title '{key[0]}, malloc {key[1]}: steps only'")
    script = PNG + f"""set output '../largest.png'
set title 'Largest-model search, world {lg["world"]}: peak resident memory per rank (largest over ranks) of every probe'
set xlabel 'parameters (millions)'
set ylabel 'peak RSS per rank (MiB)'
set logscale x
set grid
set key left top
set yrange [0:{2 * lg['cap_mib']}]
plot {", ".join(plots)}, {lg['cap_mib']} with lines lw 2 lc 'black' dt 3 title 'cap ({lg['cap_mib']} MiB)'
"""
    return gnuplot(bench, "largest", script, data)
