"""peers.md: step time, CPU time and memory of every contender against PyTorch DDP and PyTorch FSDP."""
import re
import statistics

from .checks import LOSS_TOLERANCE, loss_check
from .config import MALLOC_MODES
from .tables import median_of, table
from .util import fmt, mib


def report_peers(bench, groups):
    p = bench.preset
    lines = [f"Every contender trains the example GPT (`examples/gpt/model.cpp`; byte-level vocabulary 256, "
             "tied embedding and head, pre-norm blocks, GELU MLP, GPT-2 initialization, no dropout) from the "
             "same initial weights on the same fortunes batches, with AdamW (lr 3e-4, betas (0.9, 0.99), "
             "weight decay 0.1 on matrices and embeddings). `gpt_bench --write-inputs` writes the weights "
             "and batches that the Python DDP contender loads. Per rank: "
             f"{p['threads_per_rank']} intra-op thread (`--threads-per-rank` of `fsdp-run`, "
             "`torch.set_num_threads`); the local contender is one process with all usable CPUs. "
             "All use `OMP_WAIT_POLICY=PASSIVE` and glibc malloc's 'steady' setting `" +
             " ".join(f"{k}={v}" for k, v in MALLOC_MODES[p["contender_malloc"]].items()) +
             "` (fixed mmap threshold, heap trimmed only past 64 MiB free; see malloc.md for why and what it "
             "changes). Launcher for every distributed contender: "
             "`build/tools/fsdp-run`. Transport: PyTorch DDP runs Gloo over TCP (loopback); libfsdp runs its "
             "default, shared memory between the ranks of one host (`FSDP_TRANSPORT=auto`), and the "
             "'(Gloo TCP)' rows run the same strategy with `FSDP_TRANSPORT=tcp`, the transport of DDP and PyTorch FSDP.", "",
             f"Each run: {p['warmup']} warm-up steps, then {p['steps']} timed steps; a step is zero_grad, "
             "forward, loss, backward, optimizer step and reading the loss. Per run the median step time; "
             f"per contender the median over {p['reps']} interleaved runs (min-max of the runs' medians in "
             "brackets). Ratios are to PyTorch DDP's median in the same group. Peak RSS is VmHWM, the "
             "largest over ranks, for the whole process (initialization included) and for the steps alone "
             "(VmHWM restarted after initialization). FSDP-managed peak: `memory_stats()` parameter peak + "
             "gradient peak during the timed steps (largest over ranks). Loss check: largest relative "
             "difference of any step's loss (mean over ranks) from local training's; CPU s per step: user + "
             "system time of the timed steps summed over all ranks' processes (getrusage), per step; "
             f"tolerance {LOSS_TOLERANCE:g}.", ""]
    if not bench.ddp_available:
        lines += [f"**PyTorch DDP was not run: {bench.ddp_reason}.**", ""]
    summary_rows = {}
    for g in groups:
        size, world = g["size"], g["world"]
        ddp = median_of(g["runs"].get("ddp", []))
        ddp_cpu = median_of(g["runs"].get("ddp", []), "cpu_s_per_step")
        params = next((r["parameters"] for runs in g["runs"].values() for r in runs), 0)
        lines += [f"## {size['name']}, world {world}", "",
                  f"{size['layers']} layers, width {size['width']}, {size['heads']} heads, context "
                  f"{size['context']}, {params / 1e6:.2f} M parameters; global batch "
                  f"{size['batch_per_rank'] * world} x {size['context']} = "
                  f"{size['batch_per_rank'] * world * size['context']} tokens per step.", ""]
        rows = []
        for c in g["contenders"]:
            runs = g["runs"][c["key"]]
            med = median_of(runs)
            if med is None:
                rows.append([c["label"], 0] + ["failed"] * 11)
                continue
            lo = min(r["median_step_s"] for r in runs)
            hi = max(r["median_step_s"] for r in runs)
            tps = runs[0]["tokens_per_step"] / med
            ratio = med / ddp if ddp else None
            tratio = ddp / med if ddp else None
            cpu = median_of(runs, "cpu_s_per_step")
            cpu_ratio = cpu / ddp_cpu if ddp_cpu else None
            rss = statistics.median(max(x["vmhwm_bytes"] for x in r["ranks"]) for r in runs)
            rss_steps = statistics.median(max(x["vmhwm_train_bytes"] for x in r["ranks"]) for r in runs)
            if c["kind"] == "fsdp":
                fsdp_peak = statistics.median(max(x["fsdp_param_peak_bytes"] + x["fsdp_grad_peak_bytes"]
                                                  for x in r["ranks"]) for r in runs)
                fsdp_col = mib(fsdp_peak)
            else:
                fsdp_col = "-"
            worst = loss_check(runs, g["runs"]["local"])
            wrong = sum(1 for r in runs if loss_check([r], g["runs"]["local"]) > LOSS_TOLERANCE) \
                if worst is not None else "n/a"
            rows.append([c["label"], len(runs), f"{med * 1000:.1f} [{lo * 1000:.0f}-{hi * 1000:.0f}]",
                         f"{tps:.0f}", fmt(ratio), fmt(tratio), f"{cpu:.3f}", fmt(cpu_ratio),
                         mib(rss), mib(rss_steps), fsdp_col,
                         "n/a" if worst is None else f"{worst:.1e}", wrong])
            # The factor differs between worlds, so the summary row's label leaves it out.
            row = summary_rows.setdefault(c["key"], {"label": re.sub(r" \(F=\d+\)", "", c["label"]), "cpu": {}})
            row[(size["name"], world)] = ratio
            row["cpu"][(size["name"], world)] = cpu_ratio
        lines.append(table(["contender", "runs", "step ms", "tokens/s", "step time / DDP", "tokens/s / DDP",
                            "CPU s per step (all ranks)", "CPU / DDP", "peak RSS MiB", "peak RSS, steps only", "FSDP-managed peak MiB",
                            "loss vs local", "#wrong"], rows))
        # Where the time goes: per-phase wall time (rank 0) and user / system CPU time (all ranks).
        prow = []
        for c in g["contenders"]:
            runs = g["runs"][c["key"]]
            if not runs:
                continue
            ph = {k: statistics.median(r["phase_median_s"][k] for r in runs)
                  for k in ("zero_grad", "forward", "backward", "optimizer")}
            prow.append([c["label"]] + [f"{ph[k] * 1000:.1f}" for k in ph] +
                        [f"{median_of(runs, 'cpu_user_s_per_step'):.3f}",
                         f"{median_of(runs, 'cpu_system_s_per_step'):.3f}",
                         f"{median_of(runs, 'minor_faults_per_step'):.0f}",
                         f"{median_of(runs, 'voluntary_switches_per_step'):.0f}"])
        lines += ["", "Where the time goes (medians over the runs): wall time of each phase of a step on rank 0; "
                  "per step, summed over ranks: CPU time (user, system), minor page faults (each a freshly "
                  "mapped 4 KiB page the kernel zeroes) and voluntary context switches (a thread blocked, "
                  "e.g. waiting for a peer). System time is mostly loopback TCP copies of the collectives "
                  "and those page faults.", "",
                  table(["contender", "zero_grad ms", "forward + loss ms", "backward ms", "optimizer step ms",
                         "CPU user s", "CPU system s", "page faults", "voluntary switches"], prow)]
        fails = {k: v for k, v in g["failures"].items() if v}
        if fails:
            lines += ["", "Failed runs: " + "; ".join(f"{k}: {len(v)}" for k, v in fails.items())]
        lines.append("")
    # Summary and targets.
    cols = [(g["size"]["name"], g["world"]) for g in groups]
    lines += ["## Summary: step time / PyTorch DDP (lower is faster)", ""]
    rows = []
    for key, row in summary_rows.items():
        rows.append([row["label"]] + [fmt(row.get(col)) for col in cols])
    lines.append(table(["contender"] + [f"{s}, world {w}" for s, w in cols], rows))
    lines += ["", "## Summary: CPU time per step / PyTorch DDP (all ranks' user + system time; lower is cheaper)",
              "", "Other jobs on the machine change the wall time of a step far more than the CPU time it "
              "consumes, so this is the steadier comparison of the work each contender does per step.", ""]
    rows = []
    for key, row in summary_rows.items():
        rows.append([row["label"]] + [fmt(row["cpu"].get(col)) for col in cols])
    lines.append(table(["contender"] + [f"{s}, world {w}" for s, w in cols], rows))
    lines += ["", "![step time / DDP](peers_step_ratio.png)", "", "![CPU time / DDP](peers_cpu_ratio.png)", "",
              "![peak RSS](peers_rss.png)", ""]
    targets = []
    for g in groups:
        if g["size"]["name"] != "compute-bound":
            continue
        for key, goal in (("FULL_SHARD", 1.0), ("NO_SHARD", 0.95)):
            r = summary_rows.get(key, {}).get((g["size"]["name"], g["world"]))
            if r is None:
                continue
            verdict = "met" if r <= goal else f"missed by {100 * (r / goal - 1):.1f}%"
            cpu_r = summary_rows[key]["cpu"].get((g["size"]["name"], g["world"]))
            targets.append([f"{key} step time / DDP, {g['size']['name']}, world {g['world']}", f"<= {goal}",
                            fmt(r, 3), verdict, fmt(cpu_r)])
    if targets:
        lines += ["## Targets", "", table(["target", "goal", "measured", "verdict", "CPU time / DDP (same runs)"],
                                          targets, ["l", "r", "r", "l", "r"]), ""]
    # Against PyTorch FSDP, where it ran: libfsdp's median step time / PyTorch FSDP's, same group.
    vs = []
    for g in groups:
        for ours, theirs, goal, how in (("FULL_SHARD", "py_FULL_SHARD", 0.75, "default transport"),
                                        ("SHARD_GRAD_OP", "py_SHARD_GRAD_OP", 0.75, "default transport"),
                                        ("HYBRID_SHARD", "py_HYBRID_SHARD", 0.75, "default transport"),
                                        ("NO_SHARD", "py_NO_SHARD", None, "default transport"),
                                        ("FULL_SHARD_tcp", "py_FULL_SHARD", 0.9, "both on Gloo TCP"),
                                        ("SHARD_GRAD_OP_tcp", "py_SHARD_GRAD_OP", 0.9, "both on Gloo TCP"),
                                        ("HYBRID_SHARD_tcp", "py_HYBRID_SHARD", 0.9, "both on Gloo TCP"),
                                        ("NO_SHARD_tcp", "py_NO_SHARD", None, "both on Gloo TCP")):
            a, b = median_of(g["runs"].get(ours, [])), median_of(g["runs"].get(theirs, []))
            if a is None or b is None:
                continue
            r = a / b
            verdict = "-" if goal is None else "met" if r <= goal else f"missed by {100 * (r / goal - 1):.1f}%"
            peer_worst = loss_check(g["runs"][theirs], g["runs"]["local"])
            if goal is not None and peer_worst is not None and peer_worst > LOSS_TOLERANCE:
                verdict = (f"not comparable: PyTorch FSDP trains a different model here (losses {peer_worst:.1e} "
                           f"from local training), so it skips work")
            vs.append([f"libfsdp {ours.replace('_tcp', '')} / PyTorch FSDP {theirs[3:]}, {how}, "
                       f"{g['size']['name']}, world {g['world']}", "-" if goal is None else f"<= {goal}", fmt(r, 3),
                       verdict])
    if vs:
        lines += ["## Step time against PyTorch FSDP", "",
                  table(["ratio", "goal", "measured", "verdict"], vs, ["l", "r", "r", "l"]), ""]
    return lines, summary_rows, cols
