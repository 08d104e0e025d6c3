// Bad input and dead ranks: a clear error on every rank, never a hang.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

FSDP_WORKER(different_models_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, ctx.rank == 1 ? 11 : 10, 3, 2);  // rank 1 built a different hidden size
  fsdp::fully_shard(model, pg);
}

TEST(BadInput, RanksWithDifferentModelsFailWithTheFirstDifference) {
  auto r = launch("different_models_worker", 2, {}, 120);
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks) {
    EXPECT_NE(rank.exit_code, 0);
    EXPECT_TRUE(contains(rank.output, "built different models")) << rank.output;
    EXPECT_TRUE(contains(rank.output, "layers.0.weight")) << rank.output;
  }
}

FSDP_WORKER(fully_shard_twice_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto first = fsdp::fully_shard(model, pg);
  auto second = fsdp::fully_shard(model, pg);
}

TEST(BadInput, FullyShardTwiceOnOneModelIsAClearErrorOnEveryRank) {
  auto r = launch("fully_shard_twice_worker", 2, {}, 120);
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks) {
    EXPECT_EQ(rank.exit_code, 1) << rank.output;  // an exception, not a signal
    EXPECT_TRUE(contains(rank.output, "is already sharded by an earlier fully_shard()")) << rank.output;
  }
}

FSDP_WORKER(hybrid_factor_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  // Every rank finishes connecting before any of them fails: rank 0 hosts the store, and a rank
  // still connecting when it exits would report the lost connection instead of the check (seen
  // once on a loaded machine).
  pg->world()->barrier();
  MLP model(6, 10, 3, 2);
  fsdp::fully_shard(model, pg,
                    fsdp::Options().sharding_strategy(fsdp::ShardingStrategy::kHybridShard).sharding_factor(2));
}

TEST(BadInput, HybridFactorMustDivideWorldSize) {
  auto r = launch("hybrid_factor_worker", 3, {}, 120);
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks)
    EXPECT_TRUE(contains(rank.output, "world size 3 is not divisible by the sharding factor 2")) << rank.output;
}

FSDP_WORKER(shared_param_error_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  TinyTransformer model(32, 16, 2, 1, 8);
  fsdp::fully_shard(model, pg,
                    fsdp::Options()
                        .wrap_modules({model->tok.ptr(), model->head.ptr()})
                        .shared_parameters(fsdp::SharedParameterPolicy::kError));
}

TEST(BadInput, SharedParameterAcrossUnitsRefusedWhenAskedTo) {
  auto r = launch("shared_param_error_worker", 1, {}, 120);
  EXPECT_TRUE(contains(r.ranks[0].output, "'tok.weight', 'head.weight' is shared by modules of different FSDP units"))
      << r.report();
}

FSDP_WORKER(wrong_optimizer_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD wrong(model->parameters(), 0.1);
  try {
    sharded->check_optimizer(wrong);
    throw std::runtime_error("check_optimizer accepted the original parameters");
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(contains(e.what(), "Build the optimizer over FullyShardedModule::parameters()"), e.what());
  }
  // An in-place update of an original parameter is refused at the next backward.
  {
    torch::NoGradGuard no_grad;
    model->parameters()[0].mul_(0.5);
  }
  try {
    model->forward(torch::randn({2, 6})).sum().backward();
    throw std::runtime_error("the in-place update of an original parameter was not reported");
  } catch (const std::exception& e) {
    WORKER_CHECK(contains(e.what(), "in-place operation aten::mul_ on parameter 'layers.0.weight'"), e.what());
  }
  std::cout << "wrong optimizer detected" << std::endl;
}

TEST(BadInput, OptimizerOverOriginalParametersIsDetected) {
  auto r = launch("wrong_optimizer_worker", 2, {}, 120);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

// A rank that dies mid-training makes the others fail fast (TCP: the connection closes; shared
// memory: its liveness lock is released by the kernel), not hang.
FSDP_WORKER(dead_rank_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  for (int step = 0; step < 50; ++step) {
    if (step == 2 && ctx.rank == 1) _exit(3);
    opt.zero_grad();
    model->forward(torch::randn({2, 6})).sum().backward();
    opt.step();
  }
}

class DeadRankTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DeadRankTest, MakesTheOthersFailFast) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = launch("dead_rank_worker", 3, {}, 60, {"FSDP_TRANSPORT=" + GetParam()});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r.timed_out) << r.report();
  EXPECT_EQ(r.ranks[1].exit_code, 3);
  EXPECT_NE(r.ranks[0].exit_code, 0) << r.report();
  EXPECT_NE(r.ranks[2].exit_code, 0) << r.report();
  EXPECT_LT(seconds, 30) << r.report();
}

INSTANTIATE_TEST_SUITE_P(BadInput, DeadRankTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace fsdp_test
