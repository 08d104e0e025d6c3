"""memory.md: FULL_SHARD's measured memory against the formula, per wrap granularity."""
from .formula import memory_formula
from .tables import median_of, table
from .util import fmt, mib


def report_memory(bench, mem):
    world = mem["world"]
    size = mem["size"]
    lines = [f"FULL_SHARD, world {world}, model {size['name']} ({size['layers']} layers, width {size['width']}, "
             f"context {size['context']}, {size['batch_per_rank']} sequences per rank), AdamW. Measured per rank "
             "during the timed steps (peaks reset after the warm-up steps, so gradients and AdamW state exist): "
             "`memory_stats()` parameter and gradient peaks, and the bytes of the optimizer's exp_avg and "
             "exp_avg_sq tensors. Formula, from `units()` (padded and shard bytes of each unit; "
             "`memory_formula()` in bench/peers/peerbench/formula.py), per rank:", "",
             "- parameters: sum of the shards + the root unit (unsharded from forward until the end of "
             "backward, paper 3.3.1) + the largest two consecutive other units (BACKWARD_PRE, the default, issues "
             "the next unit's all-gather when the current unit's backward starts; the rate limiter's default of 2 "
             "allows exactly that pair): the paper's sum of psi_i / F + max psi_i, with the root held as well and "
             "max psi_i taken over prefetched pairs;",
             "- gradients: this rank's shard-piece gradients (kept between steps: the step zeroes them in place, "
             "`zero_grad(set_to_none=false)`) + the root's unsharded gradient buffer (its ln_final gradient arrives "
             "first in backward, its tied-embedding gradient last) + the unsharded gradient buffer of the unit computing its "
             "gradients + the k earlier units' reductions still in flight (unsharded gradient + reduce-scatter "
             "output each), k = `Options::reductions_in_flight` (default 2). Before issuing a reduction the "
             "runtime waits for the oldest ones until fewer than k remain and frees their buffers then, never "
             "earlier, so the gradient peak does not depend on when a reduce-scatter happens to finish;",
             "- AdamW: 2 x this rank's shard-piece bytes (padding excluded).", "",
             "Rank 0's figures; the ratio columns are the worst over all ranks and runs. 'At rest' compares the "
             "live tensor bytes after the warm-up steps, counted by a wrapping CPU allocator "
             "(`--count-allocations`), with shards + piece gradients + AdamW + the rank's batches + the communicators' "
             "allocator scratch (`memory_stats().comm_scratch_bytes`: Gloo's reduce-scatter receive ring, at most 2 MiB "
             "per communicator; none on the shared-memory transport, whose segment is not allocator memory): an "
             "independent "
             "check of the library's accounting. 'All tensors at peak' is that allocator's peak (activations, "
             "communication scratch and the model state together). 'Cached' is `memory_stats().cached_bytes` at rest: "
             "released unsharded parameter and gradient buffers that `reuse_buffers` keeps for the next "
             "iteration (outside the allocator's count and the peaks above).", ""]
    rows, plot = [], []
    block_time = median_of(mem["runs"].get("block", []))
    for wrap, runs in mem["runs"].items():
        r0 = runs[0]
        units = r0["units"]
        k = r0.get("overlap", {}).get("reductions_in_flight", 2)
        worst = {"formula": 0.0, "rest": 0.0}
        for run in runs:
            for st in run["ranks"]:
                rank = int(st["rank"])
                measured = st["fsdp_param_peak_bytes"] + st["fsdp_grad_peak_bytes"] + st["adamw_state_bytes"]
                f = memory_formula(units, world, rank, k)
                # + the communicators' reduce-scatter receive ring, which the library reports
                rest = (f["params_rest"] + f["grads_rest"] + f["adamw"] + st["batch_bytes"] +
                        st.get("comm_scratch_at_rest_bytes", 0))
                for key, value in (("formula", measured / (f["params_peak"] + f["grads_peak"] + f["adamw"])),
                                   ("rest", st["alloc_live_at_rest_bytes"] / rest)):
                    if abs(value - 1) > abs(worst[key] - 1) or worst[key] == 0.0:
                        worst[key] = value
        s0 = r0["ranks"][0]
        f0 = memory_formula(units, world, 0, k)
        med = median_of(runs)
        n = len(units)
        meas_total = s0["fsdp_param_peak_bytes"] + s0["fsdp_grad_peak_bytes"] + s0["adamw_state_bytes"]
        form_total = f0["params_peak"] + f0["grads_peak"] + f0["adamw"]
        rows.append([wrap, n, mib(f0["largest_unit_bytes"], 2),
                     f"{mib(s0['fsdp_param_peak_bytes'], 2)} / {mib(f0['params_peak'], 2)}",
                     f"{mib(s0['fsdp_grad_peak_bytes'], 2)} / {mib(f0['grads_peak'], 2)}",
                     f"{mib(s0['adamw_state_bytes'], 2)} / {mib(f0['adamw'], 2)}",
                     f"{mib(meas_total, 2)} / {mib(form_total, 2)}",
                     f"{worst['formula']:.4f}",
                     f"{worst['rest']:.4f}", mib(s0.get("fsdp_cached_at_rest_bytes", 0), 2),
                     mib(s0["alloc_peak_bytes"], 1),
                     f"{2 * n - 1} + {n}", f"{med * 1000:.1f}",
                     fmt(med / block_time) if block_time else "n/a"])
        plot.append((wrap, n, f0["params_peak"], f0["grads_peak"], f0["adamw"], meas_total, form_total, med))
    lines.append(table(["wrap", "units", "largest unit MiB", "params peak MiB (meas. / formula)",
                        "grads peak MiB (meas. / formula)", "AdamW MiB (meas. / formula)",
                        "model state MiB (meas. / formula)", "measured / formula (worst rank and run)",
                        "at rest: allocator / formula", "cached MiB", "all tensors at peak MiB",
                        "collectives per step (all-gather + reduce-scatter)", "step ms (median)",
                        "step time / block"], rows))
    lines += ["", "Model state is the sum of the three peaks (parameters, gradients, AdamW), which do not all "
              "occur at the same instant; each is compared with its own formula. Collectives per step: every "
              "unit is all-gathered in forward and, except the root (kept unsharded until backward ends), "
              "again in backward: 2N - 1 all-gathers and N reduce-scatters for N units (the counts "
              "`FSDP_DEBUG_COMM=1` prints).", "",
              "![memory and step time per wrap granularity](memory_wrap.png)", ""]
    return lines, plot
