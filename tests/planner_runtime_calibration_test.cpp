// The planner's runtime calibration (fsdp::calibrate_runtime, include/fsdp/calibration.h): the FSDP
// runtime's passes timed at the job's world; the plan predicts the timed configuration as measured
// and charges the same per-unit work and waits to every other configuration of that precision.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "fsdp/cluster.h"
#include "fsdp/fsdp.h"
#include "fsdp/planner.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// Four ranks of this machine's preset with a memory bandwidth so high that the optimizer step
// takes no time: a plan's step is its passes.
fsdp::Cluster instant_step_cluster(int world) {
  return fsdp::Cluster::from_json(R"({"preset": "cpu", "ranks_per_node": )" + std::to_string(world) +
                                  R"(, "device": {"memory_gbps": 1e12}})");
}

fsdp::PlanRequest strategies_request(int world) {
  return fsdp::PlanRequest()
      .world(world)
      .global_batch(2 * world)
      .seq_len(8)
      .strategies(
          {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp, fsdp::ShardingStrategy::kNoShard})
      .wrap_policies({{"block", fsdp::wrap::by_type<BlockImpl>()}})
      .activation_checkpointing({false, true})
      .checkpointed_shares({1})
      .cpu_offload({false})
      .precisions({at::kFloat, at::kBFloat16})
      .micro_batches({2});
}

// A FULL_SHARD timing by block at world 4.
fsdp::RuntimeTiming timed_full_shard(double forward_s, double backward_s, double exposed_s) {
  fsdp::RuntimeTiming t;
  t.wrap = "block";
  t.world = 4;
  t.micro_batch = 2;
  t.forward_s = forward_s;
  t.backward_s = backward_s;
  t.exposed_s = exposed_s;
  return t;
}

std::map<std::string, fsdp::TimePrediction> times_by_candidate(const fsdp::Plan& plan) {
  std::map<std::string, fsdp::TimePrediction> out;
  for (const auto& e : plan.entries) out[e.candidate.describe()] = e.time;
  return out;
}

TEST(PlannerRuntimeCalibration, TheTimedConfigurationIsPredictedAsMeasured) {
  fsdp::DeferredInit deferred;
  TinyTransformer model(50, 16, 2, 3, 8);
  const auto cluster = instant_step_cluster(4);
  fsdp::Calibration calibration;
  calibration.runtime.push_back(timed_full_shard(0.050, 0.110, 0.020));
  calibration.runtime.back().step_s = 0.004;  // the step predicted at no time: all of it is the runtime's
  const auto corrected =
      times_by_candidate(fsdp::plan(*model, cluster, strategies_request(4).calibration(calibration)));
  const auto plain = times_by_candidate(fsdp::plan(*model, cluster, strategies_request(4)));
  ASSERT_EQ(corrected.size(), 12U);
  ASSERT_EQ(plain.size(), corrected.size());
  const std::string reference = "FULL_SHARD, wrap block, fp32, micro-batch 2 x 1";
  ASSERT_EQ(corrected.count(reference), 1U) << "no candidate described as " << reference;
  EXPECT_NEAR(corrected.at(reference).step_s, 0.164, 1e-9);
  EXPECT_NEAR(corrected.at(reference).exposed_comm_s, 0.020, 1e-9);
  for (const auto& [name, time] : corrected) {
    const bool fp32 = name.find("fp32") != std::string::npos;
    if (fp32) {  // the runtime's work and waits are charged to every configuration of the timed precision
      EXPECT_GT(time.step_s, plain.at(name).step_s + 0.054) << name;
      EXPECT_GT(time.exposed_comm_s, plain.at(name).exposed_comm_s) << name;
    } else {  // and to no other
      EXPECT_DOUBLE_EQ(time.step_s, plain.at(name).step_s) << name;
    }
  }
  // A timing made at another world is not used, and the table says so.
  auto elsewhere = calibration;
  elsewhere.runtime.front().world = 2;
  const auto other_world = fsdp::plan(*model, cluster, strategies_request(4).calibration(elsewhere));
  EXPECT_EQ(times_by_candidate(other_world).at(reference).step_s, plain.at(reference).step_s);
  EXPECT_TRUE(contains(other_world.table(), "made at world 2, not 4")) << other_world.table();
  // Recomputation repeats the forward's per-unit work: checkpointing costs more than without the correction.
  const std::string checkpointed = "FULL_SHARD, wrap block, checkpointed, fp32, micro-batch 2 x 1";
  ASSERT_EQ(corrected.count(checkpointed), 1U);
  EXPECT_GT(corrected.at(checkpointed).step_s - corrected.at(reference).step_s,
            plain.at(checkpointed).step_s - plain.at(reference).step_s + 1e-6);
}

