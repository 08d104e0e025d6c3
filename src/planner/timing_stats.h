#pragma once
// Wall-clock seconds and medians for the calibration timers (calibration.cpp, runtime_calibration.cpp).
#include <algorithm>
#include <chrono>
#include <vector>

namespace fsdp::planner {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The median of a non-empty list.
inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace fsdp::planner
