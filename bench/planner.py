#!/usr/bin/python3
"""The planner's predictions against measured runs of the example trainer (bench/results/planner.md).

    bench/planner.py BUILD_DIR [--out bench/results/planner.md] [--only N]
    bench/planner.py BUILD_DIR --repeat 8,12,... [--times 5] [--out bench/results/planner_repeat.md]

Runs fsdp_gpt through fsdp-run over a matrix of models (widths, depths), strategies, activation
checkpointing, mixed precision and worlds 1-4, each with --plan-file (the planner's prediction for
that run, made after the trainer loaded its data) and under /usr/bin/time (each rank's peak
resident set). Compares rank 0's FSDP peaks (memory_stats(), the last logged window: steady state)
with the predicted parameter and gradient peaks, the peak resident set of every rank with the
predicted whole-process peak, and the measured ms/step with the predicted step time.
With --repeat, runs the listed rows of the matrix --times times each, in interleaved rounds (each
with its own calibration), and writes the spread of the measured and predicted step time and
exposed-communication share over the repetitions.
"""
import argparse
import datetime
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOWS = 3  # logged windows per run that are measured, after the warm-up
# Steps before the measured windows: the heap grows to its peak over the first steps of a run,
# which fault their memory in (Note [glibc malloc]); the planner predicts the steps after that.
WARMUP_STEPS = 12
WINDOW_S = 0.3  # a window spans at least this many predicted seconds, and at least 3 steps

MODELS = {
    "S": ["--layers", "2", "--width", "64", "--heads", "4", "--context", "64"],
    "M": ["--layers", "4", "--width", "128", "--heads", "4", "--context", "64"],
    "L": ["--layers", "2", "--width", "256", "--heads", "8", "--context", "64"],
    "XL": ["--layers", "4", "--width", "512", "--heads", "8", "--context", "128"],
}
# The ranks' transport: shared memory, or the modeled network over it with one rank per host.
NETWORKS = {
    "shm": {},
    "10 Gbit/s": {"FSDP_NETWORK_MODEL": "gbps=1.25,ranks_per_host=1"},
    "1 Gbit/s": {"FSDP_NETWORK_MODEL": "gbps=0.125,ranks_per_host=1"},
    "1 Gbit/s, 2 per host": {"FSDP_NETWORK_MODEL": "intra_gbps=12.5,inter_gbps=0.125,ranks_per_host=2"},
}


