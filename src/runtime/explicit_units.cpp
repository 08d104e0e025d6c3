// The explicit form of a unit (fsdp::Sharded<M>, include/fsdp/unit_scope.h): entering and
// leaving a unit and its backward, routed to the Hooks of the model that made it a unit.
#include <memory>
#include <utility>

#include "fsdp/unit_scope.h"
#include "mixed_precision.h"
#include "runtime/hooks.h"

namespace fsdp {

void Hooks::on_unit_enter(int u) {
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  state_.rethrow_pending_error();
  state_.settle_failed_backward();
  state_.scheduler().use(u);
}

void Hooks::on_unit_exit(int u) {
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  state_.scheduler().post_forward(u);
}

void Hooks::on_unit_backward(int u) {
  std::lock_guard<std::recursive_mutex> lock(state_.mutex());
  state_.scheduler().use(u);
}

namespace detail {

void enter_unit(const torch::nn::Module& module) {
  auto [hooks, unit] = Hooks::find_unit(module);
  if (hooks) hooks->on_unit_enter(unit);
}

void exit_unit(const torch::nn::Module& module) {
  auto [hooks, unit] = Hooks::find_unit(module);
  if (hooks) hooks->on_unit_exit(unit);
}

at::Tensor cast_forward_input(const torch::nn::Module& module, at::Tensor input) {
  auto [hooks, unit] = Hooks::find_unit(module);
  if (!hooks) return input;
  return fsdp::cast_forward_input(hooks->state().options().mixed_precision(), std::move(input));
}

at::Tensor cast_forward_output(const torch::nn::Module& module, at::Tensor output) {
  auto [hooks, unit] = Hooks::find_unit(module);
  if (!hooks) return output;
  return fsdp::cast_forward_output(hooks->state().options().mixed_precision(), std::move(output));
}

at::Tensor attach_pre_backward(const torch::nn::Module& module, at::Tensor output) {
  if (!output.defined() || !output.requires_grad() || !at::GradMode::is_enabled()) return output;
  if (Hooks::find_unit(module).first == nullptr) return output;
  // The hook holds the module weakly: a graph may outlive the model.
  std::weak_ptr<const torch::nn::Module> weak;
  try {
    weak = module.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    return output;  // not owned by a shared_ptr: the operator hook gathers it in backward
  }
  output.register_hook([weak](const at::Tensor& grad) {
    if (auto m = weak.lock()) {
      auto [hooks, unit] = Hooks::find_unit(*m);
      if (hooks) hooks->on_unit_backward(unit);
    }
    return grad;
  });
  return output;
}

}  // namespace detail

}  // namespace fsdp
