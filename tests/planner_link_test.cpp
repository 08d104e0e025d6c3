// The planner's links on a CPU cluster (fsdp::calibrate_link, Calibration::link_copy_gbps): the
// transports copy on the ranks' cores, and beneath a modeled network the links' time beyond those
// copies overlaps the computation. See Note [Planner calibration] in docs/design.md.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "fsdp/cluster.h"
#include "fsdp/fsdp.h"
#include "fsdp/network_model.h"
#include "fsdp/planner.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// Whether a measured rate is about the modeled one (within 30%).
bool about(double measured, double modeled) { return measured > 0.7 * modeled && measured < 1.3 * modeled; }

// calibrate_link times the modeled link and the transport beneath it; an unmodeled one has no copy rate.
FSDP_WORKER(link_calibration_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int n = pg->size();
  std::vector<int> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  const double gbps = 0.05;  // far below what shared memory copies
  auto modeled = fsdp::with_network_model(pg->world(), ranks,
                                          fsdp::NetworkModel()
                                              .intra(fsdp::Link().bandwidth_gbps(gbps))
                                              .inter(fsdp::Link().bandwidth_gbps(gbps))
                                              .ranks_per_host(1));
  // A timing on shared cores: a try that other processes slowed is timed again (every rank sees the
  // same reduced figures, so all of them try again together).
  fsdp::Calibration c;
  for (int tries = 0; tries < 3 && !about(c.link_gbps, gbps); ++tries) {
    c = fsdp::Calibration();
    fsdp::calibrate_link(c, *modeled);
  }
  WORKER_CHECK(about(c.link_gbps, gbps), "modeled link measured at ", c.link_gbps, " GB/s, not about ", gbps);
  WORKER_CHECK(c.link_copy_gbps > 4 * c.link_gbps, "the transport beneath it measured at ", c.link_copy_gbps, " GB/s");
  WORKER_CHECK(c.link_copy_latency_us > 0, "the transport beneath it has no latency: ", c.link_copy_latency_us);
  fsdp::Calibration plain;
  fsdp::calibrate_link(plain, *pg->world());
  WORKER_CHECK(plain.link_gbps > 4 * gbps && plain.link_copy_gbps == 0 && plain.link_copy_latency_us == 0,
               "an unmodeled link: ", plain.link_gbps, " GB/s, copy rate ", plain.link_copy_gbps);
  const auto back = fsdp::Calibration::from_json(R"({"tokens": 1, "timings": []})");
  WORKER_CHECK(back.link_copy_gbps == 0, "a file without a copy rate reads as ", back.link_copy_gbps);
  c.tokens = 1;  // a file needs its tokens
  const auto saved = fsdp::Calibration::from_json(c.to_json());
  WORKER_CHECK(saved.link_copy_gbps == c.link_copy_gbps && saved.link_copy_latency_us == c.link_copy_latency_us,
               "the copy rate and latency do not survive a file");
  if (pg->rank() == 0) std::cout << "links calibrated" << std::endl;
}

TEST(PlannerLink, CalibrateLinkTimesTheTransportBeneathAModeledNetwork) {
  auto r = launch("link_calibration_worker", 3);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "links calibrated")) << r.report();
}

// Under a modeled network of two hosts of two ranks, calibrate_link over the process group times
// the link between hosts and each host's own.
FSDP_WORKER(host_link_calibration_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const double intra = 0.2, inter = 0.05;  // both far below what shared memory copies
  pg->set_network_model(fsdp::NetworkModel()
                            .intra(fsdp::Link().bandwidth_gbps(intra))
                            .inter(fsdp::Link().bandwidth_gbps(inter))
                            .ranks_per_host(2));
  fsdp::Calibration c;
  for (int tries = 0; tries < 3 && !(about(c.link_gbps, 2 * inter) && about(c.intra_link_gbps, intra)); ++tries) {
    c = fsdp::Calibration();  // a try that other processes slowed is timed again, on every rank alike
    fsdp::calibrate_link(c, *pg);
  }
  WORKER_CHECK(c.link_ranks_per_host == 2, "ranks per host ", c.link_ranks_per_host, ", not 2");
  // The world group crosses hosts on two rings, each on its own rank's link.
  WORKER_CHECK(about(c.link_gbps, 2 * inter), "between hosts: ", c.link_gbps, " GB/s, not about ", 2 * inter);
  WORKER_CHECK(about(c.intra_link_gbps, intra), "within a host: ", c.intra_link_gbps, " GB/s, not about ", intra);
  WORKER_CHECK(c.link_copy_gbps > 4 * c.intra_link_gbps, "the transport beneath: ", c.link_copy_gbps, " GB/s");
  c.tokens = 1;  // a file needs its tokens
  const auto saved = fsdp::Calibration::from_json(c.to_json());
  WORKER_CHECK(saved.link_ranks_per_host == 2 && saved.intra_link_gbps == c.intra_link_gbps &&
                   saved.intra_link_latency_us == c.intra_link_latency_us,
               "the link within a host does not survive a file");
  pg->set_network_model(fsdp::NetworkModel()
                            .intra(fsdp::Link().bandwidth_gbps(intra))
                            .inter(fsdp::Link().bandwidth_gbps(inter))
                            .ranks_per_host(1));
  fsdp::Calibration one;
  fsdp::calibrate_link(one, *pg);  // one rank per host: one link
  WORKER_CHECK(one.link_ranks_per_host == 0 && one.intra_link_gbps == 0,
               "one rank per host timed a host link: ", one.intra_link_gbps, " GB/s");
  if (pg->rank() == 0) std::cout << "host links calibrated" << std::endl;
}

