#pragma once
// Deterministic training's reduction of one FlatParameter (src/flat_grad_exact.cpp,
// src/exact_wire.h) for the planner's replay: the exact sums it holds, the bytes it moves, the
// passes that fold gradients into the sums and convert them back. See Note [Planner deterministic reductions].
#include <cstdint>

#include "fsdp/network_model.h"
#include "planner/schedule_sim.h"

namespace fsdp::planner {

// The links a FlatParameter's reductions cross.
struct ReductionLinks {
  const Link& shard;    // its shard group's
  const Link& world;    // all ranks' (an unsharded one's all-reduce)
  const Link& replica;  // HYBRID_SHARD's replica groups'
};

// Sets `flat`'s reduction for a FlatParameter of `padded` values over shard groups of `F` among
// `world` ranks (`replicas`: with a replica all-reduce): exact sums of F rows of 3 S limbs and a
// count, reduced in the wire's limbs, and each pass's bytes at `memory_bps`.
void set_exact_reduction(SimFlat& flat, int64_t padded, int F, int world, bool replicas, const ReductionLinks& links,
                         double memory_bps);

}  // namespace fsdp::planner
