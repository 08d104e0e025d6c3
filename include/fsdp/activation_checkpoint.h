#pragma once
// Activation checkpointing: fsdp::Checkpointed<M> keeps only M's inputs in forward and recomputes
// M's forward (random numbers replayed) in backward. Works alone and with fully_shard: the unit is
// gathered once for the recompute and its backward. See docs/usage.md (Activation checkpointing)
// and Note [Activation checkpointing] in docs/design.md.
#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/sharded.h"
#include "fsdp/wrap_policy.h"

namespace fsdp {

// The part of every Checkpointed<M> that does not depend on M.
class CheckpointedBase : public ModuleWrapper {
 public:
  // Whether forward checkpoints (true from construction); off, it is exactly M's forward.
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }
  // Forwards run since construction, checkpointed or not (the planner's trace counts them).
  uint64_t forward_calls() const { return forward_calls_; }

 protected:
  void count_forward() { ++forward_calls_; }

 private:
  bool enabled_ = true;
  uint64_t forward_calls_ = 0;
};

namespace detail {

// Runs the wrapped forward on the given tensor arguments (the non-tensor ones are captured).
using CheckpointRun = std::function<at::Tensor(std::vector<at::Tensor>& tensors)>;
// Runs `run` on `tensors` without grad, keeping the tensors and the random-number and autocast
// state; backward recomputes it with grad and backpropagates through it. `module`: the wrapped one.
at::Tensor checkpoint(std::shared_ptr<torch::nn::Module> module, CheckpointRun run, std::vector<at::Tensor> tensors);

template <typename A>
constexpr bool is_tensor_arg = std::is_same_v<std::decay_t<A>, at::Tensor>;
template <typename A>
constexpr bool is_unsupported_tensor_container =
    std::is_same_v<std::decay_t<A>, c10::optional<at::Tensor>> ||
    std::is_same_v<std::decay_t<A>, std::vector<at::Tensor>> || std::is_same_v<std::decay_t<A>, at::TensorList>;

// For each argument position, its index among the tensor arguments, or -1.
template <typename... Args>
constexpr std::array<int, sizeof...(Args)> tensor_indices() {
  constexpr bool is_tensor[] = {is_tensor_arg<Args>..., false};
  std::array<int, sizeof...(Args)> index{};
  int n = 0;
  for (size_t k = 0; k < sizeof...(Args); ++k) index[k] = is_tensor[k] ? n++ : -1;
  return index;
}

template <int Index, typename Stored>
decltype(auto) pick_arg(Stored& stored, std::vector<at::Tensor>& tensors) {
  if constexpr (Index >= 0)
    return (tensors[Index]);
  else
    return (stored);
}
}  // namespace detail

// The forms refused, each with its message: M not a module, M's forward not taken over unnamed,
// Forward not a function type.
template <typename M, typename Forward = detail::default_forward_t<M>>
class CheckpointedImpl {
  static_assert(detail::is_module_type<M>,
                "fsdp::Checkpointed<M>: M must be a module holder (Block, declared by TORCH_MODULE(Block)) or a "
                "module class (BlockImpl, deriving from torch::nn::Module)");
  static_assert(!detail::is_module_type<M> || !std::is_same_v<Forward, detail::UnresolvedForward>,
                "fsdp::Checkpointed<M>: M's forward must be one member function, neither overloaded nor a template "
                "(the wrapper's forward takes its signature; torch::nn::Sequential's counts as "
                "at::Tensor(at::Tensor)). For another module, name the forward to wrap: fsdp::Checkpointed<M, "
                "at::Tensor(const at::Tensor&)>, its result and argument types");
  static_assert(!detail::is_module_type<M> || std::is_same_v<Forward, detail::UnresolvedForward>,
                "fsdp::Checkpointed<M, Forward>: Forward must be a function type, Result(Args...), e.g. "
                "at::Tensor(const at::Tensor&)");
};

