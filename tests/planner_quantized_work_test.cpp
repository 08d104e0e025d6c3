// The planner's charge for quantized communication's own work (src/planner/quantized_work.h):
// fsdp::calibrate times the packing, unpacking and summing loops, and every prediction charges each
// loop per value where the runtime runs it. See Note [Planner quantized work] in docs/design.md.
#include <gtest/gtest.h>

#include <string>

#include "fsdp/cluster.h"
#include "fsdp/fsdp.h"
#include "fsdp/planner.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

constexpr int kWidth = 30;  // 7,350 parameters per block: padded at 4 ranks
constexpr int kDepth = 3;
constexpr int64_t kBlockNumel = 8 * kWidth * kWidth + 5 * kWidth;

// One candidate of `strategy` at 4 ranks of this machine, int8 gathers and reductions.
fsdp::PlanRequest quantized_request(fsdp::ShardingStrategy strategy, const fsdp::Calibration& calibration) {
  return fsdp::PlanRequest()
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
      .all_gather_quantization(fsdp::Quantization::int8())
      .reduce_quantization(fsdp::Quantization::int8())
      .calibration(calibration);
}

fsdp::Calibration with_rates(double pack_s, double unpack_s, double sum_s) {
  fsdp::Calibration c;
  fsdp::QuantizationTiming t;
  t.pack_s = t.pack_feedback_s = pack_s;
  t.unpack_s = unpack_s;
  t.sum_s = sum_s;
  c.quantization.push_back(t);
  return c;
}

fsdp::TimePrediction predicted(fsdp::ShardingStrategy strategy, const fsdp::Calibration& calibration) {
  fsdp::DeferredInit deferred;
  LinearBlocks model(kWidth, kDepth);
  const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x4"), quantized_request(strategy, calibration));
  EXPECT_EQ(plan.entries.size(), 1U) << plan.table();
  return plan.entries.empty() ? fsdp::TimePrediction() : plan.entries.front().time;
}

bool near(double a, double b) { return std::abs(a - b) <= 1e-9 * std::abs(b) + 1e-15; }

TEST(PlannerQuantizedWork, EachLoopIsChargedPerValueWhereTheRuntimeRunsIt) {
  const double pack = 1e-6, unpack = 1e-7, sum = 1e-8;
  const double k = kDepth;
  // On this machine the transports copy on the compute cores: the compute thread runs what FSDP
  // issues and waits for (compute_s), and collectives, an all-reduce owner's work included, take
  // its time as exposed communication.
  {  // SHARD_GRAD_OP: each block gathered once, in forward; its gradient reduce-scattered.
    const double padded = 7352, shard = padded / 4;
    const auto base = predicted(fsdp::ShardingStrategy::kShardGradOp, with_rates(0, 0, 0));
    const auto charged = predicted(fsdp::ShardingStrategy::kShardGradOp, with_rates(pack, unpack, sum));
    const double gathers = k * (shard * pack + padded * unpack), reductions = k * padded * (pack + sum);
    EXPECT_TRUE(near(charged.compute_s - base.compute_s, gathers + reductions))
        << charged.compute_s - base.compute_s << " against " << gathers + reductions;
    EXPECT_TRUE(near(charged.step_s - base.step_s, gathers + reductions));
  }
  {  // FULL_SHARD: gathered again in backward, but for the block backward starts with.
    const double padded = 7352, shard = padded / 4;
    const auto base = predicted(fsdp::ShardingStrategy::kFullShard, with_rates(0, 0, 0));
    const auto charged = predicted(fsdp::ShardingStrategy::kFullShard, with_rates(pack, unpack, sum));
    const double gathers = (2 * k - 1) * (shard * pack + padded * unpack), reductions = k * padded * (pack + sum);
    EXPECT_TRUE(near(charged.compute_s - base.compute_s, gathers + reductions))
        << charged.compute_s - base.compute_s << " against " << gathers + reductions;
  }
  {  // NO_SHARD: no gathers; each all-reduce packs and unpacks every value, its owner sums 4 parts
     // of a quarter and packs their sum between the two stages.
    const double values = static_cast<double>(kBlockNumel), part = std::ceil(values / 4);
    const auto base = predicted(fsdp::ShardingStrategy::kNoShard, with_rates(0, 0, 0));
    const auto charged = predicted(fsdp::ShardingStrategy::kNoShard, with_rates(pack, unpack, sum));
    const double issued = k * values * (pack + unpack), owners = k * part * (4 * sum + pack);
    EXPECT_TRUE(near(charged.compute_s - base.compute_s, issued))
        << charged.compute_s - base.compute_s << " against " << issued;
    EXPECT_TRUE(near(charged.step_s - base.step_s, issued + owners))
        << charged.step_s - base.step_s << " against " << issued + owners;
  }
  {  // HYBRID_SHARD/2: the replica all-reduce, chained to the reduce-scatter, lands it and packs its
     // values on the replica thread; the compute thread unpacks the sums.
    const double padded = 7350, shard = padded / 2, part = std::ceil(shard / 2);
    const auto base = predicted(fsdp::ShardingStrategy::kHybridShard, with_rates(0, 0, 0));
    const auto charged = predicted(fsdp::ShardingStrategy::kHybridShard, with_rates(pack, unpack, sum));
    const double on_compute = (2 * k - 1) * (shard * pack + padded * unpack) + k * (padded * pack + shard * unpack);
    const double on_replica_thread = k * (padded * sum + shard * pack + part * (2 * sum + pack));
    EXPECT_TRUE(near(charged.compute_s - base.compute_s, on_compute))
        << charged.compute_s - base.compute_s << " against " << on_compute;
    EXPECT_TRUE(near(charged.step_s - base.step_s, on_compute + on_replica_thread))
        << charged.step_s - base.step_s << " against " << on_compute + on_replica_thread;
  }
}

