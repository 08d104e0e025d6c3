// A rank killed (SIGKILL) at a point of a training step (in forward, in backward while a
// reduction is in flight, before the optimizer step, inside full_state_dict(), inside a checkpoint
// save, or at a random moment): every other rank fails within seconds, not at the timeout,
// however many survivors and whichever rank died (Note [Dead members]); no shared-memory segment
// is left behind; the last complete checkpoint still loads. A rank that exits between two steps
// makes the others fail fast too. And a live member is never taken for dead.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <thread>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

struct KillCase {
  int world, victim;
  std::string point, transport;
  int seed = 1;
  std::string how = "KILL";  // KILL_HOLDING: a child of the victim keeps its connections open
};
void PrintTo(const KillCase& c, std::ostream* os) {
  *os << "world " << c.world << ", victim " << c.victim << " in " << c.point << ", " << c.transport << ", seed "
      << c.seed;
}

void expect_survivors_fail_fast(const KillCase& c) {
  TempDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  RunningRanks running = start("fault_in_step_worker", c.world,
                               {std::to_string(c.victim), c.point, c.how, std::to_string(c.seed), dir.path},
                               {"FSDP_TRANSPORT=" + c.transport, "FSDP_TIMEOUT_S=120"});
  const std::vector<int> pids = running.pids;
  auto r = wait_for(running, 240);
  const double seconds = seconds_since(t0);
  if (c.how == "KILL_HOLDING") {
    int holder = 0;
    std::ifstream(dir / "holder.pid") >> holder;
    EXPECT_GT(holder, 0) << "the victim forked no holder\n" << r.report();
    if (holder > 0) kill(holder, SIGKILL);
  }
  ASSERT_FALSE(r.timed_out) << r.report();
  EXPECT_EQ(r.ranks[c.victim].exit_code, 128 + SIGKILL) << r.report();
  for (int rank = 0; rank < c.world; ++rank) {
    if (rank == c.victim) continue;
    EXPECT_EQ(r.ranks[rank].exit_code, 1) << "rank " << rank << "\n" << r.report();
    EXPECT_TRUE(names_dead_member(r.ranks[rank].output)) << "rank " << rank << "\n" << r.report();
  }
  EXPECT_LT(seconds, 45) << r.report();  // the timeout is 120 s
  EXPECT_TRUE(leftover_segments(pids).empty()) << leftover_segments(pids).front();
  // Step 0's checkpoint was saved before the fault; a save the fault cut short left no checkpoint.
  EXPECT_TRUE(fsdp::checkpoint::is_complete(dir / "step-0"));
  if (path_exists(dir / "step-2")) {
    EXPECT_TRUE(fsdp::checkpoint::is_complete(dir / "step-2"));
  }
  auto loaded = launch("fault_checkpoint_loader", 2, {dir.path}, 120);
  EXPECT_TRUE(loaded.all_ok()) << loaded.report();
}

class KilledInStepTest : public ::testing::TestWithParam<KillCase> {};
TEST_P(KilledInStepTest, EverySurvivorFailsWithinSeconds) { expect_survivors_fail_fast(GetParam()); }

// World 4 and 8 with every rank as the victim on shared memory (the points cycling), and each
// point on Gloo over TCP.
std::vector<KillCase> kill_cases() {
  const std::vector<std::string> points{"forward", "backward", "step", "full_state_dict", "save"};
  std::vector<KillCase> all;
  for (int world : {4, 8})
    for (int victim = 0; victim < world; ++victim)
      all.push_back({world, victim, points[(victim + world) % points.size()], "shm"});
  for (size_t i = 0; i < points.size(); ++i) all.push_back({3, static_cast<int>(i % 3), points[i], "tcp"});
  return all;
}

INSTANTIATE_TEST_SUITE_P(Victims, KilledInStepTest, ::testing::ValuesIn(kill_cases()), [](const auto& info) {
  return "world" + std::to_string(info.param.world) + "_rank" + std::to_string(info.param.victim) + "_" +
         info.param.point + "_" + info.param.transport;
});