TEST(PlannerLink, CalibrateLinkOverAProcessGroupTimesTheLinkWithinAHost) {
  auto r = launch("host_link_calibration_worker", 4);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "host links calibrated")) << r.report();
}

// The one candidate of `strategy` (HYBRID_SHARD: groups of 2) by block at world 4 of LinearBlocks
// under calibration `c`.
fsdp::TimePrediction predicted(const fsdp::Calibration& c,
                               fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard) {
  fsdp::DeferredInit deferred;
  LinearBlocks model(256, 4);
  const auto request = fsdp::PlanRequest()
                           .world(4)
                           .global_batch(4)
                           .seq_len(8)
                           .micro_batches({1})
                           .strategies({strategy})
                           .hybrid_factors({2})
                           .reshard_after_forward_sizes({0})
                           .wrap_policies({{"block", fsdp::wrap::by_type<torch::nn::SequentialImpl>()}})
                           .activation_checkpointing({false})
                           .cpu_offload({false})
                           .precisions({at::kFloat})
                           .calibration(c);
  const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x4"), request);
  EXPECT_EQ(plan.entries.size(), 1U) << plan.table();
  return plan.entries.empty() ? fsdp::TimePrediction() : plan.entries.front().time;
}

fsdp::TimePrediction predicted(double link_gbps, double link_copy_gbps) {
  fsdp::Calibration c;
  c.link_gbps = link_gbps;
  c.link_copy_gbps = link_copy_gbps;
  return predicted(c);
}

TEST(PlannerLink, BeneathASlowerModeledLinkOnlyTheCopiesTakeTheComputeCores) {
  // Without a copy rate, every collective runs on the compute thread: all of it exposed.
  const auto all = predicted(0.5, 0);
  EXPECT_GT(all.exposed_comm_s, 0);
  EXPECT_NEAR(all.step_s, all.compute_s + all.exposed_comm_s, 1e-12);
  // A link at a quarter of the copy rate: a quarter of each collective is copying on the compute
  // thread; the rest is on the link, and what of it the computation covers is not exposed.
  const auto overlapped = predicted(0.5, 2);
  EXPECT_EQ(overlapped.compute_s, all.compute_s);
  EXPECT_GE(overlapped.exposed_comm_s, 0.25 * all.exposed_comm_s - 1e-12);
  EXPECT_LT(overlapped.exposed_comm_s, all.exposed_comm_s);
  EXPECT_LT(overlapped.step_s, all.step_s);
  // A copy rate no faster than the link: nothing overlaps.
  const auto slower = predicted(0.5, 0.4);
  EXPECT_EQ(slower.exposed_comm_s, all.exposed_comm_s);
}

// A FULL_SHARD by block plan at world 4 of the tiny transformer under a modeled link of `link_gbps`
// over a transport copying at 2 GB/s, with `runtime`'s timings.
fsdp::TimePrediction predicted_with(double link_gbps, const std::vector<fsdp::RuntimeTiming>& runtime) {
  fsdp::DeferredInit deferred;
  TinyTransformer model(50, 16, 2, 3, 8);
  fsdp::Calibration c;
  c.link_gbps = link_gbps;
  c.link_latency_us = 10;
  c.link_copy_gbps = 2;
  c.link_copy_latency_us = 5;
  c.runtime = runtime;
  c.tokens = 16;  // a file needs its tokens
  const auto request = fsdp::PlanRequest()
                           .world(4)
                           .global_batch(8)
                           .seq_len(8)
                           .micro_batches({2})
                           .strategies({fsdp::ShardingStrategy::kFullShard})
                           .reshard_after_forward_sizes({0})
                           .wrap_policies({{"block", fsdp::wrap::by_type<BlockImpl>()}})
                           .activation_checkpointing({false})
                           .cpu_offload({false})
                           .precisions({at::kFloat})
                           .calibration(fsdp::Calibration::from_json(c.to_json()));  // through a file
  const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x4"), request);
  EXPECT_EQ(plan.entries.size(), 1U) << plan.table();
  return plan.entries.empty() ? fsdp::TimePrediction() : plan.entries.front().time;
}

