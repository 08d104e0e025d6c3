#pragma once
// Wall-clock seconds and medians for the calibration timers (calibration.cpp, runtime_calibration.cpp,
// quantization_calibration.cpp).
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

// Whether a timer that has timed `done` repetitions, `timed_s` seconds in all, goes on: until
// `repetitions`, then until `min_timed_s` is reached or ten times `repetitions` are done.
inline bool keep_timing(size_t done, double timed_s, int repetitions, double min_timed_s) {
  const size_t least = static_cast<size_t>(repetitions);
  return done < least || (timed_s < min_timed_s && done < 10 * least);
}

}  // namespace fsdp::planner
