#pragma once
// The explicit form: fsdp::Sharded<M> marks a submodule as an FSDP unit in the model's code;
// without fully_shard it behaves exactly like M. Its forward is M's forward (one tensor in, one
// out for torch::nn::Sequential), or the one named by Sharded<M, Result(Args...)>. See
// docs/usage.md (Explicit units) and Note [Explicit units] in docs/design.md.
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/explicit_unit.h"
#include "fsdp/unit_scope.h"
#include "fsdp/wrap_policy.h"

namespace fsdp {

namespace detail {
template <typename T>
T cast_forward_output(const torch::nn::Module&, T output) {
  return output;
}
// A forward argument: a tensor passed by value or const reference goes through cast_forward_input.
template <typename A>
decltype(auto) forward_arg(const torch::nn::Module& module, A&& arg) {
  constexpr bool mutable_ref = std::is_lvalue_reference_v<A> && !std::is_const_v<std::remove_reference_t<A>>;
  if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor> && !mutable_ref)
    return at::Tensor(cast_forward_input(module, arg));
  else
    return std::forward<A>(arg);
}
template <typename T>
T attach_pre_backward(const torch::nn::Module&, T output) {
  return output;  // non-tensor outputs: the interception gathers the unit in backward
}

// The forward of a module a wrapper cannot take over unnamed: the module has none, an
// overloaded one or a template.
struct UnresolvedForward {};

// R(Args...) for a pointer to a member function R (C::*)(Args...), const or noexcept or not.
template <typename F>
struct function_type_of {
  using type = UnresolvedForward;
};
template <typename R, typename C, typename... A>
struct function_type_of<R (C::*)(A...)> {
  using type = R(A...);
};
template <typename R, typename C, typename... A>
struct function_type_of<R (C::*)(A...) const> {
  using type = R(A...);
};
template <typename R, typename C, typename... A>
struct function_type_of<R (C::*)(A...) noexcept> {
  using type = R(A...);
};
template <typename R, typename C, typename... A>
struct function_type_of<R (C::*)(A...) const noexcept> {
  using type = R(A...);
};

// Whether Impl's forward is a single member function (so its address has one type).
template <typename Impl, typename = void>
inline constexpr bool has_single_forward = false;
template <typename Impl>
inline constexpr bool has_single_forward<Impl, std::void_t<decltype(&Impl::forward)>> = true;
// Whether Impl's forward is torch::nn::Sequential's template: forward<Result>(inputs...).
template <typename Impl>
inline constexpr bool has_sequential_forward =
    !has_single_forward<Impl> && std::is_base_of_v<torch::nn::SequentialImpl, Impl>;

// The forward a wrapper of M takes over when none is named, as R(Args...): M's own, Tensor(Tensor)
// for a Sequential, else UnresolvedForward.
template <typename Impl, typename = void>
struct default_forward {
  using type = std::conditional_t<has_sequential_forward<Impl>, at::Tensor(at::Tensor), UnresolvedForward>;
};
template <typename Impl>
struct default_forward<Impl, std::enable_if_t<has_single_forward<Impl>>> {
  using type = typename function_type_of<decltype(&Impl::forward)>::type;
};
template <typename M>
using default_forward_t = typename default_forward<module_impl_t<M>>::type;

// The holder a wrapper of M keeps: M itself if it is one, else torch::nn::ModuleHolder<M>.
template <typename M>
using holder_t = std::conditional_t<torch::detail::is_module_holder<M>::value, M,
                                    torch::nn::ModuleHolder<std::remove_cv_t<module_impl_t<M>>>>;

// Calls impl's forward with `args`, as a forward of type Result(Args...).
template <typename Result, typename Impl, typename... A>
Result call_forward(Impl& impl, A&&... args) {
  if constexpr (has_sequential_forward<Impl>)
    return impl.template forward<Result>(std::forward<A>(args)...);
  else
    return impl.forward(std::forward<A>(args)...);
}

// Whether Impl's forward can be called as a forward of type F = Result(Args...).
template <typename Impl, typename F, typename = void>
inline constexpr bool forward_callable = false;
template <typename Impl, typename R, typename... A>
inline constexpr bool
    forward_callable<Impl, R(A...), std::void_t<decltype(std::declval<Impl&>().forward(std::declval<A>()...))>> =
        has_sequential_forward<Impl> || std::is_void_v<R> ||
        std::is_convertible_v<decltype(std::declval<Impl&>().forward(std::declval<A>()...)), R>;

// The base of a wrapper module (fsdp::Sharded, fsdp::Checkpointed): answers LibTorch's questions
// about forward's default arguments (FORWARD_HAS_DEFAULT_ARGS) for the wrapped module, so that a
// Sequential or AnyModule call may omit the arguments that the wrapped module declares defaults for.
class WrapperModule : public torch::nn::Module {
 protected:
  // `arity`: how many arguments the wrapper's forward takes.
  explicit WrapperModule(unsigned int arity) : arity_(arity) {}
  // The wrapped module.
  virtual torch::nn::Module& forward_target() = 0;

