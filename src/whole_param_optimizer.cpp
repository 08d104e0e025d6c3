#include "fsdp/whole_param_optimizer.h"

#include <string>
#include <typeinfo>
#include <unordered_set>

#include "fsdp/check.h"
#include "state_access.h"

namespace fsdp {
namespace {

std::vector<torch::optim::OptimizerParamGroup> every_piece(FullyShardedModule& module,
                                                           std::vector<torch::optim::OptimizerParamGroup> g) {
  if (!g.empty()) return g;
  std::vector<at::Tensor> pieces;
  for (const auto& p : module.shard_pieces()) pieces.push_back(p.piece);
  g.emplace_back(pieces);
  return g;
}

}  // namespace

WholeParamOptimizer::WholeParamOptimizer(FullyShardedModule& module,
                                         std::vector<torch::optim::OptimizerParamGroup> groups,
                                         std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(every_piece(module, std::move(groups)), std::move(defaults)),
      reduction_(module),
      module_(&module) {
  module.check_optimizer(*this);
  std::unordered_set<const c10::TensorImpl*> pieces;
  for (const auto& p : module.shard_pieces()) pieces.insert(p.piece.unsafeGetTensorImpl());
  const std::string expected = c10::demangle(typeid(*defaults_).name());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& options = param_groups_[g].options();
    FSDP_CHECK(typeid(options) == typeid(*defaults_), "parameter group ", g, " has options of type ",
               c10::demangle(typeid(options).name()), ", not this optimizer's ", expected, "; give it ", expected,
               ", or none (the defaults)");
    for (const auto& t : param_groups_[g].params()) {
      FSDP_CHECK(pieces.count(t.unsafeGetTensorImpl()) != 0, "parameter group ", g, " holds a tensor (shape ",
                 t.sizes(), ") that is not a shard piece of this module; build the groups from its shard_pieces()");
      const auto [it, first] = group_by_piece_.emplace(t.unsafeGetTensorImpl(), static_cast<int>(g));
      FSDP_CHECK(first, "a shard piece (shape ", t.sizes(), ") is in parameter groups ", it->second, " and ", g,
                 "; put each piece in one group");
    }
  }
}

torch::Tensor WholeParamOptimizer::begin_step(const char* what, const LossClosure& closure) {
  FsdpState& state = detail::StateAccess::of(*module_);
  state.rethrow_pending_error();
  FSDP_CHECK(!state.reducer().stepper().on(), what,
             ": its step needs every parameter's whole gradient, but the module steps its optimizer in backward "
             "(set_step_in_backward), one unit at a time. Turn that off (set_step_in_backward(nullptr)) and call "
             "step() after backward");
  if (reduction_.update_trainable()) trainable_changed();
  if (!closure) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

int WholeParamOptimizer::group_of(const WholeParam& p) const {
  if (!p.piece.defined()) return -1;
  auto it = group_by_piece_.find(p.piece.unsafeGetTensorImpl());
  return it == group_by_piece_.end() ? -1 : it->second;
}

}  // namespace fsdp
