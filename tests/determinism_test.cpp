// Options::deterministic: the same micro-batches give bit-identical parameters at every world size,
// sharding strategy and transport, with gradient accumulation, clipping and mixed precision.
#include <gtest/gtest.h>

#include <algorithm>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

constexpr int kMicroBatches = 12;  // the global batch: a fixed list, split into contiguous ranges
constexpr int kRows = 2;           // rows per micro-batch

// args: strategy, output file, "fp32" or "bf16" (mixed precision), "deterministic" or "default".
// Trains a float32 TinyTransformer for 3 steps of kMicroBatches micro-batches (AdamW, clipping
// below the norm); rank 0 saves the full parameters in name order.
FSDP_WORKER(deterministic_worker) {
  at::set_num_threads(1);  // a micro-batch's forward and backward: the same bits on every rank
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0), out = ctx.args.at(1);
  const bool bf16 = ctx.args.at(2) == "bf16", deterministic = ctx.args.at(3) == "deterministic";
  torch::manual_seed(3);
  TinyTransformer model(32, 16, 2, 3, 8);
  auto options = block_unit_options(strategy).deterministic(deterministic);
  if (bf16) options.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kBFloat16));
  auto sharded = fsdp::fully_shard(model, pg, options);
  torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(1e-2));
  const int begin = kMicroBatches * ctx.rank / ctx.world, end = kMicroBatches * (ctx.rank + 1) / ctx.world;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    for (int i = begin; i < end; ++i) {
      const auto x = at::randint(0, 32, {kRows, 8}, at::detail::createCPUGenerator(1000 * step + i));
      sharded->set_requires_gradient_sync(i == end - 1);  // accumulate locally, reduce once
      at::Tensor loss = loss_of(model, x);
      // Deterministic mode averages over micro-batches itself; the default averages over ranks.
      if (!deterministic) loss = loss / (end - begin);
      loss.backward();
    }
    const double norm = sharded->clip_grad_norm_(0.05);
    WORKER_CHECK(norm > 0.05, "the test must clip: norm ", norm);
    opt.step();
  }
  auto full = sharded->full_state_dict();
  if (ctx.rank != 0) return;
  std::vector<std::string> names;
  for (const auto& kv : full) names.push_back(kv.first);
  std::sort(names.begin(), names.end());
  std::vector<at::Tensor> values;
  for (const auto& n : names) values.push_back(full.at(n).contiguous());
  torch::save(values, out);
  std::cout << "saved " << values.size() << " parameters" << std::endl;
}

std::vector<at::Tensor> train(const std::string& strategy, int world, const std::string& out,
                              const std::string& precision = "fp32", const std::string& mode = "deterministic",
                              const std::string& transport = "shm") {
  auto r =
      launch("deterministic_worker", world, {strategy, out, precision, mode}, 300, {"FSDP_TRANSPORT=" + transport});
  EXPECT_TRUE(r.all_ok()) << strategy << " world " << world << "\n" << r.report();
  std::vector<at::Tensor> values;
  if (r.all_ok()) torch::load(values, out);
  return values;
}

bool bit_identical(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size() || a.empty()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

TEST(Determinism, EveryWorldSizeAndStrategyGivesTheParametersOfOneRank) {
  TempDir dir;
  const auto reference = train("FULL_SHARD", 1, dir / "reference.pt");
  ASSERT_FALSE(reference.empty());
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"})
    for (int world : {2, 3, 4}) {
      const auto got = train(strategy, world, dir / "run.pt");
      EXPECT_TRUE(bit_identical(got, reference)) << strategy << " at world " << world << " differs from world 1";
    }
  EXPECT_TRUE(bit_identical(train("HYBRID_SHARD", 4, dir / "hybrid.pt"), reference)) << "HYBRID_SHARD at world 4";
}

TEST(Determinism, GlooAndMixedPrecisionGiveTheParametersOfOneRank) {
  TempDir dir;
  const auto reference = train("FULL_SHARD", 1, dir / "reference.pt");
  EXPECT_TRUE(bit_identical(train("FULL_SHARD", 3, dir / "tcp.pt", "fp32", "deterministic", "tcp"), reference))
      << "FULL_SHARD over TCP at world 3";
  const auto bf16 = train("FULL_SHARD", 1, dir / "bf16.pt", "bf16");
  ASSERT_FALSE(bf16.empty());
  for (int world : {2, 4})
    EXPECT_TRUE(bit_identical(train("SHARD_GRAD_OP", world, dir / "bf16_run.pt", "bf16"), bf16))
        << "bf16 SHARD_GRAD_OP at world " << world;
}

}  // namespace
}  // namespace fsdp_test
