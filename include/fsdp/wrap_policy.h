#pragma once
// Auto-wrap policies: which submodules become FSDP units. A policy is asked about every
// submodule bottom-up (children before parents) and sees how many parameter elements of that
// subtree are not yet in a unit; the root module is always a unit.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {

using WrapPolicy =
    std::function<bool(const std::string& qualified_name, const torch::nn::Module& module, int64_t unwrapped_numel)>;

namespace wrap {

// Wrap every module whose implementation type is one of ModuleImpls (e.g. BlockImpl).
template <typename... ModuleImpls>
WrapPolicy by_type() {
  return [](const std::string&, const torch::nn::Module& m, int64_t) {
    return ((dynamic_cast<const ModuleImpls*>(&m) != nullptr) || ...);
  };
}
// Wrap a module once its subtree holds at least min_num_params parameter elements that no
// nested unit took (PyTorch's size-based policy).
WrapPolicy by_size(int64_t min_num_params);
// Wrap where pred(qualified_name, module) is true.
WrapPolicy by_predicate(std::function<bool(const std::string&, const torch::nn::Module&)> pred);
// Wrap modules with these qualified names (e.g. "blocks.0", "encoder").
WrapPolicy by_names(std::vector<std::string> names);
// Wrap where any of the policies says so.
WrapPolicy any_of(std::vector<WrapPolicy> policies);

}  // namespace wrap
}  // namespace fsdp
