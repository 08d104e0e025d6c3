// Ranks out of step: a unit skipped on one rank, an extra micro-batch on one rank, a collective
// API called by one rank alone, a parameter read by one rank alone. Every rank must fail (none may exit 0), fast, naming the two
// collectives, on both CPU transports (Note [Collective fingerprints], Note [End-of-job agreement]).
#include <gtest/gtest.h>

#include <chrono>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: strategy, case. Three steps of SGD on a Skippy whose Linear layers are units; the case
// makes one rank leave the common schedule in step 1 ("accumulate", "accumulate_no_sync": every
// rank runs two micro-batches in step 1, the first without gradient sync in the second case).
FSDP_WORKER(desync_worker) {
  const std::string strategy = ctx.args.at(0), what = ctx.args.at(1);
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(1);
  Skippy model;
  auto sharded = fsdp::fully_shard(model, pg,
                                   fsdp::Options()
                                       .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                                       .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    const bool odd_one = step == 1 && ctx.rank == 1;
    const bool accumulate = step == 1 && (what == "accumulate" || what == "accumulate_no_sync");
    const int micro_batches = (what == "extra_micro_batch" && odd_one) || accumulate ? 2 : 1;
    for (int m = 0; m < micro_batches; ++m) {
      sharded->set_requires_gradient_sync(!(what == "accumulate_no_sync" && m + 1 < micro_batches));
      at::Tensor x = at::randn({4, 8}, at::detail::createCPUGenerator(10 * step + m + ctx.rank));
      model->forward(x, what == "skip_unit" && odd_one).pow(2).mean().backward();
    }
    if (what == "state_dict_alone" && odd_one) sharded->full_state_dict();
    // A parameter read outside forward and backward gathers it: on one rank alone, or on every rank.
    if ((what == "read_alone" && odd_one) || (what == "read_everywhere" && step == 1))
      (void)model->parameters().front().norm().item<double>();
    opt.step();
    zero_grad_in_place(opt);
  }
}

struct Case {
  std::string strategy, what, transport;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.strategy << " " << c.what << " " << c.transport; }

class DesyncTest : public ::testing::TestWithParam<Case> {};

TEST_P(DesyncTest, EveryRankFailsFastNamingBothCollectives) {
  const Case c = GetParam();
  const auto t0 = std::chrono::steady_clock::now();
  RunningRanks running =
      start("desync_worker", 3, {c.strategy, c.what}, {"FSDP_TRANSPORT=" + c.transport, "FSDP_TIMEOUT_S=120"});
  const std::vector<int> pids = running.pids;
  auto r = wait_for(running, 240);
  const double seconds = seconds_since(t0);
  ASSERT_FALSE(r.timed_out) << r.report();
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_NE(r.ranks[rank].exit_code, 0) << "rank " << rank << " finished out of step\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[rank].output, "ranks diverged: member")) << r.report();
    // The shifted reduction adds to a held backward's gradients on one rank only.
    if (c.what == "extra_micro_batch") {
      EXPECT_TRUE(contains(r.ranks[rank].output, "backward held")) << r.report();
    }
    if (c.what == "read_alone") {
      EXPECT_TRUE(contains(r.ranks[rank].output, "reading a sharded parameter outside forward")) << r.report();
    }
  }
  EXPECT_LT(seconds, 45) << r.report();  // the timeout is 120 s
  EXPECT_TRUE(leftover_segments(pids).empty()) << leftover_segments(pids).front();
}

INSTANTIATE_TEST_SUITE_P(
    Divergences, DesyncTest,
    ::testing::Values(Case{"NO_SHARD", "skip_unit", "shm"}, Case{"NO_SHARD", "skip_unit", "tcp"},
                      Case{"FULL_SHARD", "skip_unit", "shm"}, Case{"FULL_SHARD", "skip_unit", "tcp"},
                      Case{"NO_SHARD", "extra_micro_batch", "shm"}, Case{"NO_SHARD", "extra_micro_batch", "tcp"},
                      Case{"FULL_SHARD", "extra_micro_batch", "shm"}, Case{"FULL_SHARD", "extra_micro_batch", "tcp"},
                      Case{"FULL_SHARD", "state_dict_alone", "shm"}, Case{"FULL_SHARD", "state_dict_alone", "tcp"},
                      Case{"FULL_SHARD", "read_alone", "shm"}, Case{"FULL_SHARD", "read_alone", "tcp"}),
    [](const auto& info) { return info.param.strategy + "_" + info.param.what + "_" + info.param.transport; });

// The same program on every rank ends with every rank agreeing, exit 0 (neither the fingerprints
// nor the end-of-job check may fail a job that is in step, accumulating or not).
class InStepTest : public ::testing::TestWithParam<Case> {};

TEST_P(InStepTest, EveryRankFinishesWithStatusZero) {
  const Case c = GetParam();
  auto r = launch("desync_worker", 3, {c.strategy, c.what}, 120, {"FSDP_TRANSPORT=" + c.transport});
  EXPECT_TRUE(r.all_ok()) << r.report();
}

std::vector<Case> in_step_cases() {
  std::vector<Case> cases;
  for (const std::string transport : {"shm", "tcp"})
    for (const std::string what : {"none", "accumulate", "accumulate_no_sync", "read_everywhere"})
      for (const std::string strategy : {"FULL_SHARD", "NO_SHARD"}) cases.push_back(Case{strategy, what, transport});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(InStep, InStepTest, ::testing::ValuesIn(in_step_cases()), [](const auto& info) {
  return info.param.strategy + "_" + info.param.what + "_" + info.param.transport;
});

}  // namespace
}  // namespace fsdp_test
