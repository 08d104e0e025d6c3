#pragma once
// The runtime's entry points that an explicit unit's forward (fsdp::Sharded<M>, sharded.h) calls:
// entering and leaving the unit, its backward, and mixed precision's casts of its inputs and
// outputs. Implemented by the runtime (src/runtime/explicit_units.cpp). See Note [Explicit units] in
// docs/design.md.
#include <torch/torch.h>

namespace fsdp {

namespace detail {
// Each is a no-op when `module` is not a unit of a live fully_shard runtime.
void enter_unit(const torch::nn::Module& module);
void exit_unit(const torch::nn::Module& module);
at::Tensor attach_pre_backward(const torch::nn::Module& module, at::Tensor output);
// Mixed precision (MixedPrecision::cast_forward_inputs, output_dtype); tensors only.
at::Tensor cast_forward_input(const torch::nn::Module& module, at::Tensor input);
at::Tensor cast_forward_output(const torch::nn::Module& module, at::Tensor output);

// Enters the unit for its lifetime.
class UnitScope {
 public:
  explicit UnitScope(const torch::nn::Module& module) : module_(module) { enter_unit(module_); }
  ~UnitScope() { exit_unit(module_); }
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;

 private:
  const torch::nn::Module& module_;
};
}  // namespace detail

}  // namespace fsdp
