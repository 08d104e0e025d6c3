#pragma once
// The byte sizes of quantized collectives' buffers and error feedback's residuals, as the runtime
// allocates them (src/quantized_collectives.cpp), for the planner's replay.
#include <cstdint>

#include "block_quantization.h"
#include "fsdp/options.h"
#include "unit_plan.h"

namespace fsdp::planner {

// The block format the runtime gives one FlatParameter's quantized collectives (fsdp_state.cpp):
// blocks end where each original parameter, and the padding, start.
BlockFormat block_format(const Quantization& q, const UnitPlan& plan, const UnitPlan::FlatParam& fp, int64_t padded);

// The slot of one part in a quantized collective of `parts` parts of `numel` values (packed_slot_bytes).
int64_t packed_slot(const BlockFormat& format, int parts, int64_t numel, int64_t origin = 0);

// quantized_all_reduce's slot for `numel` values from `origin` over `n` members: parts of ceil(numel / n), the last shorter.
int64_t all_reduce_slot(const BlockFormat& format, int64_t numel, int n, int64_t origin);

// Error feedback's float32 values of a quantized all-reduce of `numel` over `n` members: what the
// first member sends and the part it sums (the first, a full one).
int64_t all_reduce_residuals(int64_t numel, int n);

// Error feedback's float32 values for one FlatParameter of `padded` values over shard groups of `F`
// among `world` ranks: NO_SHARD's all-reduce's, else the reduce-scatter's whole gradient and, under
// HYBRID_SHARD with replicas, their all-reduce's of the shard.
int64_t feedback_residuals(int64_t padded, int F, int world, bool hybrid);

}  // namespace fsdp::planner
