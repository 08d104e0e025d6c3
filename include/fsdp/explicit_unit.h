#pragma once
// ExplicitUnit, the marker of a module the model's code makes an FSDP unit (fsdp::Sharded<M>,
// sharded.h), and the runtime's entry points that such a module's forward calls. See Note
// [Explicit units] in docs/design.md.
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

namespace detail {
// Each is a no-op when `module` is not a unit of a live fully_shard runtime.
void enter_unit(const torch::nn::Module& module);
void exit_unit(const torch::nn::Module& module);
at::Tensor attach_pre_backward(const torch::nn::Module& module, at::Tensor output);
// Mixed precision (MixedPrecision::cast_forward_inputs, output_dtype); tensors only.
at::Tensor cast_forward_input(const torch::nn::Module& module, at::Tensor input);
at::Tensor cast_forward_output(const torch::nn::Module& module, at::Tensor output);
}  // namespace detail

}  // namespace fsdp