// A runtime faster than the replay of its timed configuration (the copy's passes were timed slower
// than the runtime ran them): the difference scales the computation instead of taking a fixed
// amount from every unit, so a smaller micro-batch keeps its share and never computes in no time.
TEST(PlannerRuntimeCalibration, ARuntimeFasterThanItsReplayScalesTheComputation) {
  fsdp::DeferredInit deferred;
  TinyTransformer model(50, 16, 2, 3, 8);
  const auto cluster = instant_step_cluster(4);
  auto request = strategies_request(4)
                     .strategies({fsdp::ShardingStrategy::kFullShard})
                     .activation_checkpointing({false})
                     .precisions({at::kFloat})
                     .micro_batches({1, 2});
  const auto plain = times_by_candidate(fsdp::plan(*model, cluster, request));
  const std::string reference = "FULL_SHARD, wrap block, fp32, micro-batch 2 x 1";
  const std::string smaller = "FULL_SHARD, wrap block, fp32, micro-batch 1 x 2";
  ASSERT_EQ(plain.count(reference), 1U);
  ASSERT_EQ(plain.count(smaller), 1U);
  // Measured at the replay's passes less half their computation (the step takes no time), waits
  // not measured.
  const double compute = plain.at(reference).compute_s, measured = plain.at(reference).step_s - compute / 2;
  fsdp::Calibration calibration;
  calibration.runtime.push_back(timed_full_shard(measured / 3, 2 * measured / 3, -1));
  const auto corrected = times_by_candidate(fsdp::plan(*model, cluster, request.calibration(calibration)));
  EXPECT_NEAR(corrected.at(reference).compute_s, 0.5 * compute, 0.05 * compute);
  const double smaller_compute = plain.at(smaller).compute_s;
  EXPECT_NEAR(corrected.at(smaller).compute_s, 0.5 * smaller_compute, 0.05 * smaller_compute)
      << "plain " << smaller_compute;
}

// Two strategies timed: FSDP's work splits into a part per unit and a part per collective, so both
// timed configurations are predicted as measured, and SHARD_GRAD_OP, whose collectives lie between
// theirs, in between.
TEST(PlannerRuntimeCalibration, TwoTimedStrategiesSplitWorkPerUnitAndPerCollective) {
  fsdp::DeferredInit deferred;
  TinyTransformer model(50, 16, 2, 3, 8);
  const auto cluster = instant_step_cluster(4);
  fsdp::Calibration calibration;
  calibration.runtime.push_back(timed_full_shard(0.050, 0.110, -1));
  auto no_shard = timed_full_shard(0.040, 0.060, -1);
  no_shard.strategy = fsdp::ShardingStrategy::kNoShard;
  calibration.runtime.push_back(no_shard);
  const auto times = times_by_candidate(
      fsdp::plan(*model, cluster, strategies_request(4).activation_checkpointing({false}).calibration(calibration)));
  const double full = times.at("FULL_SHARD, wrap block, fp32, micro-batch 2 x 1").step_s;
  const double none = times.at("NO_SHARD, wrap block, fp32, micro-batch 2 x 1").step_s;
  const double grad_op = times.at("SHARD_GRAD_OP, wrap block, fp32, micro-batch 2 x 1").step_s;
  EXPECT_NEAR(full, 0.160, 1e-9);
  EXPECT_NEAR(none, 0.100, 1e-9);
  EXPECT_GT(grad_op, none + 0.01);
  EXPECT_LT(grad_op, full - 0.01);
}

