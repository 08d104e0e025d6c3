#include "fsdp/memory.h"

#ifdef FSDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace fsdp {

DeviceMemoryStats device_memory_stats(c10::Device device) {
  DeviceMemoryStats out;
#ifdef FSDP_WITH_CUDA
  if (!device.is_cuda()) return out;
  const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
  constexpr size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  out.available = true;
  out.allocated_bytes = s.allocated_bytes[all].current;
  out.allocated_peak_bytes = s.allocated_bytes[all].peak;
  out.reserved_bytes = s.reserved_bytes[all].current;
  out.reserved_peak_bytes = s.reserved_bytes[all].peak;
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
#endif
  return out;
}

void reset_device_peak_memory_stats(c10::Device device) {
#ifdef FSDP_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index() : 0);
#endif
}

void release_cached_device_memory(c10::Device device) {
#ifdef FSDP_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

}  // namespace fsdp