TEST(PlannerLink, WaitsTimedBeneathAModeledLinkStandBesideItsTime) {
  fsdp::RuntimeTiming beneath;  // the flags' configuration on the transport beneath the model
  beneath.wrap = "block";
  beneath.world = 4;
  beneath.micro_batch = 2;
  beneath.forward_s = 0.050;
  beneath.backward_s = 0.100;
  beneath.exposed_s = 0.030;
  beneath.beneath_network_model = true;
  // A modeled link almost as fast as the copies: the replay exposes what the timing beneath it measured.
  const auto near_copy = predicted_with(1.999, {beneath});
  EXPECT_NEAR(near_copy.exposed_comm_s, beneath.exposed_s, 0.01 * beneath.exposed_s);
  // A link far slower than the waits per collective: they pass while the link works, and change nothing.
  const auto slow_plain = predicted_with(0.00005, {}), slow = predicted_with(0.00005, {beneath});
  EXPECT_GT(slow_plain.exposed_comm_s, 10 * beneath.exposed_s);
  EXPECT_NEAR(slow.step_s, slow_plain.step_s, 1e-12 * slow_plain.step_s);
  // Between the two, the waits show where the link would have been faster.
  const auto middle_plain = predicted_with(0.05, {}), middle = predicted_with(0.05, {beneath});
  EXPECT_GT(middle.exposed_comm_s, middle_plain.exposed_comm_s + 1e-6);
  EXPECT_LT(middle.exposed_comm_s, middle_plain.exposed_comm_s + beneath.exposed_s);
}

// World 4 over a transport copying at 2 GB/s whose world group was timed at `world_gbps`; with
// `intra_gbps` (0: not calibrated), as two hosts of two ranks, each host's own link at that.
fsdp::TimePrediction predicted_on_hosts(fsdp::ShardingStrategy strategy, double world_gbps, double intra_gbps) {
  fsdp::Calibration c;
  c.link_gbps = world_gbps;
  c.link_copy_gbps = 2;
  c.link_ranks_per_host = intra_gbps > 0 ? 2 : 0;
  c.intra_link_gbps = intra_gbps;
  return predicted(c, strategy);
}

TEST(PlannerLink, GroupsWithinAHostUseTheHostsCalibratedLink) {
  // One rank per host at 0.05 GB/s each, against two hosts of two ranks whose ranks have 0.05 GB/s
  // links each: there the world group's two rings run at 0.1, HYBRID_SHARD's shard groups (each
  // host's two ranks) at the host's link, and only its replica all-reduce crosses hosts, on one
  // rank's link.
  const auto one_link = predicted_on_hosts(fsdp::ShardingStrategy::kHybridShard, 0.05, 0);
  const auto hosts = predicted_on_hosts(fsdp::ShardingStrategy::kHybridShard, 0.1, 1.0);
  EXPECT_EQ(hosts.compute_s, one_link.compute_s);
  EXPECT_LT(hosts.exposed_comm_s, 0.5 * one_link.exposed_comm_s);
  EXPECT_GT(hosts.exposed_comm_s, 0);
  // The replica all-reduce runs at one rank's share of the world group's link: slower than at all of it.
  const auto hosts_unknown = predicted_on_hosts(fsdp::ShardingStrategy::kHybridShard, 0.1, 0);
  const auto fast_replicas = predicted_on_hosts(fsdp::ShardingStrategy::kHybridShard, 0.2, 1.0);
  EXPECT_GT(hosts.exposed_comm_s, fast_replicas.exposed_comm_s);
  EXPECT_NE(hosts.exposed_comm_s, hosts_unknown.exposed_comm_s);
  // FULL_SHARD's groups span the hosts: the host's link changes nothing.
  const auto full = predicted_on_hosts(fsdp::ShardingStrategy::kFullShard, 0.1, 0);
  const auto full_hosts = predicted_on_hosts(fsdp::ShardingStrategy::kFullShard, 0.1, 1.0);
  EXPECT_EQ(full_hosts.step_s, full.step_s);
  EXPECT_EQ(full_hosts.exposed_comm_s, full.exposed_comm_s);
}

}  // namespace
}  // namespace fsdp_test