// A third timing with fewer units (FULL_SHARD without wrapping) beside the two by block: what FSDP
// spends whatever the units is told apart from its work per unit, so all three timed configurations
// are predicted as measured, where the two by block alone charged it per unit and put the unwrapped
// model below its measurement.
TEST(PlannerRuntimeCalibration, AnotherUnitCountSplitsWorkPerPassFromWorkPerUnit) {
  fsdp::DeferredInit deferred;
  TinyTransformer model(50, 16, 2, 3, 8);
  const auto cluster = instant_step_cluster(4);
  const auto request = strategies_request(4)
                           .wrap_policies({{"block", fsdp::wrap::by_type<BlockImpl>()}, {"none", nullptr}})
                           .activation_checkpointing({false})
                           .precisions({at::kFloat});
  fsdp::Calibration by_block;
  by_block.runtime.push_back(timed_full_shard(0.050, 0.110, -1));
  auto no_shard = timed_full_shard(0.040, 0.060, -1);
  no_shard.strategy = fsdp::ShardingStrategy::kNoShard;
  by_block.runtime.push_back(no_shard);
  const std::string unwrapped = "FULL_SHARD, wrap none, fp32, micro-batch 2 x 1";
  const std::string full = "FULL_SHARD, wrap block, fp32, micro-batch 2 x 1";
  const std::string none = "NO_SHARD, wrap block, fp32, micro-batch 2 x 1";
  const auto two = times_by_candidate(fsdp::plan(*model, cluster, fsdp::PlanRequest(request).calibration(by_block)));
  ASSERT_EQ(two.count(unwrapped), 1U);
  // Measured 20 ms above what the work per unit gives it.
  const double measured = two.at(unwrapped).step_s + 0.020;
  auto three_timings = by_block;
  auto whole = timed_full_shard(measured / 3, 2 * measured / 3, -1);
  whole.wrap = "none";
  three_timings.runtime.push_back(whole);
  const auto three =
      times_by_candidate(fsdp::plan(*model, cluster, fsdp::PlanRequest(request).calibration(three_timings)));
  EXPECT_NEAR(three.at(full).step_s, 0.160, 1e-9);
  EXPECT_NEAR(three.at(none).step_s, 0.100, 1e-9);
  EXPECT_NEAR(three.at(unwrapped).step_s, measured, 1e-9);
  // The part per pass lifts every unwrapped candidate alike.
  const std::string grad_op = "SHARD_GRAD_OP, wrap none, fp32, micro-batch 2 x 1";
  EXPECT_GT(three.at(grad_op).step_s, two.at(grad_op).step_s + 0.010);
  // Timed below the work per unit's prediction, the unwrapped model cannot take a negative cost per
  // pass: the fit keeps its costs at zero or above and the by-block timings stay near as measured.
  auto faster = by_block;
  whole.forward_s = (measured - 0.040) / 3, whole.backward_s = 2 * (measured - 0.040) / 3;
  faster.runtime.push_back(whole);
  const auto below = times_by_candidate(fsdp::plan(*model, cluster, fsdp::PlanRequest(request).calibration(faster)));
  EXPECT_LT(below.at(unwrapped).step_s, two.at(unwrapped).step_s);
  EXPECT_GE(below.at(unwrapped).step_s, measured - 0.040 - 1e-9);
}

