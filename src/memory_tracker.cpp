#include "memory_tracker.h"

#include <algorithm>

namespace fsdp {

void MemoryTracker::add_param(int64_t bytes) {
  stats_.param_bytes += bytes;
  stats_.param_peak_bytes = std::max(stats_.param_peak_bytes, stats_.param_bytes);
}

void MemoryTracker::add_grad(int64_t bytes) {
  stats_.grad_bytes += bytes;
  stats_.grad_peak_bytes = std::max(stats_.grad_peak_bytes, stats_.grad_bytes);
}

void MemoryTracker::set_sharded_grad_bytes(int64_t bytes) {
  add_grad(bytes - sharded_grad_bytes_);
  sharded_grad_bytes_ = bytes;
}

void MemoryTracker::reset_peaks() {
  stats_.param_peak_bytes = stats_.param_bytes;
  stats_.grad_peak_bytes = stats_.grad_bytes;
}

}  // namespace fsdp
