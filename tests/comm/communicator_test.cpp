// CPU transports (Gloo over TCP, shared memory): collectives, failure paths and transport names.
// Against values computed locally: every collective, several dtypes, sizes of zero, odd and larger
// than the shared-memory staging buffers; the failure paths (diverged ranks on both transports;
// on shared memory a member that died or left); FSDP_TRANSPORT's names.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <thread>
#include <tuple>

#include "harness.h"

namespace fsdp_test {
namespace {

// What each rank contributes to the collectives, in one dtype: rank r's element i is i modulo a
// small period plus a shift of r's, distinct per rank and element and small enough that every sum
// is exact whatever the order (bfloat16: integers up to 256, so smaller values that repeat across
// ranks). The pattern is made once; each contribution and reference is one operation on a slice.
class Contributions {
 public:
  Contributions(at::ScalarType dtype, int64_t numel)
      : dtype_(dtype),
        pattern_(torch::arange(numel, torch::kLong).remainder(dtype == at::kBFloat16 ? 5 : 97).to(dtype)) {}
  // Rank r's elements [offset, offset + numel).
  at::Tensor of(int rank, int64_t numel, int64_t offset = 0) const {
    return pattern_.narrow(0, offset, numel) + shift(rank);
  }
  // The sum of of(p, numel, offset) over ranks p in [0, world), in closed form: the reference costs
  // one rank's share of the elements, not the whole world's.
  at::Tensor sum(int world, int64_t numel, int64_t offset = 0) const {
    int64_t shifts = 0;
    for (int p = 0; p < world; ++p) shifts += shift(p);
    return pattern_.narrow(0, offset, numel) * world + shifts;
  }

