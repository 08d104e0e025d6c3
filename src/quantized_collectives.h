#pragma once
// Block-quantized gradient collectives over one communicator (Note [Quantized communication] in
// docs/design.md): a reduce-scatter as an all-to-all of quantized parts summed in float32 on
// arrival, and an all-reduce as that reduce-scatter followed by an all-gather of each owner's
// quantized sum. With error feedback, each quantization point keeps what its rounding dropped and
// adds it to the next values it sends.
#include <torch/torch.h>

#include <functional>
#include <mutex>

#include "block_quantization.h"
#include "buffer_pool.h"
#include "fsdp/comm.h"
#include "memory_tracker.h"

namespace fsdp {

// A collective whose wait() also runs `then` once, on the first caller's thread (a chained
// collective's worker may be the first): the unpacking of received codes.
class DequantizingWork : public Work {
 public:
  DequantizingWork(WorkPtr inner, std::function<void()> then) : inner_(std::move(inner)), then_(std::move(then)) {}
  void wait() override;
  bool completed() const override { return inner_->completed(); }
  WorkTiming timing() const override { return inner_->timing(); }

 private:
  WorkPtr inner_;
  std::mutex mu_;
  std::function<void()> then_;
};

// One FlatParameter's error feedback (Options::reduce_quantization's error_feedback): per
// quantization point, float32 residuals, allocated at first use. Not saved in checkpoints; a load
// drops them (FsdpState::drop_feedback_residuals).
struct QuantizationResiduals {
  bool enabled = false;
  at::Tensor scatter;  // the shard group's reduce-scatter: this rank's whole padded gradient
  at::Tensor sent;     // the all-reduce's first stage: the values this rank contributes
  at::Tensor summed;   // the all-reduce's second stage: this rank's part of the sum
  void clear() { scatter = sent = summed = at::Tensor(); }
};

// Where a quantized collective's packed buffers come from and are counted (as gradient memory).
struct QuantizedBuffers {
  BlockFormat format;
  BufferPool* pool = nullptr;
  MemoryTracker* memory = nullptr;
  int64_t origin = 0;  // where the collective's values start in the flat buffer the format's cuts are of
};

// The largest packed form of `parts` consecutive parts of `numel` values from `origin`: each part
// of a collective travels in a slot that size (the parts' blocks differ where cuts fall in them).
int64_t packed_slot_bytes(const BlockFormat& format, int64_t parts, int64_t numel, int64_t origin);

// out (numel n) = the sum over members of part rank() of their `in` (numel size() * n), each part
// quantized once by its sender. `residual`: null, or error feedback's residual of `in`.
WorkPtr quantized_reduce_scatter(Communicator& comm, const at::Tensor& out, const at::Tensor& in,
                                 const QuantizedBuffers& buffers, at::Tensor* residual, CollectiveOptions opts);
// t = the sum over members of t, in place (any numel). Starts once opts.after completed: t may be
// written until then. `residuals`: null, or error feedback's (sent and summed).
WorkPtr quantized_all_reduce(Communicator& comm, const at::Tensor& t, const QuantizedBuffers& buffers,
                             QuantizationResiduals* residuals, CollectiveOptions opts);

}  // namespace fsdp
