#include "planner/quantized_sizes.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace fsdp::planner {

BlockFormat block_format(const Quantization& q, const UnitPlan& plan, const UnitPlan::FlatParam& fp, int64_t padded) {
  std::vector<int64_t> starts;
  int64_t offset = 0;
  for (const int p : fp.params) {
    starts.push_back(offset);
    offset += plan.params[p].param.numel();
  }
  starts.push_back(offset);
  return BlockFormat{q.dtype(), q.block_size(), parameter_cuts(std::move(starts), padded)};
}

int64_t packed_slot(const BlockFormat& format, int parts, int64_t numel, int64_t origin) {
  int64_t most = 0;
  for (int q = 0; q < parts; ++q) most = std::max(most, format.packed_bytes(numel, origin + q * numel));
  return most;
}

int64_t all_reduce_slot(const BlockFormat& format, int64_t numel, int n, int64_t origin) {
  const int64_t p = (numel + n - 1) / n;
  int64_t most = 0;
  for (int q = 0; q < n; ++q)
    most = std::max(most, format.packed_bytes(std::max<int64_t>(0, std::min(p, numel - q * p)), origin + q * p));
  return most;
}

int64_t all_reduce_residuals(int64_t numel, int n) { return numel + std::min(numel, (numel + n - 1) / n); }

int64_t feedback_residuals(int64_t padded, int F, int world, bool hybrid) {
  if (F == 1) return all_reduce_residuals(padded, world);
  return padded + (hybrid && world / F > 1 ? all_reduce_residuals(padded / F, world / F) : 0);
}

}  // namespace fsdp::planner
