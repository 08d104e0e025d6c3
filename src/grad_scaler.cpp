#include "fsdp/grad_scaler.h"

#include <cmath>

#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "state_access.h"

namespace fsdp {

GradScaler::GradScaler(FullyShardedModule& module, GradScalerOptions options)
    : module_(module), options_(options), scale_(options.init_scale()) {
  FSDP_CHECK(options_.init_scale() > 0 && std::isfinite(options_.init_scale()),
             "GradScaler: init_scale must be positive and finite, got ", options_.init_scale());
  FSDP_CHECK(options_.growth_factor() > 1, "GradScaler: growth_factor must be above 1, got ", options_.growth_factor());
  FSDP_CHECK(options_.backoff_factor() > 0 && options_.backoff_factor() < 1,
             "GradScaler: backoff_factor must be in (0, 1), got ", options_.backoff_factor());
  FSDP_CHECK(options_.growth_interval() > 0, "GradScaler: growth_interval must be positive, got ",
             options_.growth_interval());
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled()) return loss;
  FSDP_CHECK(!detail::StateAccess::of(module_).reducer().stepper().on(),
             "GradScaler: the module steps its optimizer in backward (set_step_in_backward), which would step "
             "with scaled gradients before any could be unscaled or checked for inf/NaN. Turn one of them off");
  return loss * scale_;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  FSDP_CHECK(!unscaled_, "GradScaler::unscale_ was already called since the last update(); call it once per step");
  module_.check_optimizer(optimizer);
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  // Unscaled in double precision of the scale's inverse, as the peers do (one multiply per element).
  const double inv = 1.0 / scale_;
  bool local_inf = false;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      at::Tensor& g = p.mutable_grad();
      if (!g.defined()) continue;
      g.mul_(inv);
      if (!local_inf && !at::isfinite(g).all().item<bool>()) local_inf = true;
    }
  // Every rank learns whether any rank found one (each holds only its shards' gradients).
  const CommunicatorPtr& world = detail::StateAccess::of(module_).groups().world_comm;
  at::Tensor flag =
      at::full({1}, local_inf ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat).device(world->device()));
  world->all_reduce(flag, CollectiveOptions::labeled("GradScaler: found-inf all-reduce"))->wait();
  found_inf_ = flag.cpu().item<float>() > 0;
  unscaled_ = true;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  FSDP_CHECK(!stepped_, "GradScaler::step was already called since the last update(); call update() after each step");
  if (!unscaled_) unscale_(optimizer);
  stepped_ = true;
  if (found_inf_) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled()) return;
  FSDP_CHECK(unscaled_, "GradScaler::update: no step since the last update(); call step() (or unscale_) first");
  if (found_inf_) {
    scale_ *= options_.backoff_factor();
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    growth_tracker_ = 0;
  }
  unscaled_ = stepped_ = found_inf_ = false;
}

void GradScaler::load(double scale, int64_t growth_tracker) {
  FSDP_CHECK(scale > 0 && std::isfinite(scale), "GradScaler::load: scale must be positive and finite, got ", scale);
  scale_ = scale;
  growth_tracker_ = growth_tracker;
}

}  // namespace fsdp
