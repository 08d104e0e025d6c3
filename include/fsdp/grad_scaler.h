#pragma once
// GradScaler: loss scaling for float16 mixed precision over a sharded model (PyTorch's
// ShardedGradScaler semantics): a non-finite gradient on any rank skips the step on every rank.
// See Note [Sharded gradient scaling] in docs/design.md.
#include <torch/arg.h>
#include <torch/torch.h>

#include <cstdint>

#include "fsdp/fully_shard.h"

namespace fsdp {

struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;   // after growth_interval steps in a row without inf/NaN
  TORCH_ARG(double, backoff_factor) = 0.5;  // after a step skipped for inf/NaN
  TORCH_ARG(int64_t, growth_interval) = 2000;
  TORCH_ARG(bool, enabled) = true;  // off: scale() returns the loss, step() just steps
};

class GradScaler {
 public:
  explicit GradScaler(FullyShardedModule& module, GradScalerOptions options = {});

  // The loss multiplied by the current scale (backward through it).
  at::Tensor scale(const at::Tensor& loss) const;
  // Collective: divides the gradients of `optimizer`'s parameters by the scale (once per step,
  // e.g. before clip_grad_norm_) and finds whether any rank has an inf or NaN among them.
  void unscale_(torch::optim::Optimizer& optimizer);
  // Collective: unscale_ if not done yet, then optimizer.step() unless a gradient on some rank is
  // not finite. Returns whether it stepped (the same on every rank).
  bool step(torch::optim::Optimizer& optimizer);
  // Ends the step: backoff after a skipped step, growth after growth_interval clean ones.
  void update();

  double get_scale() const { return scale_; }
  int64_t growth_tracker() const { return growth_tracker_; }
  // For checkpoints (the `extra` of fsdp::checkpoint::save).
  void load(double scale, int64_t growth_tracker);
  bool is_enabled() const { return options_.enabled(); }

 private:
  FullyShardedModule& module_;
  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  bool unscaled_ = false, found_inf_ = false, stepped_ = false;
};

}  // namespace fsdp
