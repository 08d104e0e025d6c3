"""FULL_SHARD's per-rank memory at its peaks, computed from the units FSDP built (all float32)."""


def memory_formula(units, world, rank, in_flight):
    """Bytes the libfsdp runtime holds at its peaks (see src/flat_param.cpp, src/runtime/*):
    parameters: every unit's shard + the root (unsharded from forward until the end of backward)
      + the largest two consecutive other units: with BACKWARD_PRE (the default) the next unit's
      all-gather is issued when the current unit's backward starts, and the rate limiter (default 2)
      allows exactly that pair; without prefetch it would be the largest single unit;
    gradients: the shard pieces' gradients (kept between steps: the step zeroes them in place,
      zero_grad(set_to_none=false)) + the root's unsharded gradient buffer (its ln_final gradient
      arrives first in backward, its tied embedding gradient last) + the unit computing its gradients (its
      unsharded gradient buffer) + the `in_flight` (Options::reductions_in_flight) reductions
      issued before it (unsharded gradient and reduce-scatter output each). Before issuing a
      reduction the runtime waits for and frees the oldest ones until fewer than `in_flight`
      remain, then allocates the new one's output; it frees them at no other time;
    AdamW: exp_avg and exp_avg_sq for every shard piece."""
    F = world
    shard_real = []
    for u in units:
        shard_numel = u["padded_numel"] // F
        shard_real.append(max(0, min(shard_numel, u["numel"] - rank * shard_numel)) * 4)
    pieces = sum(shard_real)
    shards = sum(u["shard_bytes"] for u in units)
    root = units[0]
    others = units[1:]

    def chain(i):
        total, u = 0, units[i]
        while True:
            total += u["padded_bytes"]
            if u["parent"] < 0:
                return total
            u = units[u["parent"]]

    params_peak = shards + max(chain(i) for i in range(len(units)))
    # Backward prefetch: unit b (and its enclosing units) unsharded while the unit before it in
    # forward order, next in backward, is being gathered.
    for a, b in zip(range(1, len(units)), range(2, len(units))):
        ancestors, u = set(), units[b]
        while u["parent"] >= 0:
            ancestors.add(u["parent"])
            u = units[u["parent"]]
        if a not in ancestors:
            params_peak = max(params_peak, shards + chain(b) + units[a]["padded_bytes"])
    # Backward issues the non-root units' reductions in reverse forward order, then the root's.
    pending, current = [], root["padded_bytes"]
    grads_transient = current
    for u in list(reversed(others)) + [root]:
        if u is not root:
            current += u["padded_bytes"]  # its gradient buffer, from its first gradient on
            grads_transient = max(grads_transient, current)
        while pending and len(pending) > max(in_flight - 1, 0):
            done = pending.pop(0)
            current -= done["padded_bytes"] + done["shard_bytes"]
        current += u["shard_bytes"]  # the reduce-scatter output
        grads_transient = max(grads_transient, current)
        pending.append(u)
        if in_flight == 0:
            done = pending.pop(0)
            current -= done["padded_bytes"] + done["shard_bytes"]
    return {
        "params_rest": shards,
        "params_peak": params_peak,
        "grads_rest": pieces,
        "grads_peak": pieces + grads_transient,
        "adamw": 2 * pieces,
        "largest_unit_bytes": max(u["padded_bytes"] for u in units),
    }