def matrix():
    """(world, model, strategy flags, checkpointing, precision, network) for every run."""
    runs = []
    for model in "SML":
        for mp in ("none", "bf16"):
            runs.append((1, model, ["--strategy", "FULL_SHARD"], False, mp))
    runs.append((1, "M", ["--strategy", "FULL_SHARD"], True, "none"))
    for world in (2, 4):
        strategies = [["--strategy", "FULL_SHARD"], ["--strategy", "SHARD_GRAD_OP"], ["--strategy", "NO_SHARD"]]
        if world == 4:
            strategies.append(["--strategy", "HYBRID_SHARD", "--sharding-factor", "2"])
        for s in strategies:
            for mp in ("none", "bf16"):
                runs.append((world, "M", s, False, mp))
        runs.append((world, "M", ["--strategy", "FULL_SHARD"], True, "none"))
        runs.append((world, "M", ["--strategy", "FULL_SHARD"], True, "bf16"))
        runs.append((world, "L", ["--strategy", "FULL_SHARD"], False, "none"))
    runs.append((4, "S", ["--strategy", "FULL_SHARD", "--wrap", "none"], False, "none"))
    runs.append((3, "M", ["--strategy", "FULL_SHARD"], False, "none"))
    runs.append((3, "M", ["--strategy", "NO_SHARD"], True, "bf16"))
    for world in (1, 2, 4):
        runs.append((world, "XL", ["--strategy", "FULL_SHARD"], False, "none"))
    runs.append((4, "XL", ["--strategy", "FULL_SHARD"], True, "none"))
    # hpZ, and accumulation over two micro-batches with and without communication, and with the
    # replica all-reduce at the last only.
    hpz = ["--strategy", "FULL_SHARD", "--reshard-after-forward-size", "2"]
    for mp in ("none", "bf16"):
        runs.append((4, "M", hpz, False, mp))
    for world, mode, mp in ((2, "no-sync", "none"), (4, "no-sync", "bf16"), (4, "reduce", "none")):
        runs.append((world, "M", ["--strategy", "FULL_SHARD", "--grad-accum", "2", "--grad-accum-mode", mode], False,
                     mp))
    runs.append((4, "M", ["--strategy", "HYBRID_SHARD", "--sharding-factor", "2", "--grad-accum", "2",
                          "--grad-accum-mode", "replica-deferred"], False, "none"))
    # Deterministic training: exact integer sums reduced, micro-batches accumulated under no_sync.
    runs.append((2, "M", ["--strategy", "FULL_SHARD", "--deterministic"], False, "none"))
    runs.append((4, "M", ["--strategy", "FULL_SHARD", "--deterministic", "--grad-accum", "2"], False, "bf16"))
    runs = [r + ("shm",) for r in runs]
    # Over the modeled network between hosts: the link's time, and the waits beside it.
    for world in (2, 4):
        runs.append((world, "M", ["--strategy", "FULL_SHARD"], False, "none", "1 Gbit/s"))
        runs.append((world, "M", ["--strategy", "FULL_SHARD"], False, "bf16", "10 Gbit/s"))
        runs.append((world, "M", ["--strategy", "SHARD_GRAD_OP"], False, "none", "10 Gbit/s"))
        runs.append((world, "M", ["--strategy", "NO_SHARD"], False, "none", "1 Gbit/s"))
    runs.append((4, "L", ["--strategy", "FULL_SHARD"], True, "none", "10 Gbit/s"))
    runs.append((4, "M", ["--strategy", "HYBRID_SHARD", "--sharding-factor", "2"], False, "none", "1 Gbit/s, 2 per host"))
    # The world group across two hosts of two ranks: two rings, each crossing on its own rank's link.
    runs.append((4, "M", ["--strategy", "FULL_SHARD"], False, "none", "1 Gbit/s, 2 per host"))
    # Checkpointing some blocks, the first in forward order (Note [Checkpointing some units]).
    runs.append((2, "XL", ["--strategy", "FULL_SHARD", "--checkpointed-blocks", "2"], True, "none", "shm"))
    runs.append((4, "M", ["--strategy", "FULL_SHARD", "--checkpointed-blocks", "3"], True, "bf16", "shm"))
    return runs