// Waits on peers follow the group a collective spans: a rank waits for the latest of its peers, so
// HYBRID_SHARD's collectives within two of four ranks block for less of the waits per second of
// computation than FULL_SHARD's among all four (the rest parked, ranks sharing the cores), and a
// timed HYBRID_SHARD configuration is still predicted as measured.
TEST(PlannerRuntimeCalibration, WaitsOnPeersShrinkWithTheGroupsCollectivesSpan) {
  fsdp::DeferredInit deferred;
  TinyTransformer model(50, 16, 2, 3, 8);
  const auto cluster = instant_step_cluster(4);
  const auto request = strategies_request(4)
                           .strategies({fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kHybridShard})
                           .hybrid_factors({2})
                           .activation_checkpointing({false})
                           .precisions({at::kFloat});
  fsdp::Calibration calibration;
  calibration.runtime.push_back(timed_full_shard(0.050, 0.110, 0.040));
  const auto waited =
      times_by_candidate(fsdp::plan(*model, cluster, fsdp::PlanRequest(request).calibration(calibration)));
  const auto plain = times_by_candidate(fsdp::plan(*model, cluster, request));
  const std::string full = "FULL_SHARD, wrap block, fp32, micro-batch 2 x 1";
  const std::string hybrid = "HYBRID_SHARD/2, wrap block, fp32, micro-batch 2 x 1";
  ASSERT_EQ(waited.count(full) + waited.count(hybrid), 2U);
  auto blocked_per_compute_s = [&](const std::string& name) {
    return (waited.at(name).exposed_comm_s - plain.at(name).exposed_comm_s) / waited.at(name).compute_s;
  };
  // A gather within two of four ranks blocks (H(2) - 1) / (H(4) - 1) as long as one among all four,
  // a reduce-scatter and its replica all-reduce twice that.
  const double pair = 0.5 / (1.0 / 2 + 1.0 / 3 + 1.0 / 4);
  const double ratio = blocked_per_compute_s(hybrid) / blocked_per_compute_s(full);
  EXPECT_GT(ratio, pair + 0.01);
  EXPECT_LT(ratio, 2 * pair - 0.01);
  // Parked or blocked, the waits take the step's time alike.
  EXPECT_NEAR(
      waited.at(hybrid).step_s - plain.at(hybrid).step_s - (waited.at(hybrid).compute_s - plain.at(hybrid).compute_s),
      (waited.at(full).step_s - plain.at(full).step_s - (waited.at(full).compute_s - plain.at(full).compute_s)) *
          waited.at(hybrid).compute_s / waited.at(full).compute_s,
      1e-9);
  fsdp::Calibration timed_hybrid;
  timed_hybrid.runtime.push_back(timed_full_shard(0.050, 0.110, 0.030));
  timed_hybrid.runtime.back().strategy = fsdp::ShardingStrategy::kHybridShard;
  timed_hybrid.runtime.back().sharding_factor = 2;
  const auto as_timed =
      times_by_candidate(fsdp::plan(*model, cluster, fsdp::PlanRequest(request).calibration(timed_hybrid)));
  EXPECT_NEAR(as_timed.at(hybrid).step_s, 0.160, 1e-9);
  EXPECT_NEAR(as_timed.at(hybrid).exposed_comm_s, 0.030, 1e-9);
}

// A configuration timed with its units checkpointed beside the same one without: the plan charges
// what checkpointing changed in each pass, per second of the forward it covered, so the timed
// checkpointed configuration is predicted as measured, and the copy's own checkpointed timings
// (here twice the forward more) no longer decide it.
TEST(PlannerRuntimeCalibration, ACheckpointedTimingGivesWhatCheckpointingChanges) {
  fsdp::DeferredInit deferred;
  TinyTransformer model(50, 16, 2, 3, 8);
  const auto cluster = instant_step_cluster(4);
  fsdp::Calibration calibration;
  calibration.tokens = 16;  // the timed micro-batch: 2 sequences of 8
  fsdp::PrecisionTiming copy{at::kFloat, 0.030, 0.060};
  copy.checkpointed_forward_s = 0.030;
  copy.checkpointed_backward_s = 0.120;
  calibration.timings.push_back(copy);
  calibration.runtime.push_back(timed_full_shard(0.050, 0.110, -1));
  const std::string plain = "FULL_SHARD, wrap block, fp32, micro-batch 2 x 1";
  const std::string checkpointed = "FULL_SHARD, wrap block, checkpointed, fp32, micro-batch 2 x 1";
  auto request = strategies_request(4).precisions({at::kFloat});
  const auto by_copy =
      times_by_candidate(fsdp::plan(*model, cluster, fsdp::PlanRequest(request).calibration(calibration)));
  auto with = timed_full_shard(0.040, 0.150, -1);  // no graph kept: 10 ms less; recomputed: 40 ms more
  with.activation_checkpointing = true;
  calibration.runtime.push_back(with);
  const auto measured =
      times_by_candidate(fsdp::plan(*model, cluster, fsdp::PlanRequest(request).calibration(calibration)));
  EXPECT_NEAR(measured.at(plain).step_s, 0.160, 1e-9);
  EXPECT_NEAR(measured.at(checkpointed).step_s, 0.190, 1e-9);
  EXPECT_NEAR(by_copy.at(plain).step_s, 0.160, 1e-9);
  EXPECT_NEAR(by_copy.at(checkpointed).step_s, 0.160 + 0.060, 1e-9);  // the copy's change
  // The checkpointed timing is not FSDP's work: every plain candidate is predicted as without it.
  for (const auto& [name, time] : measured) {
    if (name.find("checkpointed") == std::string::npos) {
      EXPECT_NEAR(time.step_s, by_copy.at(name).step_s, 1e-12) << name;
    }
  }
  const auto back = fsdp::Calibration::from_json(calibration.to_json());
  ASSERT_EQ(back.runtime.size(), 2U);
  EXPECT_FALSE(back.runtime[0].activation_checkpointing);
  EXPECT_TRUE(back.runtime[1].activation_checkpointing);
}