 private:
  int64_t shift(int rank) const { return dtype_ == at::kBFloat16 ? rank % 3 : 7 * rank; }
  at::ScalarType dtype_;
  at::Tensor pattern_;
};

FSDP_WORKER(transport_worker) {
  const std::string expected_transport = ctx.args.at(0);
  auto pg = fsdp::ProcessGroup::from_env();
  auto comm = pg->world();
  const int W = ctx.world, r = ctx.rank;
  WORKER_CHECK((comm->shared_memory_bytes() > 0) == (expected_transport == "shm"), "world() uses the wrong transport (",
               comm->shared_memory_bytes(), " shared bytes, expected ", expected_transport, ")");
  // 0, 1, odd, one staging buffer exactly (1 MiB of float up to 8 ranks), and several buffers
  // plus a remainder; "small": fewer and smaller, for many ranks.
  const bool small = ctx.args.size() > 1 && ctx.args[1] == "small";
  const std::vector<int64_t> sizes =
      small ? std::vector<int64_t>{0, 1, 1001, 70001} : std::vector<int64_t>{0, 1, 1001, 262144, 700001};
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kLong}) {
    const Contributions c(dtype, sizes.back() * W);
    for (int64_t n : sizes) {
      // all_gather_into
      at::Tensor out = torch::full({n * W}, -1, dtype);
      comm->all_gather_into(out, c.of(r, n))->wait();
      for (int p = 0; p < W; ++p)
        WORKER_CHECK(out.narrow(0, p * n, n).equal(c.of(p, n)), "all_gather_into ", dtype, " n=", n, ": rank ", p,
                     "'s part is wrong");
      // reduce_scatter
      at::Tensor mine = torch::full({n}, -1, dtype);
      comm->reduce_scatter(mine, c.of(r, n * W))->wait();
      WORKER_CHECK(mine.equal(c.sum(W, n, r * n)), "reduce_scatter ", dtype, " n=", n, " is wrong");
      // all_to_all_into: part p comes from rank p's part r
      WORKER_CHECK(comm->has_all_to_all(), "the transport implements all_to_all_into but does not say so");
      at::Tensor exchanged = torch::full({n * W}, -1, dtype);
      comm->all_to_all_into(exchanged, c.of(r, n * W))->wait();
      for (int p = 0; p < W; ++p)
        WORKER_CHECK(exchanged.narrow(0, p * n, n).equal(c.of(p, n, r * n)), "all_to_all_into ", dtype, " n=", n,
                     ": the part from rank ", p, " is wrong");
      // all_reduce, in place
      at::Tensor t = c.of(r, n * W);
      comm->all_reduce(t)->wait();
      WORKER_CHECK(t.equal(c.sum(W, n * W)), "all_reduce ", dtype, " n=", n, " is wrong");
      // broadcast from the last rank
      at::Tensor b = r == W - 1 ? c.of(r, n) : torch::full({n}, -1, dtype);
      comm->broadcast(b, W - 1)->wait();
      WORKER_CHECK(b.equal(c.of(W - 1, n)), "broadcast ", dtype, " n=", n, " is wrong");
    }
  }
  // Several collectives in flight at once complete in issue order with the right values.
  const int64_t in_flight = small ? 30000 : 300000;
  const Contributions floats(at::kFloat, in_flight);
  std::vector<at::Tensor> ts;
  std::vector<fsdp::WorkPtr> works;
  for (int i = 0; i < 6; ++i) {
    ts.push_back(floats.of(r + i, in_flight));
    works.push_back(comm->all_reduce(ts.back()));
  }
  for (int i = 0; i < 6; ++i) {
    works[i]->wait();
    at::Tensor expect = torch::zeros({in_flight});
    for (int p = 0; p < W; ++p) expect.add_(floats.of(p + i, in_flight));
    WORKER_CHECK(ts[i].equal(expect), "all_reduce #", i, " in flight is wrong");
  }
  comm->barrier();
  // A sub-group gets its own communicator on the same transport.
  if (W >= 3) {
    std::vector<int> ranks{0, 2};
    if (r == 0 || r == 2) {
      auto sub = pg->new_group(ranks, "pair");
      WORKER_CHECK((sub->shared_memory_bytes() > 0) == (expected_transport == "shm"), "sub-group transport");
      at::Tensor t = torch::full({5}, double(r + 1), at::kDouble);
      sub->all_reduce(t)->wait();
      WORKER_CHECK(t.equal(torch::full({5}, 4.0, at::kDouble)), "sub-group all_reduce is wrong");
    }
    // Chained (CollectiveOptions::after), as hybrid sharding does: a world reduce-scatter, then the
    // pair all-reduces its two results without waiting in between.
    const int64_t n = 4;
    const Contributions doubles(at::kDouble, n * W);
    at::Tensor sum = doubles.sum(W, n * W);
    at::Tensor mine = torch::empty({n}, at::kDouble);
    auto scattered = comm->reduce_scatter(mine, doubles.of(r, n * W));
    if (r == 0 || r == 2) {
      fsdp::CollectiveOptions chained;
      chained.after = scattered;
      pg->new_group(ranks, "pair")->all_reduce(mine, chained)->wait();
      WORKER_CHECK(mine.equal(sum.narrow(0, 0, n) + sum.narrow(0, 2 * n, n)), "chained all_reduce is wrong");
    } else {
      scattered->wait();
    }
  }
  comm->barrier();
  if (r == 0) std::cout << "transport " << expected_transport << " ok" << std::endl;
}

class TransportTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TransportTest, CollectivesMatchLocalResultsAtWorld3) {
  const std::string transport = GetParam();
  auto r = launch("transport_worker", 3, {transport}, 300, {"FSDP_TRANSPORT=" + transport});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "transport " + transport + " ok")) << r.report();
}

INSTANTIATE_TEST_SUITE_P(Transports, TransportTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

// Beyond 8 ranks per host the staging buffers shrink (the segment stays at 16 MiB): more rounds.
TEST(SharedMemory, CollectivesMatchLocalResultsAtWorld10) {
  auto r = launch("transport_worker", 10, {"shm", "small"}, 300, {"FSDP_TRANSPORT=shm"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "transport shm ok")) << r.report();
}

// Rank 1 issues a different collective from the others ("kind": an all-gather against all-reduces;
// "label": an all-gather of the same size for another purpose, which would pair and deliver the
// wrong data): every rank fails fast, naming both.
FSDP_WORKER(diverged_worker) {
  const std::string what = ctx.args.at(0);
  auto pg = fsdp::ProcessGroup::from_env();
  auto comm = pg->world();
  at::Tensor t = torch::ones({10});
  comm->all_reduce(t)->wait();  // in step
  try {
    at::Tensor out = torch::empty({10 * ctx.world});
    if (ctx.rank == 1) {
      comm->all_gather_into(out, torch::ones({10}), fsdp::CollectiveOptions::labeled("the odd one"))->wait();
    } else if (what == "kind") {
      comm->all_reduce(t)->wait();
    } else {
      comm->all_gather_into(out, torch::ones({10}), fsdp::CollectiveOptions::labeled("the common one"))->wait();
    }
  } catch (const fsdp::Error& e) {
    std::cout << "caught: " << e.what() << std::endl;
    return;
  }
  throw std::runtime_error("diverged collectives did not fail");
}

class DivergedTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(DivergedTest, RanksFailFastNamingBothCollectives) {
  const auto [transport, what] = GetParam();
  const auto t0 = std::chrono::steady_clock::now();
  auto r = launch("diverged_worker", 3, {what}, 120, {"FSDP_TRANSPORT=" + transport});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r.all_ok()) << r.report();
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_TRUE(contains(r.ranks[rank].output, "ranks diverged: member")) << r.report();
    EXPECT_TRUE(contains(r.ranks[rank].output, "all_gather_into #1 of 40 bytes (Float) for 'the odd one'"))
        << r.report();
    EXPECT_TRUE(contains(r.ranks[rank].output, what == "kind" ? "all_reduce #1 of 40 bytes"
                                                              : "all_gather_into #1 of 40 bytes (Float) for "
                                                                "'the common one'"))
        << r.report();
  }
  EXPECT_LT(seconds, 30) << r.report();  // the timeout is 60 s
}

