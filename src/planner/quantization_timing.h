#pragma once
// Timings of the library's quantized-communication loops (src/block_quantization.h) for
// CalibrateOptions::quantizations. See Note [Planner calibration] in docs/design.md.
#include <torch/torch.h>

#include <cstdint>

#include "fsdp/calibration.h"

namespace fsdp::planner {

// Times packing (with and without a residual), unpacking and summing `values` values on `device` in
// `format`'s dtype and block size, each the median per value over `repetitions` or more runs (up to
// ten times as many, until `min_timed_s` is timed).
QuantizationTiming time_quantization(const Quantization& format, int64_t values, const at::Device& device,
                                     int repetitions, double min_timed_s);

}  // namespace fsdp::planner
