// Explicit unshard and full parameters (FullyShardedModule::unshard / reshard /
// summon_full_params): the user's ways to see whole parameters outside FSDP's own schedule.
#include "fsdp/fully_shard.h"

#include <torch/csrc/autograd/variable.h>

#include <vector>

#include "flat_param_collectives.h"
#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "runtime/fsdp_state.h"

namespace fsdp {

FullyShardedModule::UnshardHandle FullyShardedModule::unshard() {
  FsdpState& state = *state_;
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  state.rethrow_pending_error();
  state.settle_failed_backward();
  InternalOpGuard internal;
  for (const Unit& unit : state.units()) state.scheduler().unshard_async(unit.index());
  return UnshardHandle(this);
}

void FullyShardedModule::UnshardHandle::wait() {
  if (!module_) return;
  FsdpState& state = *module_->state_;
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  for (Unit& unit : state.units()) unit.wait_for_unshard("all-gather (explicit unshard)");
  module_ = nullptr;
}

FullyShardedModule::UnshardHandle::UnshardHandle(UnshardHandle&& other) noexcept : module_(other.module_) {
  other.module_ = nullptr;
}

FullyShardedModule::UnshardHandle::~UnshardHandle() {
  // An abandoned handle still lets its gathers land (they write into memory FSDP owns).
  try {
    wait();
  } catch (...) {
  }
}

void FullyShardedModule::reshard() {
  std::lock_guard<std::recursive_mutex> lock(state_->mutex());
  InternalOpGuard internal;
  state_->scheduler().reshard_all();
}

namespace {

// A parameter whose data was replaced inside the guard (torch::load, set_data) has its new values
// copied into `full`, so writeback keeps them; one of another shape is an error.
void adopt_replaced_data(FsdpState& state, const ParamSlot& slot, const at::Tensor& full) {
  if (slot.numel == 0) return;
  const at::Tensor now = slot.param.variable_data();
  const at::Tensor view = full.narrow(0, slot.offset, slot.numel);
  if (now.defined() && now.data_ptr() == view.data_ptr() && now.numel() == slot.numel) return;
  if (!now.defined() || now.sizes() != at::IntArrayRef(slot.shape)) {
    state.set_pending_error(
        detail::compose("libfsdp: summon_full_params(/*writeback=*/true): parameter '", slot.name,
                        "' was replaced inside the guard by ",
                        now.defined() ? detail::compose("a tensor of shape ", now.sizes()) : "an undefined tensor",
                        ", but its shape is ", at::IntArrayRef(slot.shape),
                        "; nothing of it was written back. Load a checkpoint of this model (same parameter shapes)"),
        /*print_now=*/true);
    return;
  }
  view.copy_(now.reshape({-1}));
}

}  // namespace

struct FullyShardedModule::FullParamsGuard::Saved {
  struct FlatValues {
    FlatParam* flat_param;
    at::Tensor full;                 // the whole flat values the parameters are views of now
    std::vector<at::Tensor> before;  // each slot's parameter data before the guard
    std::vector<at::Tensor> grads;   // with_grads: each slot's parameter .grad before the guard
  };
  std::vector<FlatValues> flats;
};

FullyShardedModule::FullParamsGuard FullyShardedModule::summon_full_params(bool writeback) {
  return FullParamsGuard(this, FullParamsOptions().writeback(writeback));
}

FullyShardedModule::FullParamsGuard FullyShardedModule::summon_full_params(const FullParamsOptions& options) {
  return FullParamsGuard(this, options);
}

FullyShardedModule::FullParamsGuard::FullParamsGuard(FullyShardedModule* module, const FullParamsOptions& options)
    : module_(module), options_(options), saved_(std::make_unique<Saved>()) {
  FsdpState& state = *module_->state_;
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  state.rethrow_pending_error();
  state.settle_failed_backward();
  FSDP_CHECK(!Scheduler::in_backward(), "summon_full_params: called during backward; call it between training steps");
  FSDP_CHECK(!options_.with_grads() || !state.reducer().holds_unreduced(),
             GradientReducer::unreduced_error("summon_full_params(with_grads)"));
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  state.scheduler().reshard_all();  // nothing stale stays gathered behind the guard
  for (auto& fp : state.flat_params()) {
    Saved::FlatValues v{fp.get(), gather_full_values(*fp).clone(), {}, {}};
    for (auto& s : fp->slots()) {
      v.before.push_back(s.param.variable_data());
      // The parameter (its identity kept) now shows its whole value, in a storage FSDP does not
      // watch, so operators on it inside the guard trigger no gathers.
      s.param.set_data(v.full.narrow(0, s.offset, s.numel).view(s.shape));
    }
    if (options_.with_grads()) {
      auto [grad, present] = gather_full_gradient(*fp);
      auto& slots = fp->slots();
      for (size_t i = 0; i < slots.size(); ++i) {
        v.grads.push_back(slots[i].param.grad());
        slots[i].param.mutable_grad() =
            present[i] ? grad.narrow(0, slots[i].offset, slots[i].numel).view(slots[i].shape) : at::Tensor();
      }
    }
    saved_->flats.push_back(std::move(v));
  }
  state.enter_full_params();
}

FullyShardedModule::FullParamsGuard::FullParamsGuard(FullParamsGuard&& other) noexcept
    : module_(other.module_), options_(other.options_), saved_(std::move(other.saved_)) {
  other.module_ = nullptr;
}

FullyShardedModule::FullParamsGuard::~FullParamsGuard() {
  if (!module_ || !saved_) return;
  FsdpState& state = *module_->state_;
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  for (auto& v : saved_->flats) {
    auto& slots = v.flat_param->slots();
    if (options_.writeback()) {
      for (const ParamSlot& slot : slots) adopt_replaced_data(state, slot, v.full);
      v.flat_param->copy_full_into_shard(v.full);  // this rank's part only: not collective
    }
    for (size_t i = 0; i < slots.size(); ++i) {
      if (!v.grads.empty()) slots[i].param.mutable_grad() = v.grads[i];
      slots[i].param.set_data(v.before[i]);
      // set_data with another dtype (mixed precision) drops the parameter's AccumulateGrad node,
      // which carries FSDP's gradient hooks: give it back the one the slot keeps.
      if (slots[i].grad_accumulator)
        torch::autograd::impl::set_grad_accumulator(slots[i].param, slots[i].grad_accumulator);
    }
  }
  state.scheduler().forget_last_used();
  state.exit_full_params();
}

}  // namespace fsdp