INSTANTIATE_TEST_SUITE_P(Transports, DivergedTest,
                         ::testing::Combine(::testing::Values("tcp", "shm"), ::testing::Values("kind", "label")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// A member dies inside a collective, or destroys its communicator while the others wait in one:
// the others fail within about the liveness period (dies) or at once (leaves), naming the member,
// not at the timeout.
FSDP_WORKER(member_gone_worker) {
  const std::string how = ctx.args.at(0);
  auto pg = fsdp::ProcessGroup::from_env();
  auto comm = pg->world();
  at::Tensor t = torch::ones({1000});
  comm->all_reduce(t)->wait();
  if (ctx.rank == 1) {
    if (how == "dies") _exit(3);
    pg.reset();
    comm.reset();  // the last reference: the communicator is destroyed
    std::this_thread::sleep_for(std::chrono::seconds(3));
    return;
  }
  try {
    comm->all_reduce(t)->wait();
  } catch (const fsdp::Error& e) {
    std::cout << "caught: " << e.what() << std::endl;
    return;
  }
  throw std::runtime_error("a collective without member 1 completed");
}

class MemberGoneTest : public ::testing::TestWithParam<std::string> {};

TEST_P(MemberGoneTest, OthersFailFastNamingTheMember) {
  const std::string how = GetParam();
  const auto t0 = std::chrono::steady_clock::now();
  auto r = launch("member_gone_worker", 3, {how}, 120, {"FSDP_TRANSPORT=shm"});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r.timed_out) << r.report();
  // Leaving runs the communicator's shutdown, which finds the others still in a collective: member
  // 1 fails too (status 1), as it must not finish out of step (Note [End-of-job agreement]).
  EXPECT_EQ(r.ranks[1].exit_code, how == "dies" ? 3 : 1) << r.report();
  const std::string expected = how == "dies" ? "member 1 of world[0,1,2] (pid " : "while member 1 issued shutdown #1";
  for (int rank : {0, 2}) {
    EXPECT_EQ(r.ranks[rank].exit_code, 0) << r.report();
    EXPECT_TRUE(contains(r.ranks[rank].output, expected)) << r.report();
    if (how == "dies") {
      EXPECT_TRUE(contains(r.ranks[rank].output, ") died")) << r.report();
    }
  }
  EXPECT_LT(seconds, 15) << r.report();  // the timeout is 60 s
}

INSTANTIATE_TEST_SUITE_P(Ways, MemberGoneTest, ::testing::Values("dies", "leaves"),
                         [](const auto& info) { return info.param; });

TEST(Transport, ParsesNamesAndRejectsOthersWithTheFix) {
  EXPECT_EQ(fsdp::parse_transport("auto", "x"), fsdp::Transport::kAuto);
  EXPECT_EQ(fsdp::parse_transport("tcp", "x"), fsdp::Transport::kTcp);
  EXPECT_EQ(fsdp::parse_transport("shm", "x"), fsdp::Transport::kSharedMemory);
  try {
    fsdp::parse_transport("nccl", "FSDP_TRANSPORT");
    FAIL();
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "FSDP_TRANSPORT=nccl is not a transport; use auto")) << e.what();
  }
}

}  // namespace
}  // namespace fsdp_test
