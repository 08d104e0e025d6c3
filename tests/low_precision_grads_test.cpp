// MixedPrecision::keep_low_precision_grads: the shard gradients the optimizer sees stay in the
// reduce dtype (half the gradient bytes for bf16), and training equals a local reference that keeps
// bf16 gradients, under every strategy at worlds 1-4, with clipping, within bf16 rounding (the reduction sums
// bf16 values in its own order).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "fsdp/grad_scaler.h"
#include "harness.h"
#include "mixed_precision_reference.h"

namespace fsdp_test {
namespace {

// Clips as FullyShardedModule::clip_grad_norm_ does: the total 2-norm in double, each gradient
// scaled in its own dtype. Returns the total norm.
double clip_in_double(const std::vector<at::Tensor>& params, double max_norm) {
  double sum = 0;
  for (const auto& p : params)
    if (p.grad().defined()) sum += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  const double total = std::sqrt(sum), coef = max_norm / (total + 1e-6);
  if (coef < 1)
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().mul_(coef);
  return total;
}

// args: strategy. bf16 compute and reduction, gradients kept in bf16; SGD after clipping.
FSDP_WORKER(low_precision_grads_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  MixedPrecisionTriplet models;
  TinyTransformer ref = models.master, model = models.model;
  LocalMixedPrecision<TinyTransformer> local(ref, models.compute, at::kBFloat16, at::kBFloat16);
  local.keep_low_precision_grads = true;
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>())
                     .mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).keep_low_precision_grads(true));
  if (strategy == "HYBRID_SHARD") options.sharding_factor(ctx.world % 2 ? ctx.world : 2);
  auto sharded = fsdp::fully_shard(model, pg, options);
  // SGD: its step is linear in the gradient, so bf16 rounding differences stay that small (Adam's
  // normalization would turn a rounding difference in a near-zero gradient into a full step).
  torch::optim::SGD ref_opt(local.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)),
      opt(sharded->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const int rows = 2;
  for (int step = 0; step < 3; ++step) {
    const auto x = at::randint(0, 32, {rows * ctx.world, 8}, at::detail::createCPUGenerator(60 + step));
    ref_opt.zero_grad();
    local.backward(x, ctx.world, rows, 1.0, cast_lm_loss);
    const double ref_norm = clip_in_double(local.parameters(), 0.5);
    ref_opt.step();
    opt.zero_grad();
    cast_lm_loss(model, x.narrow(0, ctx.rank * rows, rows)).backward();
    int64_t grad_bytes = 0, grad_numel = 0;
    for (const auto& p : sharded->parameters()) {
      if (!p.grad().defined()) continue;
      WORKER_CHECK(p.scalar_type() == at::kFloat && p.grad().scalar_type() == at::kBFloat16, "a piece is ",
                   p.scalar_type(), " with a ", p.grad().scalar_type(), " gradient");
      grad_bytes += p.grad().nbytes();
      grad_numel += p.grad().numel();
    }
    WORKER_CHECK(grad_bytes == 2 * grad_numel, "gradient bytes ", grad_bytes, " for ", grad_numel, " elements");
    const double norm = sharded->clip_grad_norm_(0.5);
    WORKER_CHECK(std::abs(norm - ref_norm) <= 1e-2 * ref_norm, "step ", step, " norm ", norm, " vs local ", ref_norm);
    opt.step();
  }
  expect_same_parameters(*ref, *sharded, 1.5e-2, strategy);  // a few bf16 roundings (2^-8 each)
  if (ctx.rank == 0) std::cout << strategy << " world " << ctx.world << " ok" << std::endl;
}

// args: strategy. The same training with and without a GradScaler (its scale, a power of two,
// scales every bf16 value exactly): the parameters must come out bit for bit equal.
FSDP_WORKER(low_precision_grads_scaler_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  MixedPrecisionTriplet models;
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>())
                     .mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).keep_low_precision_grads(true));
  if (strategy == "HYBRID_SHARD") options.sharding_factor(ctx.world % 2 ? ctx.world : 2);
  auto plain = fsdp::fully_shard(models.master, pg, options), scaled = fsdp::fully_shard(models.model, pg, options);
  torch::optim::SGD plain_opt(plain->parameters(), 0.1), scaled_opt(scaled->parameters(), 0.1);
  fsdp::GradScaler scaler(*scaled);
  const int rows = 2;
  for (int step = 0; step < 3; ++step) {
    const auto x = at::randint(0, 32, {rows * ctx.world, 8}, at::detail::createCPUGenerator(70 + step));
    const at::Tensor mine = x.narrow(0, ctx.rank * rows, rows);
    plain_opt.zero_grad();
    cast_lm_loss(models.master, mine).backward();
    plain_opt.step();
    scaled_opt.zero_grad();
    scaler.scale(cast_lm_loss(models.model, mine)).backward();
    WORKER_CHECK(scaler.step(scaled_opt), "step ", step, " skipped");
    scaler.update();
  }
  const auto a = plain->full_state_dict(), b = scaled->full_state_dict();
  for (const auto& [name, t] : a) WORKER_CHECK(torch::equal(t, b.at(name)), strategy, ": ", name, " differs");
}

TEST(LowPrecisionGrads, AGradScalerUnscalesThemExactly) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
    auto r = launch("low_precision_grads_scaler_worker", 2, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

TEST(LowPrecisionGrads, Bf16GradientsForTheOptimizerTrainLikeTheLocalReference) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"})
    for (int world = 1; world <= 4; ++world) {
      auto r = launch("low_precision_grads_worker", world, {strategy});
      ASSERT_TRUE(r.all_ok()) << strategy << " world " << world << "\n" << r.report();
    }
}

}  // namespace
}  // namespace fsdp_test
