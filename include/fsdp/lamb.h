#pragma once
// Lamb: LAMB (You et al., "Large Batch Optimization for Deep Learning") over a sharded module's
// pieces, equal to LAMB on the whole parameters: Adam's moments per element, then each original
// parameter's step scaled by its trust ratio ||w|| / ||update||, the two norms taken over the whole
// parameter (one collective per step for all of them). See Note [Whole-parameter reductions].
#include <torch/torch.h>

#include <memory>
#include <tuple>
#include <vector>

#include "fsdp/whole_param_optimizer.h"

namespace fsdp {

struct LambOptions : public torch::optim::OptimizerCloneableOptions<LambOptions> {
  LambOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT(google-explicit-constructor): as torch::optim's options
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0;  // added to the update (decoupled), inside the trust ratio

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// Per piece: the step count and Adam's moments (torch::optim::AdamWParamState's fields).
using LambParamState = torch::optim::AdamWParamState;

class Lamb : public WholeParamOptimizer {
 public:
  // `groups`: see WholeParamOptimizer (empty: every piece with `defaults`).
  Lamb(FullyShardedModule& module, std::vector<torch::optim::OptimizerParamGroup> groups,
       const LambOptions& defaults = {});
  Lamb(FullyShardedModule& module, const LambOptions& defaults) : Lamb(module, {}, defaults) {}
  // Collective over the module's shard group: every rank must call it at the same step.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace fsdp