TEST(PlannerRuntimeCalibration, RuntimeTimingsSurviveAFileAndNameTheirWrapPolicy) {
  fsdp::Calibration calibration;
  auto timing = timed_full_shard(0.010, 0.020, 0.001);
  timing.strategy = fsdp::ShardingStrategy::kHybridShard;
  timing.sharding_factor = 2;
  timing.precision = at::kBFloat16;
  timing.backward_prefetch = fsdp::BackwardPrefetch::kBackwardPost;
  timing.all_gather_limit = 3;
  calibration.runtime.push_back(timing);
  calibration.tokens = 16;
  const auto back = fsdp::Calibration::from_json(calibration.to_json());
  ASSERT_NE(back.find_runtime(at::kBFloat16), nullptr);
  EXPECT_EQ(back.find_runtime(at::kFloat), nullptr);
  const auto& r = *back.find_runtime(at::kBFloat16);
  EXPECT_EQ(r.wrap, "block");
  EXPECT_EQ(r.strategy, fsdp::ShardingStrategy::kHybridShard);
  EXPECT_EQ(r.sharding_factor, 2);
  EXPECT_EQ(r.backward_prefetch, fsdp::BackwardPrefetch::kBackwardPost);
  EXPECT_EQ(r.all_gather_limit, 3);
  EXPECT_EQ(r.micro_batch, 2);
  EXPECT_EQ(r.world, 4);
  EXPECT_DOUBLE_EQ(r.forward_s, 0.010);
  EXPECT_DOUBLE_EQ(r.exposed_s, 0.001);
  EXPECT_THROW(fsdp::Calibration::from_json(
                   R"({"tokens": 1, "timings": [], "runtime": [{"wrap": "block", "strategy": "FULL_SHARD",
                       "precision": "fp32", "micro_batch": 1, "world": 1, "forward_s": 0, "backward_s": 1}]})"),
               fsdp::Error);

  // A plan whose wrap policies lack the timed one says which name is missing.
  fsdp::DeferredInit deferred;
  TinyTransformer model(50, 16, 2, 3, 8);
  fsdp::Calibration other;
  auto unnamed = timed_full_shard(0.01, 0.02, 0);
  unnamed.wrap = "by-size";
  other.runtime.push_back(unnamed);
  try {
    fsdp::plan(*model, instant_step_cluster(4), strategies_request(4).calibration(other));
    ADD_FAILURE() << "a runtime timing of an unknown wrap policy was accepted";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "\"by-size\"")) << e.what();
  }
  // Named as a calibration wrap policy, it is replayed for the correction but not searched.
  const auto plan = fsdp::plan(*model, instant_step_cluster(4),
                               strategies_request(4).calibration(other).calibration_wrap_policies(
                                   {{"by-size", fsdp::wrap::by_type<BlockImpl>()}}));
  for (const auto& e : plan.entries) EXPECT_EQ(e.candidate.wrap.name, "block");
}

