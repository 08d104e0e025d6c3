// Start-up failures: options that differ across ranks, a MASTER_ADDR that does not resolve, a rank
// that exits before fully_shard(), a member missing from a shared-memory group: every rank fails
// within seconds (not at the timeout), naming the cause, and no segment is left in /dev/shm. A
// rendezvous that cannot complete (another program on MASTER_PORT, a rank that never starts) ends
// within the timeout, naming the port or the missing rank. And a /dev/shm too small for the
// segment: the group falls back to Gloo over TCP, saying so.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "harness.h"
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
    RunningRanks running =
        start("different_options_worker", 4, {what}, {"FSDP_TRANSPORT=" + transport, "FSDP_TIMEOUT_S=120"});
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

INSTANTIATE_TEST_SUITE_P(OptionNames, DifferentOptionsTest,
                         ::testing::Values("strategy", "backward_prefetch", "sync_module_states"),
                         [](const auto& info) { return info.param; });

FSDP_WORKER(unresolvable_master_worker) { auto pg = fsdp::ProcessGroup::from_env(); }

TEST(Startup, AMasterAddrThatDoesNotResolveFailsAtOnce) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = launch("unresolvable_master_worker", 2, {}, 120, {"MASTER_ADDR=no-such-host.invalid", "FSDP_TIMEOUT_S=120"});
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks) {
    EXPECT_EQ(rank.exit_code, 1) << r.report();
    EXPECT_TRUE(contains(rank.output, "MASTER_ADDR 'no-such-host.invalid' does not resolve")) << r.report();
  }
  EXPECT_LT(seconds_since(t0), 45) << r.report();  // the timeout is 120 s
}

// args: the rank that fails before fully_shard().
FSDP_WORKER(exits_before_fully_shard_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  if (ctx.rank == std::stoi(ctx.args.at(0))) throw std::runtime_error("the training data is missing");
  MLP model(6, 10, 3, 2);
  fsdp::fully_shard(model, pg);
}

TEST(Startup, ARankThatExitsBeforeFullyShardIsNamedAtOnce) {
  for (const std::string transport : {"shm", "tcp"}) {
    const auto t0 = std::chrono::steady_clock::now();
    RunningRanks running =
        start("exits_before_fully_shard_worker", 4, {"2"}, {"FSDP_TRANSPORT=" + transport, "FSDP_TIMEOUT_S=120"});
    const std::vector<int> pids = running.pids;
    auto r = wait_for(running, 240);
    ASSERT_FALSE(r.timed_out) << r.report();
    for (int rank = 0; rank < 4; ++rank) {
      EXPECT_EQ(r.ranks[rank].exit_code, 1) << transport << " rank " << rank << "\n" << r.report();
      if (rank != 2) {
        EXPECT_TRUE(contains(r.ranks[rank].output, "rank 2 exited before it reached fully_shard()")) << r.report();
      }
    }
    EXPECT_LT(seconds_since(t0), 20) << transport << "\n" << r.report();  // the timeout is 120 s
    EXPECT_TRUE(leftover_segments(pids).empty()) << leftover_segments(pids).front();
  }
}

// Rank 0 alone asks for a group with rank 1, which never comes.
FSDP_WORKER(lonely_group_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  if (ctx.rank == 0) pg->new_group({0, 1}, "lonely");
  std::this_thread::sleep_for(std::chrono::seconds(ctx.rank == 0 ? 0 : 4));
}

TEST(Startup, AMemberMissingFromASharedMemoryGroupIsNamedAndNoSegmentIsLeft) {
  RunningRanks running = start("lonely_group_worker", 2, {}, {"FSDP_TRANSPORT=shm", "FSDP_TIMEOUT_S=3"});
  const std::vector<int> pids = running.pids;
  auto r = wait_for(running, 120);
  ASSERT_FALSE(r.timed_out) << r.report();
  EXPECT_EQ(r.ranks[0].exit_code, 1) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "member(s) 1 did not report whether it could map the segment within 3 s"))
      << r.report();
  EXPECT_TRUE(leftover_segments(pids).empty()) << leftover_segments(pids).front();
}

// Rendezvous failures end within the timeout on every rank, naming the address, port and ranks.
FSDP_WORKER(rendezvous_worker) {
  if (ctx.args.at(0) == "skip" && ctx.rank == ctx.world - 1) return;  // this rank never starts
  auto pg = fsdp::ProcessGroup::from_env();
  pg->world()->barrier();
}

// Another program on MASTER_PORT: accepts connections and never answers.
class ForeignListener {
 public:
  ForeignListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = 0;
    if (bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd_, 16) != 0)
      throw std::runtime_error("cannot listen");
    socklen_t len = sizeof(a);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      for (;;) {
        const int c = accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        std::lock_guard<std::mutex> lock(mu_);
        accepted_.push_back(c);
      }
    });
  }
  ~ForeignListener() {
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
    for (int c : accepted_) close(c);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1, port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  std::vector<int> accepted_;
};

TEST(Rendezvous, AForeignListenerOnMasterPortFailsEveryRankWithinTheTimeout) {
  ForeignListener foreign;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string port = std::to_string(foreign.port());
  auto r = launch("rendezvous_worker", 2, {"all"}, 60, {"MASTER_PORT=" + port, "FSDP_TIMEOUT_S=3"});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(r.timed_out) << r.report();
  EXPECT_LT(seconds, 3 + 7) << r.report();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(r.ranks[rank].exit_code, 0) << r.report();
    EXPECT_TRUE(contains(r.ranks[rank].output, "MASTER_PORT=" + port)) << r.report();
  }
}

TEST(Rendezvous, ARankThatNeverStartsIsNamedByTheOthers) {
  auto r = launch("rendezvous_worker", 3, {"skip"}, 60, {"FSDP_TIMEOUT_S=3"});
  EXPECT_FALSE(r.timed_out) << r.report();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(r.ranks[rank].exit_code, 0) << r.report();
    EXPECT_TRUE(contains(r.ranks[rank].output, "1 of 3 ranks never arrived")) << r.report();
    EXPECT_TRUE(contains(r.ranks[rank].output, ": rank 2.")) << r.report();
  }
}

// Rank 0 sees a 64 KiB /dev/shm of its own (a private mount namespace; needs root): the segment
// cannot be reserved, so every group falls back to Gloo over TCP and training still runs.
FSDP_WORKER(small_dev_shm_worker) {
  if (ctx.rank == 0) {
    WORKER_CHECK(unshare(CLONE_NEWNS) == 0, "unshare: ", std::strerror(errno));
    WORKER_CHECK(mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0, "mount: ", std::strerror(errno));
    WORKER_CHECK(mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=64k") == 0, "mount tmpfs: ", std::strerror(errno));
  }
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded = fsdp::fully_shard(model, pg);
  torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.1));
  model->forward(at::ones({2, 6})).sum().backward();
  opt.step();
}

TEST(Startup, ATooSmallDevShmFallsBackToGlooSayingSo) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root for a private /dev/shm";
  auto r = launch("small_dev_shm_worker", 2, {}, 120, {"FSDP_TRANSPORT=auto"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "shared memory is unavailable")) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "using Gloo over TCP instead")) << r.report();
}

}  // namespace
}  // namespace fsdp_test