  template <typename ModuleType, typename... ArgumentTypes>
  friend struct torch::nn::AnyModuleHolder;
  bool _forward_has_default_args() override { return Access::has(forward_target()); }
  unsigned int _forward_num_required_args() override { return std::min(Access::required(forward_target()), arity_); }
  std::vector<torch::nn::AnyValue> _forward_populate_default_args(
      std::vector<torch::nn::AnyValue>&& arguments) override {
    auto all = Access::populate(forward_target(), std::move(arguments));
    if (all.size() > arity_) all.erase(all.begin() + arity_, all.end());
    return all;
  }

 private:
  // Module's protected members, called on another module.
  struct Access : torch::nn::Module {
    static bool has(torch::nn::Module& m) { return (m.*&Access::_forward_has_default_args)(); }
    static unsigned int required(torch::nn::Module& m) { return (m.*&Access::_forward_num_required_args)(); }
    static std::vector<torch::nn::AnyValue> populate(torch::nn::Module& m, std::vector<torch::nn::AnyValue>&& args) {
      return (m.*&Access::_forward_populate_default_args)(std::move(args));
    }
  };
  unsigned int arity_;
};

}  // namespace detail

// The forms refused, each with its message: M not a module, M's forward not taken over unnamed,
// Forward not a function type.
template <typename M, typename Forward = detail::default_forward_t<M>>
class ShardedImpl {
  static_assert(detail::is_module_type<M>,
                "fsdp::Sharded<M>: M must be a module holder (Block, declared by TORCH_MODULE(Block)) or a module "
                "class (BlockImpl, deriving from torch::nn::Module)");
  static_assert(!detail::is_module_type<M> || !std::is_same_v<Forward, detail::UnresolvedForward>,
                "fsdp::Sharded<M>: M's forward must be one member function, neither overloaded nor a template (the "
                "wrapper's forward takes its signature; torch::nn::Sequential's counts as at::Tensor(at::Tensor)). "
                "For another module, name the forward to wrap: fsdp::Sharded<M, at::Tensor(const at::Tensor&)>, "
                "its result and argument types");
  static_assert(!detail::is_module_type<M> || std::is_same_v<Forward, detail::UnresolvedForward>,
                "fsdp::Sharded<M, Forward>: Forward must be a function type, Result(Args...), e.g. "
                "at::Tensor(const at::Tensor&)");
};

// M: a module holder (Block) or module class (BlockImpl). Forward: the wrapper's forward,
// Result(Args...), which calls M's forward with the same arguments.
template <typename M, typename Result, typename... Args>
class ShardedImpl<M, Result(Args...)> : public detail::WrapperModule, public ExplicitUnit {
  static_assert(detail::is_module_type<M>,
                "fsdp::Sharded<M>: M must be a module holder (Block, declared by TORCH_MODULE(Block)) or a module "
                "class (BlockImpl, deriving from torch::nn::Module)");
  using Holder = detail::holder_t<M>;
  static_assert(detail::forward_callable<typename Holder::ContainedType, Result(Args...)>,
                "fsdp::Sharded<M, Result(Args...)>: M's forward cannot be called with arguments of types Args... to "
                "return a Result");

 public:
  explicit ShardedImpl(Holder inner)
      : detail::WrapperModule(static_cast<unsigned int>(sizeof...(Args))), inner_(std::move(inner)) {
    detail::adopt_members(*this, *inner_);
  }

  Result forward(Args... args) {
    detail::UnitScope unit(*this);
    return detail::attach_pre_backward(
        *this, detail::cast_forward_output(
                   *this, detail::call_forward<Result>(*inner_,
                                                       detail::forward_arg<Args>(*this, std::forward<Args>(args))...)));
  }

  torch::nn::Module* wrapped_module() override { return inner_.ptr().get(); }

  Holder& inner() { return inner_; }
  const Holder& inner() const { return inner_; }

  void pretty_print(std::ostream& stream) const override {
    stream << "fsdp::Sharded<";
    inner_->pretty_print(stream);
    stream << ">";
  }

 protected:
  torch::nn::Module& forward_target() override { return *inner_; }

 private:
  Holder inner_;
};

// fsdp::Sharded<Block>(Block(...)) in place of Block(...): parameter names do not change.
// fsdp::Sharded<M, at::Tensor(const at::Tensor&)> names the forward to wrap (M's is overloaded, a
// template, or has default arguments to leave out).
template <typename M, typename Forward = detail::default_forward_t<M>>
using Sharded = torch::nn::ModuleHolder<ShardedImpl<M, Forward>>;

}  // namespace fsdp