// calibrate_runtime on a real sharded model: every rank gets the same figures, and the plan
// reproduces them for the configuration they time.
FSDP_WORKER(runtime_calibration_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(5);
  TinyTransformer model(50, 16, 2, 3, 8);
  auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>()));
  torch::manual_seed(11 + pg->rank());
  const auto x = torch::randint(50, {2, 8}, torch::kLong);
  fsdp::Calibration calibration;
  torch::optim::SGD sgd(sharded->parameters(), 0.01);
  fsdp::calibrate_runtime(
      calibration, *sharded, *pg, [&] { return loss_of(model, x); }, timed_full_shard(0, 0, -1), 3,
      [&] { sgd.step(); });
  WORKER_CHECK(calibration.runtime.size() == 1, "one timing expected, got ", calibration.runtime.size());
  const fsdp::RuntimeTiming r = calibration.runtime.front();
  WORKER_CHECK(r.world == pg->size(), "the timing's world is ", r.world, ", the job's ", pg->size());
  WORKER_CHECK(r.forward_s > 0 && r.backward_s > 0 && r.step_s > 0, "not timed: ", r.forward_s, " ", r.backward_s, " ",
               r.step_s);
  WORKER_CHECK(r.exposed_s >= 0 && r.exposed_s < r.forward_s + r.backward_s, "waits ", r.exposed_s, " of ",
               r.forward_s + r.backward_s, " s");
  const double values[] = {r.forward_s, r.backward_s, r.exposed_s, r.step_s};
  for (const double v : values) WORKER_CHECK(fsdp::mean_across_ranks(*pg, v) == v, "ranks disagree on ", v);
  fsdp::calibrate_runtime(
      calibration, *sharded, *pg, [&] { return loss_of(model, x); }, timed_full_shard(0, 0, -1));
  WORKER_CHECK(calibration.runtime.size() == 1 && calibration.runtime.front().step_s < 0,
               "a second timing of fp32 (without a step) must replace the first");
  // Short iterations are timed until min_timed_s (ten times the repetitions at most), every rank the same count.
  int calls = 0;
  fsdp::calibrate_runtime(
      calibration, *sharded, *pg, [&] { return ++calls, loss_of(model, x); }, timed_full_shard(0, 0, -1), 3, nullptr,
      1e3);
  WORKER_CHECK(calls == 31, "one untimed and thirty timed iterations expected, got ", calls);
  calls = 0;
  fsdp::calibrate_runtime(
      calibration, *sharded, *pg, [&] { return ++calls, loss_of(model, x); }, timed_full_shard(0, 0, -1), 3, nullptr,
      0);
  WORKER_CHECK(calls == 4, "one untimed and three timed iterations expected, got ", calls);

  auto wrong = timed_full_shard(0, 0, -1);
  wrong.strategy = fsdp::ShardingStrategy::kNoShard;
  bool refused = false;
  try {
    fsdp::calibrate_runtime(
        calibration, *sharded, *pg, [&] { return loss_of(model, x); }, wrong);
  } catch (const fsdp::Error& e) {
    refused = contains(e.what(), "FULL_SHARD") && contains(e.what(), "NO_SHARD");
  }
  WORKER_CHECK(refused, "a timing that describes another strategy than the copy's was not refused");

  fsdp::DeferredInit deferred;
  TinyTransformer shapes(50, 16, 2, 3, 8);
  calibration.runtime.front() = r;  // the timing with its step
  const auto& t = r;
  const auto plan = fsdp::plan(*shapes, instant_step_cluster(pg->size()),
                               strategies_request(pg->size())
                                   .strategies({fsdp::ShardingStrategy::kFullShard})
                                   .activation_checkpointing({false})
                                   .precisions({at::kFloat})
                                   .calibration(calibration));
  WORKER_CHECK(plan.entries.size() == 1, "one candidate expected, got ", plan.entries.size());
  const auto& time = plan.entries.front().time;
  const double measured = t.forward_s + t.backward_s + t.step_s;
  WORKER_CHECK(std::abs(time.step_s - measured) < 1e-6 * measured + 1e-9, "the timed configuration predicted at ",
               time.step_s, " s, measured ", measured);
  if (pg->rank() == 0)
    std::cout << "runtime calibration: forward " << t.forward_s * 1e3 << " ms, backward " << t.backward_s * 1e3
              << " ms, waits " << t.exposed_s * 1e3 << " ms" << std::endl;
}

