// A rank killed (SIGKILL) at a point of a training step: every other rank fails within seconds,
// not at the timeout, however many survivors and whichever rank died (Note [Dead members]); no
// shared-memory segment is left behind.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>

#include "faults/faults.h"

namespace fsdp_test {
namespace {

// args: victim rank, phase (forward, backward, step). Steps of FULL_SHARD SGD; the victim kills
// itself in step 2 at the phase.
FSDP_WORKER(killed_in_step_worker) {
  const int victim = std::stoi(ctx.args.at(0));
  const std::string phase = ctx.args.at(1);
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(1);
  Skippy model;
  auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.1));
  auto die_at = [&](int step, const char* here) {
    if (ctx.rank == victim && step == 2 && phase == here) kill(getpid(), SIGKILL);
  };
  for (int step = 0; step < 4; ++step) {
    at::Tensor x = at::randn({4, 8}, at::detail::createCPUGenerator(step + ctx.rank));
    die_at(step, "forward");
    at::Tensor loss = model->forward(x).pow(2).mean();
    die_at(step, "backward");
    loss.backward();
    die_at(step, "step");
    opt.step();
    zero_grad_in_place(opt);
  }
}

struct Case {
  int world, victim;
  std::string transport;
};
void PrintTo(const Case& c, std::ostream* os) { *os << "world " << c.world << ", victim " << c.victim << ", " << c.transport; }


class KilledInStepTest : public ::testing::TestWithParam<Case> {};

TEST_P(KilledInStepTest, EverySurvivorFailsWithinSeconds) {
  const Case c = GetParam();
  const char* phases[] = {"forward", "backward", "step"};
  const std::string phase = phases[c.victim % 3];
  const auto t0 = std::chrono::steady_clock::now();
  RunningRanks running = start("killed_in_step_worker", c.world, {std::to_string(c.victim), phase},
                               {"FSDP_TRANSPORT=" + c.transport, "FSDP_TIMEOUT_S=120"});
  const std::vector<int> pids = running.pids;
  auto r = wait_for(running, 240);
  const double seconds = seconds_since(t0);
  ASSERT_FALSE(r.timed_out) << r.report();
  EXPECT_EQ(r.ranks[c.victim].exit_code, 128 + SIGKILL) << r.report();
  for (int rank = 0; rank < c.world; ++rank) {
    if (rank == c.victim) continue;
    EXPECT_EQ(r.ranks[rank].exit_code, 1) << "rank " << rank << "\n" << r.report();
    const std::string& out = r.ranks[rank].output;
    // The victim's death, or a survivor that found it and failed first, or its closed connection.
    EXPECT_TRUE(contains(out, ") died") || contains(out, "failed a collective") || contains(out, "Connection") ||
                contains(out, "connection"))
        << "rank " << rank << "\n" << r.report();
  }
  EXPECT_LT(seconds, 45) << "phase " << phase << "\n" << r.report();  // the timeout is 120 s
  EXPECT_TRUE(leftover_segments(pids).empty()) << leftover_segments(pids).front();
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (int world : {4, 8})
    for (int victim = 0; victim < world; ++victim) all.push_back({world, victim, "shm"});
  for (int victim : {0, 3}) all.push_back({4, victim, "tcp"});
  return all;
}

INSTANTIATE_TEST_SUITE_P(Victims, KilledInStepTest, ::testing::ValuesIn(cases()), [](const auto& info) {
  return "world" + std::to_string(info.param.world) + "_rank" + std::to_string(info.param.victim) + "_" +
         info.param.transport;
});

}  // namespace
}  // namespace fsdp_test
