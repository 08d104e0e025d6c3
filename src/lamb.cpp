#include "fsdp/lamb.h"

#include <cmath>

#include "optimizer_state_key.h"

namespace fsdp {

Lamb::Lamb(FullyShardedModule& module, std::vector<torch::optim::OptimizerParamGroup> groups,
           const LambOptions& defaults)
    : WholeParamOptimizer(module, std::move(groups), std::make_unique<LambOptions>(defaults)) {}

torch::Tensor Lamb::step(LossClosure closure) {
  torch::Tensor loss = begin_step("Lamb::step", closure);
  at::NoGradGuard no_grad;
  struct Pending {
    at::Tensor piece, update;
    double lr = 0;
    int weight_norm = -1, update_norm = -1;
  };
  std::vector<Pending> pending;
  // Every rank queues the two squared norms of every trainable parameter, in the same order; a
  // rank without a gradient of it adds zeros.
  for (const WholeParam& p : reduction_.params()) {
    if (!p.trainable) continue;
    Pending w;
    at::Tensor wsq = at::zeros({1}, at::kDouble), usq = at::zeros({1}, at::kDouble);
    if (steps(p)) {
      const auto& o = static_cast<const LambOptions&>(param_groups_[group_of(p)].options());
      const auto key = detail::optimizer_state_key(p.piece);
      auto it = state_.find(key);
      if (it == state_.end()) {
        auto fresh = std::make_unique<LambParamState>();
        fresh->exp_avg(at::zeros_like(p.piece, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(p.piece, at::MemoryFormat::Preserve));
        it = state_.emplace(key, std::move(fresh)).first;
      }
      auto& s = static_cast<LambParamState&>(*it->second);
      s.step(s.step() + 1);
      const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
      const at::Tensor& g = p.piece.grad();
      s.exp_avg().mul_(b1).add_(g, 1 - b1);
      s.exp_avg_sq().mul_(b2).addcmul_(g, g, 1 - b2);
      const double bc1 = 1 - std::pow(b1, static_cast<double>(s.step()));
      const double bc2 = 1 - std::pow(b2, static_cast<double>(s.step()));
      w.update = (s.exp_avg() / bc1) / ((s.exp_avg_sq() / bc2).sqrt() + o.eps());
      if (o.weight_decay() != 0) w.update.add_(p.piece, o.weight_decay());
      w.piece = p.piece;
      w.lr = o.lr();
      wsq = p.piece.to(at::kDouble).square().sum().reshape({1});
      usq = w.update.to(at::kDouble).square().sum().reshape({1});
    }
    w.weight_norm = reduction_.add(wsq, Combine::kSum);
    w.update_norm = reduction_.add(usq, Combine::kSum);
    pending.push_back(std::move(w));
  }
  reduction_.run();
  for (const Pending& w : pending) {
    if (!w.piece.defined()) continue;
    const double wn = std::sqrt(reduction_.result(w.weight_norm).item<double>());
    const double un = std::sqrt(reduction_.result(w.update_norm).item<double>());
    const double trust = wn > 0 && un > 0 ? wn / un : 1.0;
    w.piece.add_(w.update, -w.lr * trust);
  }
  return loss;
}

}  // namespace fsdp
