#pragma once
// Per-rank accounting of FSDP-managed storage: the bytes FSDP itself allocates for parameters
// (shards and unsharded flat buffers) and gradients (unsharded flat gradients and sharded
// gradients), now and at peak since the last reset.
#include <cstdint>

namespace fsdp {

struct MemoryStats {
  int64_t param_bytes = 0;
  int64_t param_peak_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t grad_peak_bytes = 0;
};

class MemoryTracker {
 public:
  void add_param(int64_t bytes);
  void add_grad(int64_t bytes);
  // Gradients held by the shard pieces are owned by the user's tensors; the runtime reports their
  // current total, and the tracker adjusts by the difference.
  void set_sharded_grad_bytes(int64_t bytes);
  MemoryStats stats() const { return stats_; }
  // Peaks restart from the current figures.
  void reset_peaks();

 private:
  MemoryStats stats_;
  int64_t sharded_grad_bytes_ = 0;
};

}  // namespace fsdp
