#include "planner/exact_reduction.h"

#include "exact_wire.h"

namespace fsdp::planner {
namespace {

// Bytes per value of each pass (src/exact_sum.cpp): a fold reads a float32 gradient and writes its
// three int64 limbs; the conversion reads a reduced value's limbs and writes it as a double, then
// in the parameters' dtype.
constexpr double kFoldBytes = 4 + 3 * 8;
constexpr double kConvertBytes = 3 * 8 + 8 + 8 + 4;

}  // namespace

void set_exact_reduction(SimFlat& flat, int64_t padded, int F, int world, bool replicas, const ReductionLinks& links,
                         double memory_bps) {
  const int64_t S = padded / F, limbs = exact::wire_for(world).limbs, word = sizeof(int64_t);
  const int64_t row = (limbs * S + 1) * word;  // one shard's sums on the wire, with the count
  flat.exact_bytes = F * (exact::kLimbs * S + 1) * word;
  flat.reduce_output_bytes = F > 1 ? row : 0;  // NO_SHARD reduces the sums in place
  flat.reduce_s = F > 1 ? modeled_seconds(Collective::kReduceScatter, F * row, F, links.shard)
                        : modeled_seconds(Collective::kAllReduce, row, world, links.world);
  flat.replica_reduce_s = replicas ? modeled_seconds(Collective::kAllReduce, row, world / F, links.replica) : 0;
  flat.reduce_s += flat.replica_reduce_s;
  if (memory_bps <= 0) return;
  flat.reduce_pack_s = static_cast<double>(padded) * kFoldBytes / memory_bps;
  flat.reduce_land_s = static_cast<double>(S) * kConvertBytes / memory_bps;
}

}  // namespace fsdp::planner
