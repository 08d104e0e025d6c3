#include "runtime/backward_stepper.h"

#include <unordered_set>
#include <utility>

#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

void BackwardStepper::set(torch::optim::Optimizer* optimizer,
                          const std::vector<std::unique_ptr<FlatParam>>& flat_params) {
  if (optimizer) {
    FSDP_CHECK(dynamic_cast<torch::optim::LBFGS*>(optimizer) == nullptr,
               "set_step_in_backward: LBFGS steps with a closure over the whole model and cannot step one unit "
               "at a time; call its step() after backward instead");
    std::unordered_set<const c10::TensorImpl*> held;
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params()) held.insert(p.unsafeGetTensorImpl());
    for (const auto& fp : flat_params)
      for (const auto& s : fp->slots())
        FSDP_CHECK(!s.piece.defined() || !s.piece.requires_grad() || held.count(s.piece.unsafeGetTensorImpl()),
                   "set_step_in_backward: the optimizer does not hold the shard piece of parameter '", s.name,
                   "', so it would never be stepped. Build the optimizer over FullyShardedModule::parameters()");
  }
  optimizer_ = optimizer;
  stepped_.assign(flat_params.size(), 0);
}

void BackwardStepper::step(FlatParam& fp, const std::string& unit_name) {
  if (!optimizer_ || stepped_.at(fp.id())) return;
  std::unordered_set<const c10::TensorImpl*> mine;
  for (const auto& s : fp.slots())
    if (s.piece.defined() && s.piece.grad().defined()) mine.insert(s.piece.unsafeGetTensorImpl());
  if (mine.empty()) return;  // no gradient reached this rank's pieces: nothing to step, as in local training
  // The optimizer steps only parameters that have a gradient: every other one's is set aside for
  // the call (usually none: stepped pieces have theirs dropped, unreduced ones have none yet).
  std::vector<std::pair<at::Tensor, at::Tensor>> aside;
  for (auto& group : optimizer_->param_groups())
    for (auto& p : group.params())
      if (p.grad().defined() && !mine.count(p.unsafeGetTensorImpl())) {
        aside.emplace_back(p, p.grad());
        p.mutable_grad().reset();
      }
  auto restore = [&] {
    for (auto& [p, g] : aside) p.mutable_grad() = g;
  };
  try {
    InternalOpGuard internal;
    optimizer_->step();
  } catch (const std::exception& e) {
    restore();
    FSDP_CHECK(false, "the optimizer step in backward of unit '", unit_name.empty() ? "<root>" : unit_name,
               "' failed: ", e.what());
  }
  restore();
  for (auto& s : fp.slots())
    if (s.piece.defined()) s.piece.mutable_grad().reset();
  stepped_[fp.id()] = 1;
}

bool BackwardStepper::stepped_any() const {
  for (char s : stepped_)
    if (s) return true;
  return false;
}

void BackwardStepper::end_backward() { std::fill(stepped_.begin(), stepped_.end(), 0); }

}  // namespace fsdp
