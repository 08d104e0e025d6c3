#pragma once
// Auto-wrap policies: which submodules become FSDP units. A policy is asked about every
// submodule bottom-up (children before parents) and sees how many parameter elements of that
// subtree are not yet in a unit; the root module is always a unit.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace fsdp {

using WrapPolicy =
    std::function<bool(const std::string& qualified_name, const torch::nn::Module& module, int64_t unwrapped_numel)>;

// A module that stands in for the module it wraps, owning that module's children, parameters and
// buffers under their own names (fsdp::Checkpointed<M>).
class ModuleWrapper {
 public:
  virtual ~ModuleWrapper() = default;
  virtual torch::nn::Module& wrapped() = 0;
  const torch::nn::Module& wrapped() const { return const_cast<ModuleWrapper*>(this)->wrapped(); }
};

namespace detail {
// The module class a type names: Impl for a module holder (Block, torch::nn::Linear: a
// torch::nn::ModuleHolder<Impl>), the type itself otherwise (BlockImpl).
template <typename T, bool = torch::detail::is_module_holder<T>::value>
struct module_impl {
  using type = T;
};
template <typename T>
struct module_impl<T, true> {
  using type = typename T::ContainedType;
};
template <typename T>
using module_impl_t = typename module_impl<std::remove_cv_t<T>>::type;
// Whether T is a module class (BlockImpl) or a module holder (Block).
template <typename T>
inline constexpr bool is_module_type = std::is_base_of_v<torch::nn::Module, module_impl_t<T>>;

// Registers `inner`'s children, own parameters and own buffers on `self` under their own names, so
// that a wrapper (fsdp::Sharded, fsdp::Checkpointed) changes no qualified name.
inline void adopt_members(torch::nn::Module& self, torch::nn::Module& inner) {
  for (const auto& kv : inner.named_children()) self.register_module(kv.key(), kv.value());
  for (const auto& kv : inner.named_parameters(/*recurse=*/false))
    self.register_parameter(kv.key(), kv.value(), kv.value().requires_grad());
  for (const auto& kv : inner.named_buffers(/*recurse=*/false)) self.register_buffer(kv.key(), kv.value());
}
}  // namespace detail

namespace wrap {

// Wrap every module of one of these types, or that stands in for one (fsdp::Checkpointed<Block>).
// Each type is a module class (BlockImpl) or its holder (Block, torch::nn::Linear): a holder
// stands for its module class.
template <typename... Modules>
WrapPolicy by_type() {
  static_assert(sizeof...(Modules) > 0, "fsdp::wrap::by_type<M...>(): name at least one module type");
  static_assert((detail::is_module_type<Modules> && ...),
                "fsdp::wrap::by_type<M...>(): each M must be a module class (BlockImpl, deriving from "
                "torch::nn::Module) or a module holder (Block, declared by TORCH_MODULE(Block))");
  return [](const std::string&, const torch::nn::Module& m, int64_t) {
    for (const torch::nn::Module* t = &m;;) {
      if (((dynamic_cast<const detail::module_impl_t<Modules>*>(t) != nullptr) || ...)) return true;
      const auto* wrapper = dynamic_cast<const ModuleWrapper*>(t);
      if (wrapper == nullptr) return false;
      t = &wrapper->wrapped();
    }
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
