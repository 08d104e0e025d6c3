#include "fsdp/whole_param_optimizer.h"

#include "fsdp/check.h"
#include "state_access.h"

namespace fsdp {
namespace {

std::vector<torch::optim::OptimizerParamGroup> every_trainable_piece(FullyShardedModule& module,
                                                                     std::vector<torch::optim::OptimizerParamGroup> g) {
  if (!g.empty()) return g;
  std::vector<at::Tensor> pieces;
  for (const auto& p : module.shard_pieces())
    if (p.piece.requires_grad()) pieces.push_back(p.piece);
  g.emplace_back(pieces);
  return g;
}

}  // namespace

WholeParamOptimizer::WholeParamOptimizer(FullyShardedModule& module,
                                         std::vector<torch::optim::OptimizerParamGroup> groups,
                                         std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(every_trainable_piece(module, std::move(groups)), std::move(defaults)),
      reduction_(module),
      module_(&module) {
  for (size_t g = 0; g < param_groups_.size(); ++g)
    for (const auto& t : param_groups_[g].params()) group_by_piece_[t.unsafeGetTensorImpl()] = static_cast<int>(g);
  module.check_optimizer(*this);
}

torch::Tensor WholeParamOptimizer::begin_step(const char* what, const LossClosure& closure) const {
  FsdpState& state = detail::StateAccess::of(*module_);
  state.rethrow_pending_error();
  FSDP_CHECK(!state.reducer().stepper().on(), what,
             ": its step needs every parameter's whole gradient, but the module steps its optimizer in backward "
             "(set_step_in_backward), one unit at a time. Turn that off (set_step_in_backward(nullptr)) and call "
             "step() after backward");
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
