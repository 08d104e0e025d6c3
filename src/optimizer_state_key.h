#pragma once
// The key under which a LibTorch optimizer keeps a parameter's state.
#include <c10/util/string_utils.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <type_traits>

namespace fsdp::detail {

using OptimizerStateKey = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

// The parameter's TensorImpl: its address printed (LibTorch 1.x), the pointer itself (2.x).
inline OptimizerStateKey optimizer_state_key(const at::Tensor& param) {
#if TORCH_VERSION_MAJOR >= 2
  return param.unsafeGetTensorImpl();
#else
  return c10::guts::to_string(param.unsafeGetTensorImpl());
#endif
}

}  // namespace fsdp::detail
