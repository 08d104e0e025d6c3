// Start-up failures: options that differ across ranks, and a MASTER_ADDR that does not resolve,
// fail every rank within seconds (not at the timeout), naming the cause.
#include <gtest/gtest.h>

#include <chrono>

#include "faults/faults.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: which option rank 1 sets differently.
FSDP_WORKER(different_options_worker) {
  const std::string what = ctx.args.at(0);
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto o = fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
  if (ctx.rank == 1) {
    if (what == "strategy") o.sharding_strategy(fsdp::ShardingStrategy::kHybridShard).sharding_factor(2);
    if (what == "backward_prefetch") o.backward_prefetch(fsdp::BackwardPrefetch::kBackwardPost);
    if (what == "sync_module_states") o.sync_module_states(false);
  }
  fsdp::fully_shard(model, pg, o);
}

class DifferentOptionsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DifferentOptionsTest, FailEveryRankNamingTheOption) {
  const std::string what = GetParam();
  for (const std::string transport : {"shm", "tcp"}) {
    const auto t0 = std::chrono::steady_clock::now();
    RunningRanks running = start("different_options_worker", 4, {what},
                                 {"FSDP_TRANSPORT=" + transport, "FSDP_TIMEOUT_S=120"});
    const std::vector<int> pids = running.pids;
    auto r = wait_for(running, 240);
    const double seconds = seconds_since(t0);
    ASSERT_FALSE(r.timed_out) << r.report();
    for (int rank = 0; rank < 4; ++rank) {
      EXPECT_EQ(r.ranks[rank].exit_code, 1) << transport << " rank " << rank << "\n" << r.report();
      EXPECT_TRUE(contains(r.ranks[rank].output, "passed different Options to fully_shard()")) << r.report();
      EXPECT_TRUE(contains(r.ranks[rank].output, what == "strategy" ? "sharding_strategy" : what)) << r.report();
    }
    EXPECT_LT(seconds, 45) << transport << "\n" << r.report();  // the timeout is 120 s
    EXPECT_TRUE(leftover_segments(pids).empty()) << leftover_segments(pids).front();
  }
}

INSTANTIATE_TEST_SUITE_P(Options, DifferentOptionsTest,
                         ::testing::Values("strategy", "backward_prefetch", "sync_module_states"),
                         [](const auto& info) { return info.param; });

FSDP_WORKER(unresolvable_master_worker) { auto pg = fsdp::ProcessGroup::from_env(); }

TEST(Startup, AMasterAddrThatDoesNotResolveFailsAtOnce) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = launch("unresolvable_master_worker", 2, {}, 120,
                  {"MASTER_ADDR=no-such-host.invalid", "FSDP_TIMEOUT_S=120"});
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks) {
    EXPECT_EQ(rank.exit_code, 1) << r.report();
    EXPECT_TRUE(contains(rank.output, "MASTER_ADDR 'no-such-host.invalid' does not resolve")) << r.report();
  }
  EXPECT_LT(seconds_since(t0), 45) << r.report();  // the timeout is 120 s
}

}  // namespace
}  // namespace fsdp_test
