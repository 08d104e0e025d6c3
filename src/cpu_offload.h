#pragma once
// CpuOffloader: the device side of CPU offload (Options::offload, paper 3.5, ZeRO-Offload).
// Sharded parameters and their gradients live in host memory; each unshard copies the shard to
// the device on a copy stream ahead of its all-gather, and each reduced gradient shard is copied
// back on a second stream while backward goes on. Copies are ordered with the caller's current
// stream by events, as the collectives are (Note [CPU offload] in docs/design.md). Needs a CUDA
// build; elsewhere constructing one is an error naming the fix.
#include <torch/torch.h>

#include <functional>
#include <memory>

#include "buffer_pool.h"
#include "fsdp/comm.h"

namespace fsdp {

class CpuOffloader {
 public:
  // `device`: the process group's CUDA device; pin_memory: page-locked host tensors.
  CpuOffloader(c10::Device device, bool pin_memory);
  ~CpuOffloader();
  CpuOffloader(const CpuOffloader&) = delete;
  CpuOffloader& operator=(const CpuOffloader&) = delete;

  c10::Device device() const { return device_; }
  // An uninitialized 1-D host tensor (page-locked if pin_memory), its block reused by size.
  at::Tensor host_empty(int64_t numel, at::ScalarType dtype) const;
  // Queues dst (device) = src (host; same numel) on the copy stream, after the work queued so far on
  // the caller's current stream; wait() orders the caller's current stream after the copy. Where the
  // dtypes differ, the cast runs on the host first when cast_on_host (the copy moves dst's bytes),
  // else on the device. What the copy reads stays alive until it is done.
  WorkPtr to_device(at::Tensor dst, at::Tensor src, bool cast_on_host = false);
  // Runs fn with the copy stream current: a collective issued in it reads after the copies queued
  // so far (its communicator orders itself after the current stream).
  void on_copy_stream(const std::function<void()>& fn);
  // Queues dst (host) = src (device; same numel and dtype) on the copy-back stream, after the work
  // queued so far on the caller's current stream. wait() blocks the CPU until dst holds the values.
  WorkPtr to_host(at::Tensor dst, at::Tensor src);
  // Lets go of a to_host() copy's device source in stream order: the caller's current stream waits
  // for the copy, and the source's memory is reused only by work queued after that (no CPU block).
  void release_source(const WorkPtr& copy_to_host);

 private:
  // dst = src on the copy stream (to the device) or the copy-back stream (to the host), after the
  // caller's current stream.
  WorkPtr copy(bool to_host, at::Tensor dst, at::Tensor src);
  // A page-locked host tensor for a host cast, once fewer than kStagedInFlight are still being copied.
  at::Tensor staging(int64_t numel, at::ScalarType dtype);
  c10::Device device_;
  // Host blocks by exact size (page-locked when pin_memory): PyTorch's pinned allocator rounds
  // each block up to a power of two (Note [CPU offload]).
  mutable BufferPool host_pool_;
  struct Streams;
  std::unique_ptr<Streams> streams_;
};

}  // namespace fsdp
