#pragma once
// MemoryTracker: per-rank accounting of the storage FSDP itself allocates (shards, unsharded flat
// buffers, flat and sharded gradients), now and at peak since the last reset.
#include <cstdint>

#include "fsdp/memory.h"

namespace fsdp {

class MemoryTracker {
 public:
  void add_param(int64_t bytes);
  void add_grad(int64_t bytes);
  // Gradients held by the shard pieces belong to the user's tensors: the runtime reports their
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
