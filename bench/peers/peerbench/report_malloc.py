"""malloc.md: the step time of one process per language, runtime and malloc setting."""
import statistics

from .config import MALLOC_MODES, MiB
from .tables import median_of, table
from .util import fmt


def report_malloc(bench, md):
    size = md["size"]
    steady = " ".join(f"{k}={v}" for k, v in MALLOC_MODES["steady"].items())
    base_key = "pylocal" if any(c["key"] == "pylocal" for c in md["contenders"]) else md["contenders"][0]["key"]
    base = median_of(md["runs"].get((base_key, "default"), []))
    base_label = next(c["label"] for c in md["contenders"] if c["key"] == base_key)
    lines = [f"Model {size['name']} ({size['layers']} layers, width {size['width']}, context {size['context']}), "
             f"{size['batch_per_rank']} sequences per step: the per-rank work of the peers section's world-2 runs, "
             "in one process with one thread and no communication, so that what remains is the cost of the "
             "language, the allocator and the FSDP runtime. Contenders: the same model and step in eager Python "
             "(`ddp_gpt.py --no-ddp`), in the LibTorch C++ frontend (`gpt_bench --mode local`), in the C++ frontend "
             "with a global operator callback that does what libfsdp's interception does for every operator "
             "(`--operator-callback`: boxes the inputs, looks each tensor's storage up among the parameters'), and "
             "under libfsdp NO_SHARD at world 1 (interception, autograd hooks, flat gradient buffers; its "
             "all-reduce over one rank moves nothing). Each with glibc's default malloc and with the 'steady' "
             f"setting every contender of peers.md runs with (`{steady}`). Medians over "
             f"{bench.preset['malloc_diagnosis']['reps']} interleaved runs; ratios to {base_label} with the default "
             "malloc.", ""]
    rows = []
    for c in md["contenders"]:
        for mode in ("default", "steady"):
            runs = md["runs"].get((c["key"], mode), [])
            med = median_of(runs)
            if med is None:
                rows.append([c["label"], mode, 0] + ["failed"] * 10)
                continue
            ph = lambda k: f"{statistics.median(r['phase_median_s'].get(k, 0) for r in runs) * 1000:.1f}"
            rows.append([c["label"], mode, len(runs), f"{med * 1000:.1f}", fmt(med / base) if base else "n/a",
                         ph("forward"), ph("backward"), ph("optimizer"),
                         f"{median_of(runs, 'cpu_user_s_per_step'):.3f}",
                         f"{median_of(runs, 'cpu_system_s_per_step'):.3f}",
                         f"{median_of(runs, 'minor_faults_per_step'):.0f}",
                         f"{statistics.median(max(x['vmhwm_bytes'] for x in r['ranks']) for r in runs) / MiB:.1f}"])
    lines.append(table(["contender", "malloc", "runs", "step ms", f"step time / {base_label} (default malloc)",
                        "forward + loss ms", "backward ms", "optimizer ms", "CPU user s per step",
                        "CPU system s per step", "page faults per step", "peak RSS MiB"], rows))
    lines.append("")
    return lines
