#pragma once
// The explicit form: fsdp::Sharded<M> marks a submodule as an FSDP unit in the model's code;
// without fully_shard it behaves exactly like M. Requires M's forward to be a single,
// non-overloaded member function without default arguments. See docs/usage.md (Explicit units)
// and Note [Explicit units] in docs/design.md.
#include <torch/torch.h>

#include <memory>
#include <type_traits>
#include <utility>

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

}  // namespace detail

template <typename Holder, typename ForwardSignature = decltype(&Holder::ContainedType::forward)>
class ShardedImpl;

template <typename Holder, typename Result, typename Impl, typename... Args>
class ShardedImpl<Holder, Result (Impl::*)(Args...)> : public torch::nn::Module, public ExplicitUnit {
 public:
  explicit ShardedImpl(Holder inner) : inner_(std::move(inner)) { detail::adopt_members(*this, *inner_); }

  Result forward(Args... args) {
    detail::UnitScope unit(*this);
    return detail::attach_pre_backward(
        *this, detail::cast_forward_output(
                   *this, inner_->forward(detail::forward_arg<Args>(*this, std::forward<Args>(args))...)));
  }

  torch::nn::Module* wrapped_module() override { return inner_.ptr().get(); }

  Holder& inner() { return inner_; }
  const Holder& inner() const { return inner_; }

  void pretty_print(std::ostream& stream) const override {
    stream << "fsdp::Sharded<";
    inner_->pretty_print(stream);
    stream << ">";
  }

 private:
  Holder inner_;
};

template <typename Holder>
using Sharded = torch::nn::ModuleHolder<ShardedImpl<Holder>>;

}  // namespace fsdp
