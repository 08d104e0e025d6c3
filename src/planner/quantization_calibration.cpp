// fsdp::calibrate_quantization (include/fsdp/calibration.h): the library's quantized-communication
// loops timed per value.
#include <functional>
#include <vector>

#include "block_quantization.h"
#include "fsdp/calibration.h"
#include "fsdp/check.h"
#include "planner/timing_stats.h"

namespace fsdp {
namespace {

using planner::Clock;
using planner::keep_timing;
using planner::median;
using planner::seconds_since;

// The parts summed per total in the timed sum: a reduction among this many ranks.
constexpr int64_t kSummedParts = 4;

// Seconds per run of `run`: the median of timed runs after one untimed; `sync` waits for the device.
double time_runs(const std::function<void()>& run, const std::function<void()>& sync, int repetitions,
                 double min_timed_s) {
  run();
  sync();
  std::vector<double> times;
  double timed = 0;
  while (keep_timing(times.size(), timed, repetitions, min_timed_s)) {
    const auto start = Clock::now();
    run();
    sync();
    times.push_back(seconds_since(start));
    timed += times.back();
  }
  return median(times);
}

}  // namespace

QuantizationTiming calibrate_quantization(const Quantization& format, const int64_t values, const at::Device& device,
                                          const int repetitions, const double min_timed_s) {
  FSDP_CHECK(values >= 1, "fsdp::calibrate: quantization timings need at least one value, got ", values);
  FSDP_CHECK(format.block_size() >= 1, "fsdp::calibrate: a quantization's block_size must be at least 1, got ",
             format.block_size());
  BlockFormat f;
  f.dtype = format.dtype();
  f.block = format.block_size();
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(device);
  const at::Tensor x = at::randn({values}, floats), out = at::empty({values}, floats);
  const at::Tensor residual = at::zeros({values}, floats);
  const int64_t per = f.packed_bytes(values);
  const at::Tensor packed = at::empty({kSummedParts * per}, floats.dtype(at::kByte));
  const at::Tensor slot = packed.narrow(0, 0, per);
  auto sync = [&] {
    if (!device.is_cpu()) (void)out[0].item<float>();
  };
  const double n = static_cast<double>(values);
  QuantizationTiming t;
  t.dtype = format.dtype();
  t.block_size = format.block_size();
  t.pack_s = time_runs([&] { quantize_into_slot(slot, x, at::Tensor(), f, 0); }, sync, repetitions, min_timed_s) / n;
  t.pack_feedback_s =
      time_runs([&] { quantize_into_slot(slot, x, residual, f, 0); }, sync, repetitions, min_timed_s) / n;
  for (int64_t r = 1; r < kSummedParts; ++r) packed.narrow(0, r * per, per).copy_(slot);
  t.unpack_s = time_runs([&] { dequantize_into(out, slot, f, 0); }, sync, repetitions, min_timed_s) / n;
  t.sum_s =
      time_runs([&] { sum_dequantized_into(out, packed, kSummedParts, per, f, 0); }, sync, repetitions, min_timed_s) /
      (n * static_cast<double>(kSummedParts));
  return t;
}

}  // namespace fsdp
