#pragma once
// Memory figures: the storage FSDP manages on this rank, and the CUDA caching allocator's view.
#include <c10/core/Device.h>

#include <cstdint>

namespace fsdp {

// Bytes FSDP itself allocated on this rank (shards, unsharded flat buffers, flat and sharded
// gradients), now and at peak since the last reset.
struct MemoryStats {
  int64_t param_bytes = 0;
  int64_t param_peak_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t grad_peak_bytes = 0;
  // Idle buffers kept for reuse (Options::reuse_buffers); not in the figures above.
  int64_t cached_bytes = 0;
  // Transient buffers obtained from the system so far (cumulative).
  int64_t system_allocations = 0;
  // Communicators' working memory from the CPU allocator; not in the figures above.
  int64_t comm_scratch_bytes = 0;
  // Shared memory the communicators map (counts in every member's RSS); not in the figures above.
  int64_t comm_shared_bytes = 0;
  // Error feedback's residuals of quantized reductions (Quantization::error_feedback); not in the figures above.
  int64_t feedback_bytes = 0;
};

// What PyTorch's CUDA caching allocator reports for one device (all tensors, not only FSDP's).
// `available` is false on the CPU and in builds without CUDA.
struct DeviceMemoryStats {
  bool available = false;
  int64_t allocated_bytes = 0;
  int64_t allocated_peak_bytes = 0;
  int64_t reserved_bytes = 0;  // held from the driver (allocated + cached)
  int64_t reserved_peak_bytes = 0;
  int64_t num_alloc_retries = 0;  // allocations that had to free cached blocks and retry
  int64_t num_ooms = 0;
};
DeviceMemoryStats device_memory_stats(c10::Device device);
void reset_device_peak_memory_stats(c10::Device device);
// Returns the caching allocator's unused cached blocks on `device` to the driver (nothing on the CPU).
void release_cached_device_memory(c10::Device device);

}  // namespace fsdp
