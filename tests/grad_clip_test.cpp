// Gradient clipping across shards (FullyShardedModule::clip_grad_norm_): equal to local clipping of
// the same model on the same batches, for every strategy and norm type.
#include <gtest/gtest.h>

#include <limits>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: strategy, norm type ("inf" or a number)
FSDP_WORKER(clip_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  const double p = ctx.args.at(1) == "inf" ? std::numeric_limits<double>::infinity() : std::stod(ctx.args.at(1));
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  torch::optim::SGD ref_opt(unique_parameters(*ref), 0.5), opt(sharded->parameters(), 0.5);
  const int rows = 2;
  for (int step = 0; step < 3; ++step) {
    const auto x = at::randint(0, 32, {rows * ctx.world, 8}, at::detail::createCPUGenerator(50 + step));
    ref_opt.zero_grad();
    loss_of(ref, x).backward();
    // max_norm below the norm for the first steps, above it later: both branches run.
    const double max_norm = step < 2 ? 0.05 : 1e6;
    const double ref_norm = torch::nn::utils::clip_grad_norm_(unique_parameters(*ref), max_norm, p);
    ref_opt.step();
    opt.zero_grad();
    loss_of(model, x.narrow(0, ctx.rank * rows, rows)).backward();
    const double norm = sharded->clip_grad_norm_(max_norm, p);
    opt.step();
    WORKER_CHECK(std::abs(norm - ref_norm) <= 1e-12 * ref_norm, "norm ", norm, " vs local ", ref_norm, " at step ",
                 step);
    if (step == 0) WORKER_CHECK(ref_norm > 0.05, "the test must clip: local norm ", ref_norm);
  }
  expect_same_parameters(*ref, *sharded, 1e-12, "clipped");
  if (ctx.rank == 0) std::cout << strategy << " clip ok" << std::endl;
}

TEST(GradClip, EqualsLocalClippingForEveryStrategyAndNorm) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"})
    for (const char* p : {"2", "1.5", "inf"}) {
      auto r = launch("clip_worker", strategy == std::string("HYBRID_SHARD") ? 4 : 3, {strategy, p});
      ASSERT_TRUE(r.all_ok()) << strategy << " p=" << p << "\n" << r.report();
    }
}

}  // namespace
}  // namespace fsdp_test
