#pragma once
// The explicit form: a model author marks a submodule as an FSDP unit in the model's code.
//
//   struct GPTImpl : torch::nn::Module {
//     GPTImpl() { for (int i = 0; i < 12; ++i) blocks->push_back(fsdp::Sharded<Block>(Block(768, 12))); ... }
//
// fsdp::Sharded<Block> is a module holder whose module takes over Block's children, parameters and
// buffers under the same names (so named_parameters() is unchanged) and whose forward:
//   1. gathers the unit's parameters when it is entered (and issues the forward prefetch),
//   2. runs the wrapped module's forward,
//   3. frees the parameters when it returns (FULL_SHARD / HYBRID_SHARD; not for the root unit),
//   4. registers a hook on its output tensor that gathers the parameters again when the gradient
//      reaches this unit in backward (and issues the backward prefetch).
// fully_shard() makes every Sharded module a unit, in addition to the wrap policy's. Without
// fully_shard (e.g. local training), Sharded<M> behaves exactly like M. The operation interception
// of the implicit form stays active as a safety net (e.g. for a submodule called directly).
//
// Requirements: M's forward is a single, non-overloaded member function (no default arguments);
// Sharded<M>::inner() gives access to the wrapped module.
#include <torch/torch.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace fsdp {

// Marker base: fully_shard() makes every module deriving from it a unit.
class ExplicitUnit {
 public:
  virtual ~ExplicitUnit() = default;
  // The module whose parameters and buffers this one registers as its own, if it wraps one:
  // deferred initialization hands that module to the initializer (e.g. a Linear's
  // reset_parameters() for fsdp::Sharded<torch::nn::Linear>).
  virtual torch::nn::Module* wrapped_module() { return nullptr; }
};

namespace detail {
// Each is a no-op when `module` is not a unit of a live fully_shard runtime.
void enter_unit(const torch::nn::Module& module);
void exit_unit(const torch::nn::Module& module);
at::Tensor attach_pre_backward(const torch::nn::Module& module, at::Tensor output);
template <typename T>
T attach_pre_backward(const torch::nn::Module&, T output) {
  return output;  // non-tensor outputs: the interception gathers the unit in backward
}

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

template <typename Holder, typename ForwardSignature = decltype(&Holder::ContainedType::forward)>
class ShardedImpl;

template <typename Holder, typename Result, typename Impl, typename... Args>
class ShardedImpl<Holder, Result (Impl::*)(Args...)> : public torch::nn::Module, public ExplicitUnit {
 public:
  explicit ShardedImpl(Holder inner) : inner_(std::move(inner)) {
    // Take over the wrapped module's members under their own names, so names do not change.
    for (const auto& kv : inner_->named_children()) register_module(kv.key(), kv.value());
    for (const auto& kv : inner_->named_parameters(/*recurse=*/false))
      register_parameter(kv.key(), kv.value(), kv.value().requires_grad());
    for (const auto& kv : inner_->named_buffers(/*recurse=*/false)) register_buffer(kv.key(), kv.value());
  }

  Result forward(Args... args) {
    detail::UnitScope unit(*this);
    return detail::attach_pre_backward(*this, inner_->forward(std::forward<Args>(args)...));
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
