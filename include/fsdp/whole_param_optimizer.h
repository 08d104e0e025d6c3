#pragma once
// WholeParamOptimizer: the base of libfsdp's optimizers whose step needs whole original parameters
// (Lamb, Adafactor, Muon): a torch::optim::Optimizer over a sharded module's pieces that knows
// every original parameter (ParamReduction::params()) and each piece's parameter group.
#include <torch/torch.h>

#include <memory>
#include <unordered_map>
#include <vector>

#include "fsdp/fully_shard.h"
#include "fsdp/param_reduction.h"

namespace fsdp {

class WholeParamOptimizer : public torch::optim::Optimizer {
 public:
  // The reductions its steps ran (e.g. to count their collectives).
  const ParamReduction& reduction() const { return reduction_; }
  // Collective over the module's shard group: checkpoint::load calls it on every rank once it has
  // set the groups' options and the pieces' state.
  virtual void after_load() {}

 protected:
  // `groups` of shard pieces of `module` (FullyShardedModule::shard_pieces()), each piece in one
  // group, their options of `defaults`' type; empty: one group of every piece with `defaults` (a
  // frozen piece steps once it has gradients). Every rank must pass groups built alike.
  WholeParamOptimizer(FullyShardedModule& module, std::vector<torch::optim::OptimizerParamGroup> groups,
                      std::unique_ptr<torch::optim::OptimizerOptions> defaults);
  // The parameter group that steps p's piece; -1 if this rank holds no piece of p or no group has it.
  int group_of(const WholeParam& p) const;
  // The start of every step(): refuses a step in backward (naming `what`), rethrows the runtime's
  // pending error, follows parameters unfrozen since the last step (trainable_changed()), and
  // runs `closure` (if any) with grad mode on; returns its loss.
  torch::Tensor begin_step(const char* what, const LossClosure& closure);
  // Collective over the module's shard group: some parameter's FlatParameter requires grad now.
  virtual void trainable_changed() {}
  // p's piece steps now: it is in a group and has a gradient.
  bool steps(const WholeParam& p) const { return p.has_grad() && group_of(p) >= 0; }

  ParamReduction reduction_;

 private:
  std::unordered_map<const c10::TensorImpl*, int> group_by_piece_;
  FullyShardedModule* module_;
};

}  // namespace fsdp