TEST(PlannerRuntimeCalibration, CalibrateRuntimeTimesTheShardedPassesOnEveryRank) {
  auto r = launch("runtime_calibration_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "runtime calibration: forward")) << r.report();
}

// agree_across_ranks: per-rank calibrations become one (means of the times, the largest peaks);
// ranks that timed different precisions fail alike, naming the difference.
FSDP_WORKER(calibration_agreement_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int r = pg->rank(), n = pg->size();
  fsdp::Calibration c;
  c.step_s_per_element = 1e-9 * (r + 1);
  for (const auto precision : {at::kFloat, at::kBFloat16}) {
    fsdp::PrecisionTiming t;
    t.precision = precision;
    t.forward_s = 0.010 * (r + 1);
    t.backward_s = 0.020 * (r + 1);
    t.checkpointed_forward_s = 0.012 * (r + 1);
    t.checkpointed_backward_s = 0.030 * (r + 1);
    t.small_forward_s = 0.004 * (r + 1);
    t.small_backward_s = 0.008 * (r + 1);
    t.peak_bytes = 1000 + 100 * ((r + 1) % n);  // the largest on rank n - 2 (or 0 alone)
    t.checkpointed_peak_bytes = 500 - r;        // the largest on rank 0
    c.timings.push_back(t);
  }
  fsdp::QuantizationTiming q;
  q.pack_s = 4e-9 * (r + 1);
  q.pack_feedback_s = 9e-9 * (r + 1);
  q.unpack_s = 2e-9 * (r + 1);
  q.sum_s = 1e-9 * (r + 1);
  c.quantization.push_back(q);
  fsdp::agree_across_ranks(c, *pg->world());
  const double mean = (n + 1) / 2.0;  // the mean of r + 1 over the ranks
  auto near = [](double a, double b) {
    return std::abs(a - b) <= 1e-12 * std::abs(b);
  };
  WORKER_CHECK(near(c.step_s_per_element, 1e-9 * mean), "step_s_per_element ", c.step_s_per_element);
  for (const auto& t : c.timings) {
    WORKER_CHECK(near(t.forward_s, 0.010 * mean) && near(t.backward_s, 0.020 * mean) &&
                     near(t.checkpointed_forward_s, 0.012 * mean) && near(t.checkpointed_backward_s, 0.030 * mean) &&
                     near(t.small_forward_s, 0.004 * mean) && near(t.small_backward_s, 0.008 * mean),
                 "not the means: ", t.forward_s, " ", t.backward_s, " ", t.checkpointed_forward_s, " ",
                 t.checkpointed_backward_s, " ", t.small_forward_s, " ", t.small_backward_s);
    WORKER_CHECK(t.peak_bytes == 1000 + 100 * (n - 1) && t.checkpointed_peak_bytes == 500,
                 "not the largest peaks: ", t.peak_bytes, " ", t.checkpointed_peak_bytes);
  }
  const auto& agreed = c.quantization.front();
  WORKER_CHECK(near(agreed.pack_s, 4e-9 * mean) && near(agreed.pack_feedback_s, 9e-9 * mean) &&
                   near(agreed.unpack_s, 2e-9 * mean) && near(agreed.sum_s, 1e-9 * mean),
               "not the mean quantization rates: ", agreed.pack_s, " ", agreed.pack_feedback_s, " ", agreed.unpack_s,
               " ", agreed.sum_s);
  // The same bits on every rank.
  for (const double v : {c.timings[0].forward_s, c.timings[1].checkpointed_backward_s, c.step_s_per_element})
    WORKER_CHECK(fsdp::mean_across_ranks(*pg, v) == v, "ranks disagree on ", v);

  if (r == 0) c.quantization.clear();
  bool refused = false;
  try {
    fsdp::agree_across_ranks(c, *pg->world());
  } catch (const fsdp::Error& e) {
    refused = contains(e.what(), "quantization timing") && contains(e.what(), "CalibrateOptions::quantizations");
    if (!refused) std::cerr << e.what() << std::endl;
  }
  WORKER_CHECK(refused, "ranks with different numbers of quantization timings were not refused");
  c.quantization.clear();

  if (r == n - 1) c.timings.pop_back();
  refused = false;
  try {
    fsdp::agree_across_ranks(c, *pg->world());
  } catch (const fsdp::Error& e) {
    refused = contains(e.what(), "timing") && contains(e.what(), "same precisions");
    if (!refused) std::cerr << e.what() << std::endl;
  }
  WORKER_CHECK(refused, "ranks with different numbers of timings were not refused");
  c.timings.resize(1);
  c.timings[0].precision = r == 0 ? at::kFloat : at::kBFloat16;
  refused = false;
  try {
    fsdp::agree_across_ranks(c, *pg->world());
  } catch (const fsdp::Error& e) {
    refused = contains(e.what(), "BFloat16") && contains(e.what(), "Float");
    if (!refused) std::cerr << e.what() << std::endl;
  }
  WORKER_CHECK(refused, "ranks that timed different precisions were not refused");
  if (r == 0) std::cout << "calibrations agree" << std::endl;
}

TEST(PlannerRuntimeCalibration, AgreeAcrossRanksGivesEveryRankTheMeanTimesAndTheLargestPeaks) {
  auto r = launch("calibration_agreement_worker", 3);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "calibrations agree")) << r.report();
}

}  // namespace
}  // namespace fsdp_test
