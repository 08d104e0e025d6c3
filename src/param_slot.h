#pragma once
// ParamSlot: one original parameter's place in a FlatParameter (flat_param.h) and the shard
// piece that the optimizer steps for it.
#include <torch/csrc/autograd/function.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp {

struct ParamSlot {
  std::string name;                  // first qualified name in the module tree
  std::vector<std::string> aliases;  // further names of a shared (tied) parameter
  at::Tensor param;                  // the module's own parameter (identity kept)
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in the unsharded flat buffer
  int64_t numel = 0;
  // The part of this parameter inside this rank's shard: a 1-D leaf over the shard storage, handed
  // to the optimizer. Undefined if the parameter lies entirely in other ranks' shards.
  at::Tensor piece;
  int64_t piece_offset = 0;  // in the shard
  int64_t piece_numel = 0;
  std::shared_ptr<torch::autograd::Node> grad_accumulator;  // kept alive: autograd holds it weakly
  bool requires_grad_seen = false;  // the parameter's requires_grad when FSDP last looked (Note [Unfreezing])
  bool used = false;                // an op read it with grad mode on since the last backward
  bool got_grad = false;            // its AccumulateGrad ran in this backward
};

}  // namespace fsdp
