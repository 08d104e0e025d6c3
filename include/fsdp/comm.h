#pragma once
// Communicator: the collectives FSDP needs (Gloo, shared memory, NCCL, modeled network). Every
// collective is asynchronous and returns a Work; tensors passed in stay alive until it completes.
// See Note [Communicator contract] in docs/design.md.
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace fsdp {

// When a collective ran on its communicator (not when it was issued or waited for). Both are
// zero (the epoch) while unknown, e.g. before the work completed.
struct WorkTiming {
  std::chrono::steady_clock::time_point start, end;
};

class Work {
 public:
  virtual ~Work() = default;
  // CPU: blocks until the collective finished. CUDA: orders the caller's current stream after it
  // (no CPU block). Rethrows its error (a dead peer, a timeout, ...).
  virtual void wait() = 0;
  virtual bool completed() const = 0;
  // Valid once completed() is true; used by the runtime's trace.
  virtual WorkTiming timing() const { return {}; }
};
using WorkPtr = std::shared_ptr<Work>;

// Per-call options.
struct CollectiveOptions {
  // Ranks match collectives by tag; 0: this communicator's next sequence number (right whenever
  // all ranks issue collectives in the same order).
  uint32_t tag = 0;
  // Run only once this work has completed (waited for on the communicator's thread, not the
  // caller's); fail if it failed. Chains collectives of different communicators.
  WorkPtr after;
  // What the collective is for (e.g. "unit 3 gradient reduce-scatter #7"). Members compare it
  // with the kind, size and position: a difference fails every member at once, naming both
  // (Note [Collective fingerprints]; the CPU transports check, NCCL does not).
  std::string label;

  static CollectiveOptions labeled(std::string label) {
    CollectiveOptions o;
    o.label = std::move(label);
    return o;
  }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Human-readable identity used in error messages, e.g. "world" or "shard group [0,1]".
  virtual std::string name() const = 0;

  // out (contiguous, numel = size() * in.numel()) receives every rank's `in`, rank r's at
  // offset r * in.numel(). No intermediate copies.
  virtual WorkPtr all_gather_into(at::Tensor out, at::Tensor in, CollectiveOptions opts = {}) = 0;
  // out (numel n) = sum over ranks of in[rank * n, (rank + 1) * n). `in` (contiguous, numel
  // size() * n) is used as scratch and holds unspecified values afterwards.
  virtual WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, CollectiveOptions opts = {}) = 0;
  // Sum over ranks, in place.
  virtual WorkPtr all_reduce(at::Tensor t, CollectiveOptions opts = {}) = 0;
  // out and in (contiguous, same dtype and numel, a multiple of size()) are split into size()
  // equal parts; part p of out receives part rank() of rank p's in. Default: fails, naming the
  // transport (has_all_to_all() says whether one implements it).
  virtual WorkPtr all_to_all_into(at::Tensor out, at::Tensor in, CollectiveOptions opts = {});
  // Whether all_to_all_into() is implemented (rather than the default's failure).
  virtual bool has_all_to_all() const { return false; }
  virtual WorkPtr broadcast(at::Tensor t, int root, CollectiveOptions opts = {}) = 0;
  virtual void barrier() = 0;
  // Ends this member's use of the communicator, collectively: completes once every member has
  // called it after its last collective; fails if a member issued another collective instead (ranks
  // out of step), died or left. Later collectives fail. A CPU communicator destroyed without it runs
  // it, and ends the process with status 1 if it fails (Note [End-of-job agreement]).
  virtual WorkPtr shutdown();
  // Working memory kept between collectives from the CPU allocator (e.g. a receive buffer).
  virtual int64_t scratch_bytes() const { return 0; }
  // Shared memory it maps (the shared-memory transport's staging segment), outside the allocator.
  virtual int64_t shared_memory_bytes() const { return 0; }
  // The device whose tensors its collectives take (CPU; a CUDA device for NCCL), and how they
  // travel (for describe() and error messages).
  virtual c10::Device device() const { return c10::Device(c10::kCPU); }
  virtual std::string transport() const = 0;
};
using CommunicatorPtr = std::shared_ptr<Communicator>;

}  // namespace fsdp
