#pragma once
// The trainer's clock: monotonic time points and the seconds since one.
#include <chrono>

namespace fsdp_gpt {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace fsdp_gpt