TEST(PlannerQuantizedWork, UncalibratedLoopsMoveTheirBytesAtTheMemoryBandwidth) {
  auto step = [](const std::string& gbps) {
    fsdp::DeferredInit deferred;
    LinearBlocks model(kWidth, kDepth);
    const auto cluster =
        fsdp::Cluster::from_json(R"({"preset": "cpu", "ranks_per_node": 4, "device": {"memory_gbps": )" + gbps + "}}");
    const auto request = quantized_request(fsdp::ShardingStrategy::kShardGradOp, fsdp::Calibration());
    const fsdp::Plan quantized = fsdp::plan(*model, cluster, request);
    const fsdp::Plan plain = fsdp::plan(*model, cluster,
                                        fsdp::PlanRequest(request)
                                            .all_gather_quantization(fsdp::Quantization())
                                            .reduce_quantization(fsdp::Quantization()));
    // The quantized step's compute beyond the plain one's: the loops (the optimizer step is the same).
    return quantized.entries.front().time.compute_s - plain.entries.front().time.compute_s;
  };
  const double slow = step("10"), fast = step("20");
  EXPECT_GT(slow, 0);
  EXPECT_TRUE(std::abs(slow - 2 * fast) <= 1e-9 * slow) << slow << " " << fast;
}

TEST(PlannerQuantizedWork, CalibrateTimesTheLoopsOfEachFormat) {
  torch::manual_seed(0);
  LinearBlocks model(64, 2);
  auto x = torch::randn({8, 64});
  const auto calibration = fsdp::calibrate(
      *model, [&] { return model->forward(x).square().mean(); }, 8,
      // Medians over 10 ms of runs each: packing with a residual is slower than without, beyond noise.
      fsdp::CalibrateOptions().min_timed_s(0.01).quantizations(
          {fsdp::Quantization::int8(), fsdp::Quantization::int8(64).error_feedback(true)}));
  ASSERT_EQ(calibration.quantization.size(), 2U);
  for (const auto& t : calibration.quantization) {
    EXPECT_EQ(t.dtype, fsdp::QuantizedDtype::kInt8);
    EXPECT_GT(t.pack_s, 0);
    EXPECT_GT(t.unpack_s, 0);
    EXPECT_GT(t.sum_s, 0);
    // With a residual, packing also adds it in, unpacks into it and subtracts: several more passes.
    EXPECT_GT(t.pack_feedback_s, t.pack_s);
  }
  EXPECT_EQ(calibration.quantization[0].block_size, 256);
  EXPECT_EQ(calibration.quantization[1].block_size, 64);
  // A plan looks up its format's block size, else another of the dtype.
  EXPECT_EQ(calibration.find_quantization(fsdp::QuantizedDtype::kInt8, 64), &calibration.quantization[1]);
  EXPECT_EQ(calibration.find_quantization(fsdp::QuantizedDtype::kInt8, 128), &calibration.quantization[0]);
  EXPECT_EQ(calibration.find_quantization(fsdp::QuantizedDtype::kFloat8E4M3, 256), nullptr);
  // The timings survive a file.
  const auto back = fsdp::Calibration::from_json(calibration.to_json());
  ASSERT_EQ(back.quantization.size(), 2U);
  for (size_t i = 0; i < 2; ++i) {
    const auto &a = calibration.quantization[i], &b = back.quantization[i];
    EXPECT_EQ(b.block_size, a.block_size);
    EXPECT_DOUBLE_EQ(b.pack_s, a.pack_s);
    EXPECT_DOUBLE_EQ(b.pack_feedback_s, a.pack_feedback_s);
    EXPECT_DOUBLE_EQ(b.unpack_s, a.unpack_s);
    EXPECT_DOUBLE_EQ(b.sum_s, a.sum_s);
  }
  EXPECT_THROW(
      {
        try {
          fsdp::Calibration::from_json(
              R"({"tokens": 8, "timings": [], "quantization": [{"dtype": "int8", "block_size": 256, "pack_s": -1,)"
              R"( "unpack_s": 0, "sum_s": 0}]})");
        } catch (const fsdp::Error& e) {
          EXPECT_TRUE(contains(e.what(), "must not be negative")) << e.what();
          throw;
        }
      },
      fsdp::Error);
}

}  // namespace
}  // namespace fsdp_test
