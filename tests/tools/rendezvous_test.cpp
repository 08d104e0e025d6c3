// fsdp-run's membership agreement (tools/fsdp_run/rendezvous.h): nodes as threads joining rounds
// in one rendezvous store on loopback.
#include "rendezvous.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "store_server.h"

namespace fsdp_run {
namespace {

using std::chrono::milliseconds;

const std::string kToken = "rendezvous-test-token-0123456789";

class RendezvousTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<fsdp::StoreServer>("127.0.0.1", 0, kToken, std::chrono::seconds(10));
  }
  std::unique_ptr<NodeStore> connect() {
    return std::make_unique<NodeStore>("127.0.0.1", server_->port(), kToken, std::chrono::seconds(10));
  }
  // Node `me` joins `round` on its own connection, in a thread.
  std::future<JoinResult> join(const RendezvousSettings& s, int round, NodeEntry me,
                               std::optional<std::set<int>> expected = std::nullopt) {
    return std::async(std::launch::async, [this, s, round, me, expected] {
      auto store = connect();
      return join_round(
          *store, s, round, me, [&] { return expected; }, 3);
    });
  }
  std::unique_ptr<fsdp::StoreServer> server_;
};

RendezvousSettings settings(int min_nodes, int max_nodes, int join_ms, int last_call_ms) {
  RendezvousSettings s;
  s.min_nodes = min_nodes;
  s.max_nodes = max_nodes;
  s.join_timeout = milliseconds(join_ms);
  s.last_call = milliseconds(last_call_ms);
  return s;
}

TEST(Rendezvous, PlaceNumbersRanksNodeByNodeInIdOrder) {
  const std::vector<NodeEntry> nodes{{2, 3, "c"}, {0, 2, "a"}, {1, 1, "b"}};
  const std::optional<Membership> m = place(4, nodes, NodeEntry{2, 3, "c"});
  ASSERT_TRUE(m);
  EXPECT_EQ(m->round, 4);
  EXPECT_EQ(m->node_rank, 2);
  EXPECT_EQ(m->first_rank, 3);
  EXPECT_EQ(m->world_size, 6);
  EXPECT_EQ(place(4, nodes, NodeEntry{1, 1, "b"})->first_rank, 2);
  EXPECT_FALSE(place(4, nodes, NodeEntry{1, 1, "another tag"}));
}

TEST(Rendezvous, MembersTextRoundTrips) {
  const std::vector<NodeEntry> nodes{{0, 2, "a1"}, {3, 4, "ff"}};
  const std::vector<NodeEntry> back = decode_members(encode_members(nodes));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[1].id, 3);
  EXPECT_EQ(back[1].nproc, 4);
  EXPECT_EQ(back[1].tag, "ff");
  EXPECT_TRUE(decode_members("0:x:a").empty());
}

TEST(Rendezvous, ChooseKeepsTheHostOneEntryPerIdAndAtMostMax) {
  const std::vector<NodeEntry> joined{{2, 1, "c"}, {1, 1, "b"}, {2, 1, "d"}, {0, 1, "a"}};
  const std::vector<NodeEntry> two = choose_members(joined, 2);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0].id, 0);
  EXPECT_EQ(two[1].id, 2);
  const std::vector<NodeEntry> all = choose_members(joined, 8);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[2].tag, "c");  // the first to join with id 2
}

TEST_F(RendezvousTest, ThreeNodesAgreeAtMax) {
  const RendezvousSettings s = settings(2, 3, 10'000, 10'000);
  auto a = join(s, 0, {0, 2, "a"}), b = join(s, 0, {1, 1, "b"}), c = join(s, 0, {2, 2, "c"});
  const JoinResult ra = a.get(), rb = b.get(), rc = c.get();
  ASSERT_TRUE(ra.membership && rb.membership && rc.membership);
  EXPECT_EQ(ra.membership->world_size, 5);
  EXPECT_EQ(rb.membership->world_size, 5);
  EXPECT_EQ(rb.membership->first_rank, 2);
  EXPECT_EQ(rc.membership->first_rank, 3);
  EXPECT_EQ(rc.membership->node_rank, 2);
}

TEST_F(RendezvousTest, ClosesWithMinAfterTheLastCall) {
  const RendezvousSettings s = settings(1, 2, 10'000, 200);
  const auto start = std::chrono::steady_clock::now();
  const JoinResult r = join(s, 0, {0, 2, "a"}).get();
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(200));
  ASSERT_TRUE(r.membership);
  EXPECT_EQ(r.membership->nodes.size(), 1u);
  EXPECT_EQ(r.membership->world_size, 2);
  // A node that joins after the round closed is not a member.
  EXPECT_FALSE(join(s, 0, {1, 2, "b"}).get().membership);
}

TEST_F(RendezvousTest, ARestartRoundClosesOnceTheExpectedNodesAreIn) {
  const RendezvousSettings s = settings(1, 3, 10'000, 60'000);
  auto a = join(s, 1, {0, 2, "a"}, std::set<int>{0, 2});
  auto c = join(s, 1, {2, 2, "c"});
  EXPECT_EQ(a.wait_for(std::chrono::seconds(20)), std::future_status::ready);  // not the 60 s last call
  EXPECT_EQ(a.get().membership->world_size, 4);
  EXPECT_EQ(c.get().membership->node_rank, 1);
}

TEST_F(RendezvousTest, TooFewNodesEndTheJobWithAMessage) {
  const RendezvousSettings s = settings(2, 2, 200, 10'000);
  try {
    join(s, 0, {0, 1, "a"}).get();
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("only 1 of at least 2 nodes joined"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--join-timeout"), std::string::npos) << e.what();
  }
  EXPECT_EQ(connect()->get(keys::done()).value_or(""), "3");
  // A node still waiting for the round learns that the job ended.
  EXPECT_EQ(join(s, 0, {1, 1, "b"}).get().done.value_or(-1), 3);
}

TEST_F(RendezvousTest, ASecondNodeWithTheSameRankIsRefused) {
  const RendezvousSettings s = settings(2, 2, 10'000, 10'000);
  auto b = join(s, 0, {1, 1, "b"});
  b.wait_for(milliseconds(300));
  auto twin = join(s, 0, {1, 1, "twin"});
  auto a = join(s, 0, {0, 1, "a"});
  EXPECT_TRUE(a.get().membership);
  EXPECT_TRUE(b.get().membership);
  try {
    twin.get();
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("distinct --node-rank"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fsdp_run
