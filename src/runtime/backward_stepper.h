#pragma once
// BackwardStepper: the optimizer step in backward (FullyShardedModule::set_step_in_backward). Each
// FlatParameter's shard pieces are stepped as soon as their reduced gradients are in, while later
// reductions still run, and their gradients are then dropped so a later optimizer.step() skips
// them. See Note [Step in backward] in docs/design.md.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "flat_param.h"

namespace fsdp {

class BackwardStepper {
 public:
  // `optimizer` (null: off) must hold every trainable piece; checked here.
  void set(torch::optim::Optimizer* optimizer, const std::vector<std::unique_ptr<FlatParam>>& flat_params);
  bool on() const { return optimizer_ != nullptr; }
  // Steps `fp`'s pieces that have a gradient, once per backward, then drops those gradients.
  void step(FlatParam& fp, const std::string& unit_name);
  bool stepped(const FlatParam& fp) const { return optimizer_ && stepped_.at(fp.id()); }
  // Whether some FlatParameter was stepped in this backward.
  bool stepped_any() const;
  // The backward is over: the next one steps every FlatParameter again.
  void end_backward();

 private:
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::vector<char> stepped_;  // per FlatParameter id, in this backward
};

}  // namespace fsdp
