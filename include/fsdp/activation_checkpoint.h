#pragma once
// Activation checkpointing: fsdp::Checkpointed<M> keeps only M's inputs in forward and recomputes
// M's forward (random numbers replayed) in backward. Works alone and with fully_shard: the unit is
// gathered once for the recompute and its backward. See docs/usage.md (Activation checkpointing)
// and Note [Activation checkpointing] in docs/design.md.
#include <torch/torch.h>

#include <array>
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

 private:
  bool enabled_ = true;
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

template <typename Holder, typename ForwardSignature = decltype(&Holder::ContainedType::forward)>
class CheckpointedImpl;

template <typename Holder, typename Result, typename Impl, typename... Args>
class CheckpointedImpl<Holder, Result (Impl::*)(Args...)> : public torch::nn::Module, public CheckpointedBase {
  static_assert(!std::is_base_of_v<ExplicitUnit, typename Holder::ContainedType>,
                "fsdp::Checkpointed<fsdp::Sharded<M>> is not supported: write fsdp::Sharded<fsdp::Checkpointed<M>>");

 public:
  explicit CheckpointedImpl(Holder inner) : inner_(std::move(inner)) { detail::adopt_members(*this, *inner_); }

  // M's forward; with grad mode on and checkpointing enabled, its activations are recomputed in
  // backward instead of kept. Non-tensor arguments are copied and kept until backward.
  Result forward(Args... args) {
    if (!enabled() || !at::GradMode::is_enabled()) return inner_->forward(std::forward<Args>(args)...);
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
    std::shared_ptr<typename Holder::ContainedType> inner = inner_.ptr();
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
  static Result call(typename Holder::ContainedType& inner, std::tuple<std::decay_t<Args>...>& stored,
                     std::vector<at::Tensor>& tensors, std::index_sequence<K...>) {
    constexpr auto index = detail::tensor_indices<Args...>();
    return inner.forward(detail::pick_arg<index[K]>(std::get<K>(stored), tensors)...);
  }

  Holder inner_;
};

// fsdp::Checkpointed<Block>(Block(...)) in place of Block(...): parameter names do not change.
template <typename Holder>
using Checkpointed = torch::nn::ModuleHolder<CheckpointedImpl<Holder>>;

// Enables every Checkpointed wrapper in `root`'s tree (root included) that `policy` selects, given
// the wrapper or its wrapped module, the wrapper's qualified name and its parameter count, and
// disables the others. Returns how many are enabled.
int apply_activation_checkpointing(torch::nn::Module& root, const WrapPolicy& policy);

}  // namespace fsdp
