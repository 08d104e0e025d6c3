#pragma once
// ExplicitUnit: the marker of a module that the model's code makes an FSDP unit (fsdp::Sharded<M>,
// sharded.h). See Note [Explicit units] in docs/design.md.
#include <torch/torch.h>

namespace fsdp {

// Marker base: fully_shard() makes every module deriving from it a unit.
class ExplicitUnit {
 public:
  virtual ~ExplicitUnit() = default;
  // The wrapped module whose tensors this one registers, if any (handed to the deferred-init
  // initializer).
  virtual torch::nn::Module* wrapped_module() { return nullptr; }
};

}  // namespace fsdp
