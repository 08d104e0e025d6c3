// FSDP's hooks on the parameters' AccumulateGrad nodes: added when the runtime is built, added
// later to parameters unfrozen since (Note [Unfreezing]) and to parameters whose data was replaced,
// and removed with the runtime.
#include <torch/csrc/autograd/function_hook.h>

#include <memory>
#include <utility>
#include <vector>

#include "fsdp/check.h"
#include "runtime/hooks.h"

namespace fsdp {

namespace {

struct GradPreHook : torch::autograd::FunctionPreHook {
  GradPreHook(Hooks* h, int f, int s) : hooks(h), flat_param(f), slot(s) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    hooks->on_grad_pre(flat_param, slot);
    return grads;
  }
  Hooks* hooks;
  int flat_param, slot;
};

struct GradPostHook : torch::autograd::FunctionPostHook {
  GradPostHook(Hooks* h, int f, int s) : hooks(h), flat_param(f), slot(s) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    hooks->on_grad_post(flat_param, slot);
    return outputs;
  }
  Hooks* hooks;
  int flat_param, slot;
};

}  // namespace

void Hooks::add_grad_hooks() {
  auto& flat_params = state_.flat_params();
  for (size_t f = 0; f < flat_params.size(); ++f)
    for (size_t s = 0; s < flat_params[f]->slots().size(); ++s)
      if (flat_params[f]->slots()[s].param.requires_grad()) hook_slot(int(f), int(s));
}

void Hooks::hook_slot(int f, int s) {
  // Autograd holds AccumulateGrad nodes weakly, so the slots keep them alive.
  ParamSlot& slot = state_.flat_params()[f]->slots()[s];
  auto acc = torch::autograd::impl::grad_accumulator(slot.param);
  FSDP_CHECK(acc, "internal: parameter '", slot.name, "' has no gradient accumulator");
  acc->add_pre_hook(std::make_unique<GradPreHook>(this, f, s));
  acc->add_post_hook(std::make_unique<GradPostHook>(this, f, s));
  slot.grad_accumulator = std::move(acc);
}

void Hooks::sync_requires_grad(int f, int s) {
  FlatParam& fp = *state_.flat_params()[f];
  ParamSlot& slot = fp.slots()[s];
  const bool now = slot.param.requires_grad();
  if (now == slot.requires_grad_seen) {
    FSDP_CHECK(!slot.piece.defined() || slot.piece.requires_grad() == now, "the shard piece of parameter '", slot.name,
               "' was set to requires_grad ", slot.piece.requires_grad() ? "true" : "false",
               " but the parameter itself was not: a piece follows its parameter. Freeze or unfreeze through the "
               "module's parameters (module->parameters() or named_parameters(), as in local training), on every "
               "rank");
    return;
  }
  slot.requires_grad_seen = now;
  if (slot.piece.defined() && slot.piece.unsafeGetTensorImpl() != slot.param.unsafeGetTensorImpl())
    slot.piece.set_requires_grad(now);
  if (!now || slot.grad_accumulator) return;
  fp.note_requires_grad();
  hook_slot(f, s);
  hooked_since_backward_.emplace_back(f, s);
}

void Hooks::sync_requires_grad() {
  auto& flat_params = state_.flat_params();
  for (size_t f = 0; f < flat_params.size(); ++f)
    for (size_t s = 0; s < flat_params[f]->slots().size(); ++s) sync_requires_grad(int(f), int(s));
}

bool Hooks::any_hooked() const {
  for (const auto& fp : state_.flat_params())
    for (const auto& slot : fp->slots())
      if (slot.grad_accumulator) return true;
  return false;
}

void Hooks::take_late_grads() {
  for (const auto& [f, s] : std::exchange(hooked_since_backward_, {})) {
    FlatParam& fp = *state_.flat_params()[f];
    ParamSlot& slot = fp.slots()[s];
    at::Tensor g = slot.param.grad();
    if (!g.defined() || fp.grad().is_sentinel(s, g)) continue;  // none, or its hooks took it
    state_.reducer().prepare_grad(f, s);
    slot.param.mutable_grad() = std::move(g);
    if (state_.reducer().take_grad(f, s)) state_.scheduler().post_backward(fp.unit());
  }
}

void Hooks::remove_grad_hooks() {
  for (auto& fp : state_.flat_params())
    for (auto& slot : fp->slots()) {
      if (!slot.grad_accumulator) continue;
      auto& pre = slot.grad_accumulator->pre_hooks();
      pre.erase(std::remove_if(pre.begin(), pre.end(),
                               [](const auto& h) { return dynamic_cast<GradPreHook*>(h.get()) != nullptr; }),
                pre.end());
      auto& post = slot.grad_accumulator->post_hooks();
      post.erase(std::remove_if(post.begin(), post.end(),
                                [](const auto& h) { return dynamic_cast<GradPostHook*>(h.get()) != nullptr; }),
                 post.end());
      slot.grad_accumulator.reset();
    }
}

void Hooks::hook_replaced_params() {
  auto& flat_params = state_.flat_params();
  for (size_t f = 0; f < flat_params.size(); ++f) {
    auto& slots = flat_params[f]->slots();
    for (size_t i = 0; i < slots.size(); ++i) {
      ParamSlot& slot = slots[i];
      if (!slot.param.requires_grad() || slot.param.storage().unsafeGetStorageImpl() == flat_params[f]->storage())
        continue;
      auto acc = torch::autograd::impl::grad_accumulator(slot.param);
      if (!acc || acc == slot.grad_accumulator) continue;
      acc->add_pre_hook(std::make_unique<GradPreHook>(this, int(f), int(i)));
      slot.grad_accumulator = std::move(acc);
    }
  }
}

}  // namespace fsdp