// The victim's connections stay open after its death (a child it forked holds them, as a forked
// helper process would), so no peer's transport sees a closed connection: over TCP only libfsdp's
// member watch finds the death (Note [Dead members]).
class KilledHoldingConnectionsTest : public ::testing::TestWithParam<KillCase> {};
TEST_P(KilledHoldingConnectionsTest, EverySurvivorFailsWithinSeconds) { expect_survivors_fail_fast(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Victims, KilledHoldingConnectionsTest,
                         ::testing::Values(KillCase{3, 0, "forward", "tcp", 1, "KILL_HOLDING"},
                                           KillCase{3, 2, "backward", "tcp", 1, "KILL_HOLDING"},
                                           KillCase{3, 1, "step", "shm", 1, "KILL_HOLDING"}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) + "_rank" +
                                  std::to_string(info.param.victim) + "_" + info.param.point + "_" +
                                  info.param.transport;
                         });

// A random moment of a long run: world, victim and transport drawn from the seed too.
class KilledAtRandomTest : public ::testing::TestWithParam<int> {};
TEST_P(KilledAtRandomTest, EverySurvivorFailsWithinSeconds) {
  const int seed = GetParam();
  const int world = 3 + seed % 2;
  expect_survivors_fail_fast({world, (seed * 7) % world, "anywhere", seed % 3 == 0 ? "tcp" : "shm", seed});
}
INSTANTIATE_TEST_SUITE_P(Seeds, KilledAtRandomTest, ::testing::Range(1, 9));

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

INSTANTIATE_TEST_SUITE_P(EachTransport, DeadRankTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

// Rank 0 waits in an all-reduce for rank 1, which comes 4 s late, while rank 0 has no file
// descriptor left (the limit lowered to its highest open one, the gaps below filled), so the
// member watch cannot read rank 1's /proc entry. (A limit of 0 would also fail the store's poll.)
FSDP_WORKER(unreadable_live_member_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  at::Tensor t = torch::ones({4});
  rlimit old{};
  WORKER_CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0, "getrlimit failed");
  std::vector<int> fillers;
  if (ctx.rank == 1) std::this_thread::sleep_for(std::chrono::seconds(4));
  if (ctx.rank == 0) {
    int highest = 2;
    for (const auto& fd : list_dir("/proc/self/fd")) highest = std::max(highest, std::stoi(fd));
    rlimit full = old;
    full.rlim_cur = static_cast<rlim_t>(highest) + 1;
    WORKER_CHECK(setrlimit(RLIMIT_NOFILE, &full) == 0, "setrlimit failed");
    for (int fd; (fd = dup(2)) >= 0;) fillers.push_back(fd);
    WORKER_CHECK(!std::ifstream("/proc/self/stat"), "a file still opens");
  }
  pg->world()->all_reduce(t)->wait();
  if (ctx.rank == 0) {
    for (int fd : fillers) close(fd);
    WORKER_CHECK(setrlimit(RLIMIT_NOFILE, &old) == 0, "setrlimit failed");
  }
  WORKER_CHECK(t.equal(torch::full({4}, 2.0)), "the all-reduce is wrong");
}

// A member whose /proc entry this rank cannot read is alive until the kernel says otherwise
// (Note [Dead members]): the watch must not end a job that is only waiting.
TEST(DeadMembers, AMemberThatCannotBeReadIsNotTakenForDead) {
  auto r = launch("unreadable_live_member_worker", 2, {}, 120, {"FSDP_TRANSPORT=tcp", "FSDP_TIMEOUT_S=60"});
  ASSERT_FALSE(r.timed_out) << r.report();
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(r.ranks[rank].exit_code, 0) << r.report();
}

}  // namespace
}  // namespace fsdp_test
