#include "fsdp/optim.h"

#include <torch/version.h>

#include <map>
#include <tuple>

namespace fsdp {

torch::Tensor FusedAdamW::step(LossClosure closure) {
#if TORCH_VERSION_MAJOR >= 2
  bool fusable = true;
  for (const auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    if (o.amsgrad()) fusable = false;
    for (const auto& p : group.params())
      if (p.grad().defined() && (!p.is_cuda() || p.grad().is_sparse() || !p.grad().is_cuda())) fusable = false;
  }
  last_step_fused_ = fusable;
  if (!fusable) return torch::optim::AdamW::step(std::move(closure));

  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    // The kernel takes lists of one device and dtype.
    struct Lists {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    };
    std::map<std::tuple<int, int>, Lists> buckets;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      void* key = p.unsafeGetTensorImpl();
      auto it = state_.find(key);
      if (it == state_.end()) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        it = state_.emplace(key, std::move(fresh)).first;
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      DeviceStep& d = device_steps_[key];
      if (!d.count.defined() || d.synced != s.step()) {  // first step, or the state was loaded
        d.count = torch::full({}, static_cast<double>(s.step()), p.options().dtype(at::kFloat));
      }
      s.step(s.step() + 1);
      d.synced = s.step();
      Lists& l = buckets[{static_cast<int>(p.device().index()), static_cast<int>(p.scalar_type())}];
      l.params.push_back(p);
      l.grads.push_back(p.grad());
      l.exp_avgs.push_back(s.exp_avg());
      l.exp_avg_sqs.push_back(s.exp_avg_sq());
      l.steps.push_back(d.count);
    }
    for (auto& [where, l] : buckets) {
      at::_foreach_add_(l.steps, 1);
      at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, /*max_exp_avg_sqs=*/{}, l.steps, o.lr(),
                        std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                        /*amsgrad=*/false, /*maximize=*/false);
    }
  }
  return loss;
#else
  last_step_fused_ = false;
  return torch::optim::AdamW::step(std::move(closure));
#endif
}

}  // namespace fsdp
