// A rank stopped (SIGSTOP) at a point of a training step: it neither dies nor answers, so every
// other rank fails once FSDP_TIMEOUT_S passes (within the timeout + 5 s), naming the timeout, and
// leaves no shared-memory segment behind.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <thread>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

struct StopCase {
  std::string point, transport;
};
void PrintTo(const StopCase& c, std::ostream* os) { *os << c.point << ", " << c.transport; }

class StoppedInStepTest : public ::testing::TestWithParam<StopCase> {};

TEST_P(StoppedInStepTest, EverySurvivorFailsAtTheTimeout) {
  const StopCase c = GetParam();
  const int world = 3, victim = 1, timeout_s = 10;
  TempDir dir;
  RunningRanks running = start("fault_in_step_worker", world, {std::to_string(victim), c.point, "STOP", "1", dir.path},
                               {"FSDP_TRANSPORT=" + c.transport, "FSDP_TIMEOUT_S=" + std::to_string(timeout_s)});
  const std::vector<int> pids = running.pids;
  auto poll_until = [](const std::function<bool()>& done, double limit_s) {
    const auto t0 = std::chrono::steady_clock::now();
    while (!done() && seconds_since(t0) < limit_s) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return done();
  };
  const bool stopped = poll_until([&] { return process_state(pids[victim]) == 'T'; }, 120);
  const auto t_stop = std::chrono::steady_clock::now();
  const bool survivors_ended = poll_until(
      [&] {
        for (int rank = 0; rank < world; ++rank)
          if (rank != victim && process_state(pids[rank]) != 'Z') return false;
        return true;
      },
      120);
  const double seconds = seconds_since(t_stop);
  kill(pids[victim], SIGKILL);
  auto r = wait_for(running, 60);
  ASSERT_TRUE(stopped) << r.report();
  ASSERT_TRUE(survivors_ended) << r.report();
  for (int rank = 0; rank < world; ++rank) {
    if (rank == victim) continue;
    EXPECT_EQ(r.ranks[rank].exit_code, 1) << "rank " << rank << "\n" << r.report();
    const std::string& out = r.ranks[rank].output;
    EXPECT_TRUE(contains(out, "within 10") || contains(out, "imed out") || contains(out, "imeout") ||
                contains(out, "failed a collective"))
        << "rank " << rank << "\n"
        << r.report();
  }
  EXPECT_LT(seconds, timeout_s + 5) << r.report();
  EXPECT_TRUE(leftover_segments(pids).empty()) << leftover_segments(pids).front();
}

INSTANTIATE_TEST_SUITE_P(Points, StoppedInStepTest,
                         ::testing::Values(StopCase{"forward", "shm"}, StopCase{"backward", "tcp"},
                                           StopCase{"full_state_dict", "shm"}, StopCase{"save", "tcp"},
                                           StopCase{"anywhere", "shm"}),
                         [](const auto& info) { return info.param.point + "_" + info.param.transport; });

}  // namespace
}  // namespace fsdp_test
