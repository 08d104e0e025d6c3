#pragma once
// BufferPool: reuse of FSDP's transient buffers (unsharded parameters, unsharded gradients,
// reduction outputs) across units and iterations, kept by exact byte size; idle memory counts as
// "cached" until release_cached(). Large blocks are mapped directly (Note [Buffer reuse] in
// docs/design.md).
#include <ATen/ATen.h>
#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace fsdp {

class BufferPool {
 public:
  // Where the pool's CPU blocks come from and go back to: by default plain memory (malloc, or
  // mmap for large blocks); CPU offload on a GPU passes page-locked memory (cpu_offload.cpp).
  struct HostMemory {
    void* (*alloc)(size_t bytes) = nullptr;  // never null on return: throws instead
    void (*free)(void* p, size_t bytes) = nullptr;
  };
  explicit BufferPool(bool enabled = true);
  BufferPool(bool enabled, HostMemory memory);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // `bytes` of CPU memory (uninitialized); the block returns to the pool when the DataPtr (or the
  // last tensor over it) is destroyed, from any thread. On another device (CUDA) the block comes
  // from that device's allocator (PyTorch's caching allocator already pools, stream-ordered: a
  // block freed on the stream that allocated it is reused there at once) and is not counted here.
  at::DataPtr allocate(size_t bytes, c10::Device device = c10::Device(c10::kCPU));
  // A 1-D tensor of `numel` elements over a pooled block (uninitialized).
  at::Tensor empty(int64_t numel, const at::TensorOptions& options);

  // Frees every idle block.
  void release_cached();
  int64_t cached_bytes() const;
  // Blocks obtained from the system so far (not from the pool).
  int64_t system_allocations() const;
  bool enabled() const;
  void set_enabled(bool on);  // off: released blocks are freed at once

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace fsdp
