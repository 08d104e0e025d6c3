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
  // Memory FSDP holds idle for reuse (Options::reuse_buffers): released unsharded parameter and
  // gradient buffers, kept so the next unit or iteration of the same size need not allocate.
  // Not part of the figures above; FullyShardedModule::release_cached_memory() frees it.
  int64_t cached_bytes = 0;
  // Transient buffers FSDP has had to obtain from the system so far (cumulative). With
  // reuse_buffers it stops growing once every buffer size has been seen.
  int64_t system_allocations = 0;
  // Working memory FSDP's communicators keep between collectives from the CPU allocator (the
  // Gloo reduce-scatter receive ring: at most 2 MiB per communicator). Not part of the figures above.
  int64_t comm_scratch_bytes = 0;
  // Shared memory FSDP's communicators map (the shared-memory transport's staging segment: 2 MiB
  // per member up to 8 members, 16 MiB beyond, plus a page, per communicator), outside the CPU
  // allocator. Every member touches all of it, so it counts in each rank's RSS. Not part of the
  // figures above.
  int64_t comm_shared_bytes = 0;
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

#include <c10/core/Device.h>

namespace fsdp {

// What PyTorch's CUDA caching allocator reports for one device: every tensor on it, FSDP's and the
// model's activations alike. `available` is false on the CPU and in builds without CUDA.
struct DeviceMemoryStats {
  bool available = false;
  int64_t allocated_bytes = 0;
  int64_t allocated_peak_bytes = 0;
  int64_t reserved_bytes = 0;       // held by the allocator from the driver (allocated + cached)
  int64_t reserved_peak_bytes = 0;
  int64_t num_alloc_retries = 0;    // allocations that had to free cached blocks and retry (fragmentation)
  int64_t num_ooms = 0;
};
DeviceMemoryStats device_memory_stats(c10::Device device);
void reset_device_peak_memory_stats(c10::Device device);

}  // namespace fsdp