// M: a module holder (Block) or module class (BlockImpl). Forward: the wrapper's forward,
// Result(Args...), which calls M's forward with the same arguments.
template <typename M, typename Result, typename... Args>
class CheckpointedImpl<M, Result(Args...)> : public detail::WrapperModule, public CheckpointedBase {
  static_assert(detail::is_module_type<M>,
                "fsdp::Checkpointed<M>: M must be a module holder (Block, declared by TORCH_MODULE(Block)) or a "
                "module class (BlockImpl, deriving from torch::nn::Module)");
  using Holder = detail::holder_t<M>;
  using Impl = typename Holder::ContainedType;
  static_assert(!std::is_base_of_v<ExplicitUnit, Impl>,
                "fsdp::Checkpointed<fsdp::Sharded<M>> is not supported: write fsdp::Sharded<fsdp::Checkpointed<M>>");
  static_assert(detail::forward_callable<Impl, Result(Args...)>,
                "fsdp::Checkpointed<M, Result(Args...)>: M's forward cannot be called with arguments of types "
                "Args... to return a Result");

 public:
  explicit CheckpointedImpl(Holder inner)
      : detail::WrapperModule(static_cast<unsigned int>(sizeof...(Args))), inner_(std::move(inner)) {
    detail::adopt_members(*this, *inner_);
  }

  // M's forward; with grad mode on and checkpointing enabled, its activations are recomputed in
  // backward instead of kept. Non-tensor arguments are copied and kept until backward.
  Result forward(Args... args) {
    count_forward();
    if (!enabled() || !at::GradMode::is_enabled())
      return detail::call_forward<Result>(*inner_, std::forward<Args>(args)...);
    static_assert(std::is_same_v<Result, at::Tensor>, "fsdp::Checkpointed: the wrapped forward must return a Tensor");
    static_assert(!(std::is_rvalue_reference_v<Args> || ...),
                  "fsdp::Checkpointed: forward arguments taken by rvalue reference are not supported");
    static_assert(!(detail::is_unsupported_tensor_container<Args> || ...),
                  "fsdp::Checkpointed: pass tensors as at::Tensor arguments (optional<Tensor>, vector<Tensor> and "
                  "TensorList are not supported)");
    std::vector<at::Tensor> tensors;
    (collect(tensors, args), ...);
    // The non-tensor arguments; the tensors are kept by the autograd graph, not here.
    auto stored = std::make_shared<std::tuple<std::decay_t<Args>...>>(args...);
    std::apply([](auto&... a) { (drop_tensor(a), ...); }, *stored);
    std::shared_ptr<Impl> inner = inner_.ptr();
    detail::CheckpointRun run = [inner, stored](std::vector<at::Tensor>& ts) {
      return call(*inner, *stored, ts, std::index_sequence_for<Args...>{});
    };
    return detail::checkpoint(inner, std::move(run), std::move(tensors));
  }

  torch::nn::Module& wrapped() override { return *inner_; }
  Holder& inner() { return inner_; }
  const Holder& inner() const { return inner_; }

  void pretty_print(std::ostream& stream) const override {
    stream << "fsdp::Checkpointed<";
    inner_->pretty_print(stream);
    stream << ">";
  }

 protected:
  torch::nn::Module& forward_target() override { return *inner_; }

 private:
  template <typename A>
  static void collect(std::vector<at::Tensor>& tensors, const A& arg) {
    if constexpr (detail::is_tensor_arg<A>) tensors.push_back(arg);
  }

  template <typename A>
  static void drop_tensor(A& arg) {
    if constexpr (detail::is_tensor_arg<A>) arg.reset();
  }

  template <size_t... K>
  static Result call(Impl& inner, std::tuple<std::decay_t<Args>...>& stored, std::vector<at::Tensor>& tensors,
                     std::index_sequence<K...>) {
    constexpr auto index = detail::tensor_indices<Args...>();
    return detail::call_forward<Result>(inner, detail::pick_arg<index[K]>(std::get<K>(stored), tensors)...);
  }

  Holder inner_;
};

// fsdp::Checkpointed<Block>(Block(...)) in place of Block(...): parameter names do not change.
// fsdp::Checkpointed<M, at::Tensor(const at::Tensor&)> names the forward to wrap (M's is
// overloaded, a template, or has default arguments to leave out).
template <typename M, typename Forward = detail::default_forward_t<M>>
using Checkpointed = torch::nn::ModuleHolder<CheckpointedImpl<M, Forward>>;

// Enables every Checkpointed wrapper in `root`'s tree (root included) that `policy` selects, given
// the wrapper or its wrapped module, the wrapper's qualified name and the parameter count an
// auto_wrap_policy is given for it (those no nested unit takes), and disables the others: with
// fully_shard's wrap policy, the units' wrappers. Returns how many are enabled.
int apply_activation_checkpointing(torch::nn::Module& root, const WrapPolicy& policy);

}  // namespace fsdp
