#include "planner/quantized_work.h"

namespace fsdp::planner {
namespace {

// Bytes each loop moves per value (src/block_quantization.cpp): packing reads a float32 value twice
// (the block's largest magnitude, then its code) and writes a byte; with a residual it also adds
// the residual in, unpacks the codes into it and takes the difference; unpacking reads a code and
// writes a float32 value; a sum reads a code per member and writes their total once (among four
// members, two bytes per code).
constexpr double kPackBytes = 9;
constexpr double kPackFeedbackBytes = 46;
constexpr double kUnpackBytes = 5;
constexpr double kSumBytes = 2;

}  // namespace

double QuantizedRates::owner_s(int64_t numel, int n) const {
  const int64_t part = (numel + n - 1) / n;
  return static_cast<double>(part) * (static_cast<double>(n) * sum_s + pack_s);
}

QuantizedRates quantized_rates(const Quantization& q, const Calibration& calibration, const Cluster& cluster) {
  const bool feedback = q.error_feedback();
  if (const QuantizationTiming* t = calibration.find_quantization(q.dtype(), q.block_size()))
    return {feedback ? t->pack_feedback_s : t->pack_s, t->unpack_s, t->sum_s};
  const double bandwidth = cluster.device.memory_gbps * 1e9;
  if (bandwidth <= 0) return {};
  return {(feedback ? kPackFeedbackBytes : kPackBytes) / bandwidth, kUnpackBytes / bandwidth, kSumBytes / bandwidth};
}

}  // namespace fsdp::planner
