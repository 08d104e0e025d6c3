#pragma once
// The seconds quantized collectives spend packing, unpacking and summing codes (src/
// block_quantization.h), for the planner's replay. See Note [Planner quantized work] in docs/design.md.
#include <cstdint>

#include "fsdp/calibration.h"
#include "fsdp/cluster.h"
#include "fsdp/options.h"

namespace fsdp::planner {

// Seconds per value of each loop, in one quantization format.
struct QuantizedRates {
  double pack_s = 0;    // packing a value (with error feedback's residual where the format keeps one)
  double unpack_s = 0;  // unpacking a value
  double sum_s = 0;     // adding a received packed value into its float32 total

  // quantized_all_reduce's owner work on its worker between the two stages: summing the `n` members'
  // parts of ceil(numel / n) values and packing that sum.
  double owner_s(int64_t numel, int n) const;
};

// `q`'s rates from the calibration's timing of its dtype (its block size, else another), else from
// the bytes each loop moves at the cluster's device memory bandwidth (none: free).
QuantizedRates quantized_rates(const Quantization& q, const Calibration& calibration, const Cluster& cluster);

}  // namespace fsdp::planner