def free_port():
    """A TCP port nobody listens on now (other jobs on the machine may hold the default 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibration(build, world, model, mp, network, tmp):
    """A calibration for (world, model, precision), made by a short job just before the run it serves
    (the machine's speed drifts), whose ranks all time the model at once (--calibrate) and copies of it
    sharded FULL_SHARD and NO_SHARD by block and FULL_SHARD without wrapping through the runtime; a
    separate job, so the measured run's resident set does not include it."""
    path = os.path.join(tmp, f"calibration-{world}-{model}-{mp}-{network.replace(' ', '').replace('/', '')}.json")
    cmd = [os.path.join(build, "tools/fsdp-run"), "--nproc-per-node", str(world), "--master-port",
           str(free_port()), os.path.join(build, "examples/gpt/fsdp_gpt")] + MODELS[model] + [
               "--batch-per-rank", "4", "--steps", "1", "--warmup", "0", "--eval-batches", "1", "--sample-bytes",
               "0", "--mixed-precision", mp, "--plan-file", os.path.join(tmp, "calibration-plan.jsonl"),
               "--calibrate", "--calibration-file", path,
               "--activation-checkpointing"]  # the copy's blocks checkpointed: both memory figures
    env = dict(os.environ, OMP_NUM_THREADS="1", **NETWORKS[network])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
    if out.returncode != 0:
        sys.exit("failed: " + " ".join(cmd) + "\n" + out.stdout[-3000:] + out.stderr[-3000:])
    return path


def run_one(build, world, model, strategy, checkpointing, mp, network, tmp, cal=None):
    """One measured run, predicted with the calibration file `cal` (None: one made just before)."""
    cal = cal or calibration(build, world, model, mp, network, tmp)
    # Windows long enough that a passing disturbance of the machine does not fill one: from the
    # calibration job's own plan (the model's step, give or take its configuration).
    with open(os.path.join(tmp, "calibration-plan.jsonl")) as f:
        step_s = json.loads(f.readline())["step_s"]
    interval = max(3, math.ceil(WINDOW_S / max(step_s, 1e-6)))
    windows_run = WINDOWS + math.ceil(WARMUP_STEPS / interval)
    plan_file = os.path.join(tmp, "plan.jsonl")
    metrics = os.path.join(tmp, "metrics.jsonl")
    for f in (plan_file, metrics):
        if os.path.exists(f):
            os.remove(f)
    cmd = [os.path.join(build, "tools/fsdp-run"), "--nproc-per-node", str(world), "--master-port",
           str(free_port()), "/usr/bin/time", "-f",
           "maxrss_kb %M", os.path.join(build, "examples/gpt/fsdp_gpt")] + MODELS[model] + strategy + [
               "--batch-per-rank", "4", "--steps", str(windows_run * interval), "--warmup", "1", "--log-interval", str(interval), "--eval-batches", "1",
               "--sample-bytes", "0", "--mixed-precision", mp, "--plan-file", plan_file, "--calibration-file", cal,
               "--metrics-file", metrics, "--measure-exposed-comm"]
    if checkpointing:
        cmd.append("--activation-checkpointing")
    env = dict(os.environ, OMP_NUM_THREADS="1", **NETWORKS[network])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
    if out.returncode != 0:
        sys.exit("failed: " + " ".join(cmd) + "\n" + out.stdout[-3000:] + out.stderr[-3000:])
    text = out.stdout + out.stderr
    rss = [int(m) * 1024 for m in re.findall(r"maxrss_kb (\d+)", text)]
    windows = [json.loads(line) for line in open(metrics)]
    # Memory from the last window (steady state); time as the median of the windows after the warm-up.
    measured = dict(windows[-1])
    for key in ("ms_per_step", "exposed_comm_share"):
        measured[key] = statistics.median(w[key] for w in windows[-WINDOWS:])
    plan = json.loads(open(plan_file).readline())
    return {"cmd": cmd, "rss": rss, "measured": measured, "plan": plan, "interval": interval}


def row(i, world, model, network, r):
    """The table row of run i + 1 from run_one's result r."""
    p, m = r["plan"], r["measured"]
    return {
        "run": i + 1, "world": world, "model": model, "network": network, "config": p["configuration"],
        "interval": r["interval"],
        "params": (m["fsdp_param_peak_bytes"], p["params_bytes"]),
        "grads": (m["fsdp_grad_peak_bytes"], p["grads_bytes"]),
        "fsdp": (m["fsdp_param_peak_bytes"] + m["fsdp_grad_peak_bytes"], p["params_bytes"] + p["grads_bytes"]),
        "rss": (m["rss_peak_bytes"], p["peak_bytes"]),
        "run_rss": max(r["rss"]), "workspace": p["workspace_bytes"],
        "activations": p["activations_bytes"], "process": p["process_bytes"],
        "step": (m["ms_per_step"] / 1e3, p["step_s"]),
        "exposed": (m["exposed_comm_share"], p["exposed_comm_s"] / p["step_s"] if p["step_s"] > 0 else 0),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--out", default=None, help="default: bench/results/planner.md (planner_repeat.md with --repeat)")
    ap.add_argument("--only", type=int, default=0, help="the first N runs only")
    ap.add_argument("--repeat", default="", help="comma-separated run numbers of the matrix, each run --times times")
    ap.add_argument("--times", type=int, default=5, help="repetitions per run with --repeat")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    runs = matrix()
    if args.repeat:
        picked = [int(x) for x in args.repeat.split(",")]
        bad = [n for n in picked if not 1 <= n <= len(runs)]
        if bad:
            sys.exit(f"--repeat: no run {bad[0]}; the matrix has runs 1 to {len(runs)}")
        chosen = [(n - 1, runs[n - 1]) for n in picked]
        rounds = args.times
    else:
        chosen = list(enumerate(runs[:args.only] if args.only else runs))
        rounds = 1
    started = datetime.datetime.utcnow()
    load_start = os.getloadavg()[0]
    rows = {i: [] for i, _ in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        for t in range(rounds):
            for i, (world, model, strategy, checkpointing, mp, network) in chosen:
                r = row(i, world, model, network, run_one(build, world, model, strategy, checkpointing, mp, network,
                                                          tmp))
                rows[i].append(r)
                print(f"{'' if rounds == 1 else f'round {t + 1}/{rounds} '}run {i + 1} world {world} {model} {network} "
                      f"{r['config']}: fsdp {r['fsdp'][0] / r['fsdp'][1]:.4f} rss {r['rss'][0] / r['rss'][1]:.3f} "
                      f"step {r['step'][0] / r['step'][1]:.2f} exposed {r['exposed'][0] * 100:.1f} / "
                      f"{r['exposed'][1] * 100:.1f}", flush=True)
    finished = datetime.datetime.utcnow()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    if args.repeat:
        args.out = args.out or os.path.join(ROOT, "bench/results/planner_repeat.md")
        write_repeat(args, rows, started, finished, commit, load_start, os.getloadavg()[0])
    else:
        args.out = args.out or os.path.join(ROOT, "bench/results/planner.md")
        write(args, [rs[0] for rs in rows.values()], started, finished, commit, load_start, os.getloadavg()[0])


def save(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", path)


def mib(b):
    return f"{b / 1048576:.2f}"


def write(args, rows, started, finished, commit, load_start, load_end):
    def ratio(pair):
        return pair[0] / pair[1] if pair[1] else float("nan")

    fsdp_ok = sum(1 for r in rows if abs(ratio(r["fsdp"]) - 1) <= 0.02)
    rss_ok = sum(1 for r in rows if abs(ratio(r["rss"]) - 1) <= 0.10)

    def tensors(r):  # the resident set beyond the process's own memory, measured / predicted
        return (r["rss"][0] - r["process"]) / (r["rss"][1] - r["process"])

    tensors_ok = sum(1 for r in rows if abs(tensors(r) - 1) <= 0.10)
    step_ok = sum(1 for r in rows if abs(ratio(r["step"]) - 1) <= 0.15)
    exposed_ok = sum(1 for r in rows if abs(r["exposed"][0] - r["exposed"][1]) <= 0.05)
    # The calibration times FULL_SHARD by block, with and without checkpointing, FULL_SHARD without
    # wrapping, and at worlds above 1 NO_SHARD by block through the runtime: the other rows are predictions.
    def timed(r):
        if "deterministic" in r["config"]:  # its exact sums' passes are the planner's own
            return False
        return r["config"].startswith(("FULL_SHARD, wrap block, fp32", "FULL_SHARD, wrap block, bf16",
                                       "FULL_SHARD, wrap block, checkpointed", "FULL_SHARD, wrap none, fp32",
                                       "FULL_SHARD, wrap none, bf16")) or (
            r["world"] > 1 and r["config"].startswith(("NO_SHARD, wrap block, fp32", "NO_SHARD, wrap block, bf16")))

    others = [r for r in rows if not timed(r)]
    others_step_ok = sum(1 for r in others if abs(ratio(r["step"]) - 1) <= 0.15)
    others_exposed_ok = sum(1 for r in others if abs(r["exposed"][0] - r["exposed"][1]) <= 0.05)
    modeled = [r for r in rows if r["network"] != "shm"]
    modeled_step_ok = sum(1 for r in modeled if abs(ratio(r["step"]) - 1) <= 0.15)
    modeled_exposed_ok = sum(1 for r in modeled if abs(r["exposed"][0] - r["exposed"][1]) <= 0.05)
    cmd = "bench/planner.py " + os.path.relpath(os.path.abspath(args.build), ROOT) + (
        f" --only {args.only}" if args.only else "")
    lines = [
        "# The planner's predictions against measured runs",
        "",
        f"Produced by `{cmd}` from the repository root, {started:%Y-%m-%d %H:%M} to {finished:%H:%M} UTC, "
        f"commit {commit}.",
        "",
        f"Machine: {platform.node() and 'this CPU machine'}; {os.cpu_count()} CPUs; Linux {platform.release()}. "
        f"Load average (1 min) at the start {load_start:.2f}, at the end {load_end:.2f}; other jobs share the "
        "machine.",
        "",
        "Each run: `fsdp-run --nproc-per-node WORLD /usr/bin/time fsdp_gpt MODEL --batch-per-rank 4 --steps "
        f"(N+{WINDOWS})K --log-interval K --plan-file ...` (one thread per rank), K the steps the calibration job "
        f"predicts in {WINDOW_S} s, at least 3 (K = 3 to {max(r['interval'] for r in rows)} here), N K the "
        f"first multiple of K from {WARMUP_STEPS} steps on: a warm-up, over which the heap grows to its peak "
        "(the trainer's `--malloc keep`, its default: Note [glibc malloc]). Network: shared memory (`shm`), or the "
        "modeled network over it between hosts of one rank each (`FSDP_NETWORK_MODEL=gbps=1.25,ranks_per_host=1` for "
        "10 Gbit/s, `gbps=0.125` for 1 Gbit/s), for the calibration job and the run alike. Models: S = 2 layers x width 64, M = 4 x 128, "
        "L = 2 x 256, context 64; XL = 4 x 512, context 128; vocabulary 256. Measured, from rank 0's "
        "`--metrics-file` with `--measure-exposed-comm`: its `memory_stats()` peaks over the last logged window "
        "(the last K steps), its resident set's peak during training (`rss_peak_bytes`: VmHWM restarted when "
        "training begins; the planner predicts rank 0, the largest), and the median over the last "
        f"{WINDOWS} windows of the ms/step and of the share of it the compute thread waited on collectives (the event trace). The whole run's peak over all ranks (`/usr/bin/time`, "
        "set-up and validation included) is shown beside it. Predicted: the trainer's `--plan-file` entry for the run (cluster `cpu:1xWORLD`, process bytes = "
        "the mean resident set over ranks after the data is loaded), with `--calibration-file` from a job of the "
        "same world, model and precision run just before it (`--calibrate`: every rank timing a copy "
        "of the model at once, and measuring its passes' memory with and without checkpointed blocks; and copies "
        "sharded FULL_SHARD by block, at worlds above 1 NO_SHARD by block, and FULL_SHARD without wrapping, each timed "
        "for iterations through the runtime: what they take beyond the replays of their configurations becomes FSDP's "
        "work per unit, per collective and per pass, "
        "and its waits on peers per second of computation, in every prediction of the precision; and the FULL_SHARD "
        "copy timed again with its blocks checkpointed, whose difference is what checkpointing changes in every "
        "checkpointed prediction). The rows of those configurations (FULL_SHARD by block, checkpointed or not, "
        "FULL_SHARD without wrapping and NO_SHARD by block, not checkpointed) are fitted to the calibration's own timings; the others are predicted "
        "from them.",
        "",
        f"- FSDP-managed memory (parameter + gradient peaks) within 2%: **{fsdp_ok} of {len(rows)}** runs "
        f"(worst measured / predicted {max(abs(ratio(r['fsdp']) - 1) for r in rows) * 100:.2f}% off).",
        f"- Whole-process peak within 10% of the measured peak resident set during training: **{rss_ok} of {len(rows)}** "
        f"(worst {max(abs(ratio(r['rss']) - 1) for r in rows) * 100:.1f}% off).",
        f"- The part beyond the process's own memory (peak RSS - process bytes; the process bytes are "
        f"measured, so this is the tensors' share of the prediction) within 10%: **{tensors_ok} of {len(rows)}** "
        f"(worst {max(abs(tensors(r) - 1) for r in rows) * 100:.1f}% off).",
        f"- Step time within 15%: **{step_ok} of {len(rows)}** (worst "
        f"{max(abs(ratio(r['step']) - 1) for r in rows) * 100:.0f}% off).",
        f"- Exposed-communication share within 5 points: **{exposed_ok} of {len(rows)}** (worst "
        f"{max(abs(r['exposed'][0] - r['exposed'][1]) for r in rows) * 100:.1f} points off).",
        f"- The runs in another configuration than the one the runtime calibration times: step time within 15% in "
        f"**{others_step_ok} of {len(others)}**, exposed share within 5 points in **{others_exposed_ok} of "
        f"{len(others)}**.",
        f"- The runs over the modeled network: step time within 15% in **{modeled_step_ok} of {len(modeled)}**, "
        f"exposed share within 5 points in **{modeled_exposed_ok} of {len(modeled)}**.",
        "",
        "| # | world | network | model | configuration | params MiB meas. / pred. | grads MiB meas. / pred. | FSDP meas. / pred. "
        "| activations MiB pred. | workspace MiB pred. | process MiB | training peak RSS MiB meas. / pred. | RSS meas. / "
        "pred. | beyond process meas. / pred. | whole run peak RSS MiB | step ms meas. / pred. | exposed % meas. / "
        "pred. |",
        "| ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['world']} | {r['network']} | {r['model']} | {r['config']} | {mib(r['params'][0])} / {mib(r['params'][1])} "
            f"| {mib(r['grads'][0])} / {mib(r['grads'][1])} | {ratio(r['fsdp']):.4f} | {mib(r['activations'])} "
            f"| {mib(r['workspace'])} | {mib(r['process'])} | {mib(r['rss'][0])} / {mib(r['rss'][1])} "
            f"| {ratio(r['rss']):.3f} | {tensors(r):.3f} | {mib(r['run_rss'])} "
            f"| {r['step'][0] * 1e3:.1f} / {r['step'][1] * 1e3:.1f} "
            f"| {r['exposed'][0] * 100:.1f} / {r['exposed'][1] * 100:.1f} |")
    save(args.out, lines)


def best_constant(values, upper):
    """The most of `values` that one figure can be within tolerance of, where the values within it
    of some figure form a window [v0, upper(v0)]: the fullest window starting at one of the values."""
    return max(sum(1 for v in values if v0 <= v <= upper(v0)) for v0 in values)


def write_repeat(args, rows, started, finished, commit, load_start, load_end):
    runs = [rs for rs in rows.values()]
    times = len(runs[0])
    total = sum(len(rs) for rs in runs)

    def spread(xs, scale=1.0, fmt="{:.1f}"):
        xs = sorted(x * scale for x in xs)
        return " / ".join(fmt.format(x) for x in (xs[0], statistics.median(xs), xs[-1]))

    step_ok = [sum(1 for r in rs if abs(r["step"][0] / r["step"][1] - 1) <= 0.15) for rs in runs]
    exposed_ok = [sum(1 for r in rs if abs(r["exposed"][0] - r["exposed"][1]) <= 0.05) for rs in runs]
    # What one figure per configuration, fixed in advance, could reach at best: the measured values
    # alone decide it (the steps within 15% of c lie in 0.85c..1.15c; the shares within 5 points of c
    # in c - 0.05..c + 0.05).
    step_best = [best_constant([r["step"][0] for r in rs], lambda v: v * 1.15 / 0.85) for rs in runs]
    exposed_best = [best_constant([r["exposed"][0] for r in rs], lambda v: v + 0.10) for rs in runs]
    exposed_span = [max(r["exposed"][0] for r in rs) - min(r["exposed"][0] for r in rs) for rs in runs]
    predicted_span = [max(r["exposed"][1] for r in rs) - min(r["exposed"][1] for r in rs) for rs in runs]
    step_span = [max(r["step"][0] for r in rs) / min(r["step"][0] for r in rs) for rs in runs]
    cmd = (f"bench/planner.py {os.path.relpath(os.path.abspath(args.build), ROOT)} --repeat "
           f"{','.join(str(rs[0]['run']) for rs in runs)} --times {times}")
    lines = [
        "# The planner's predictions over repeated runs",
        "",
        f"Produced by `{cmd}` from the repository root, {started:%Y-%m-%d %H:%M} to {finished:%H:%M} UTC, "
        f"commit {commit}.",
        "",
        f"Machine: this CPU machine; {os.cpu_count()} CPUs; Linux {platform.release()}. Load average (1 min) at the "
        f"start {load_start:.2f}, at the end {load_end:.2f}.",
        "",
        f"Runs of the matrix in [planner.md](planner.md) (same numbers), each run {times} times in {times} "
        "interleaved rounds, each time exactly as there: a calibration job just before it, then the measured run "
        "with its prediction. Each figure is min / median / max over the repetitions. \"best one figure\": the "
        "most repetitions any single figure fixed in advance could be within the tolerance of (15% of the step; "
        "5 points of the exposed share): the measured values alone decide it, so it bounds every predictor that "
        "gives one figure per configuration (one that follows the machine's drift, as a calibration made just before "
        "each run can, may do better).",
        "",
        f"- Step time within 15%: **{sum(step_ok)} of {total}** runs; best one figure per configuration: "
        f"{sum(step_best)} of {total}. The slowest repetition of a configuration takes "
        f"{min(step_span):.2f} to {max(step_span):.2f} times its fastest.",
        f"- Exposed-communication share within 5 points: **{sum(exposed_ok)} of {total}**; best one figure per "
        f"configuration: {sum(exposed_best)} of {total}. The measured share of one configuration spans "
        f"{min(exposed_span) * 100:.1f} to {max(exposed_span) * 100:.1f} points over its repetitions (median "
        f"{statistics.median(exposed_span) * 100:.1f}); in {sum(1 for x in exposed_span if x > 0.10)} of {len(runs)} "
        "configurations more than the 10 points a 5-point tolerance spans. The predicted share of one "
        f"configuration spans {min(predicted_span) * 100:.1f} to {max(predicted_span) * 100:.1f} points (median "
        f"{statistics.median(predicted_span) * 100:.1f}): each run's calibration is measured anew.",
        "",
        "| # | world | network | model | configuration | step ms measured | step ms predicted | step within 15% | best one "
        "figure | exposed % measured | exposed % predicted | exposed within 5 points | best one figure | measured "
        "exposed span (points) |",
        "| ---: | ---: | --- | --- | --- | --- | --- | ---: | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for k, rs in enumerate(runs):
        r0 = rs[0]
        lines.append(
            f"| {r0['run']} | {r0['world']} | {r0['network']} | {r0['model']} | {r0['config']} "
            f"| {spread([r['step'][0] for r in rs], 1e3)} | {spread([r['step'][1] for r in rs], 1e3)} "
            f"| {step_ok[k]} of {len(rs)} | {step_best[k]} of {len(rs)} "
            f"| {spread([r['exposed'][0] for r in rs], 100)} | {spread([r['exposed'][1] for r in rs], 100)} "
            f"| {exposed_ok[k]} of {len(rs)} | {exposed_best[k]} of {len(rs)} | {exposed_span[k] * 100:.1f} |")
    save(args.out, lines)


if __name__ == "__main__":
    main()
