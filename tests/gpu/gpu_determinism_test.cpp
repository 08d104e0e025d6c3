// Options::deterministic on the device: the same micro-batches give bit-identical parameters at
// world 1 (NCCL) and at worlds 2-4 sharing cuda:0 through the host-staged communicator, under every
// strategy and with bf16 compute. Skipped where no CUDA device is visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

constexpr int kDeviceMicroBatches = 12;  // the global batch: a fixed list, split into contiguous ranges
constexpr int kDeviceRows = 2;           // rows per micro-batch

// The device's own kernels must give a micro-batch the same bits on every rank: cuBLAS with a
// fixed workspace and PyTorch's deterministic algorithms.
const std::vector<std::string> kDeterministicEnv = {"CUBLAS_WORKSPACE_CONFIG=:4096:8", "FSDP_TIMEOUT_S=60"};

// args: strategy, output file, "fp32" or "bf16" (compute; float32 masters). Three AdamW steps of
// kDeviceMicroBatches micro-batches with clipping on cuda:0; rank 0 saves the full parameters.
FSDP_WORKER(gpu_deterministic_worker) {
  at::globalContext().setDeterministicAlgorithms(true, false);
  fsdp::ProcessGroupOptions group;
  group.device = kGpu;
  auto pg = fsdp::ProcessGroup::from_env(group);
  const std::string strategy = ctx.args.at(0), out = ctx.args.at(1);
  const bool bf16 = ctx.args.at(2) == "bf16";
  torch::manual_seed(3);
  TinyTransformer model(32, 16, 2, 3, 8);
  model->to(kGpu);
  auto options = block_unit_options(strategy).deterministic(true);
  if (bf16) options.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  auto sharded = fsdp::fully_shard(model, pg, options);
  for (const auto& p : sharded->parameters()) WORKER_CHECK(p.device() == kGpu, "a piece is on ", p.device());
  torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(1e-2));
  const int begin = kDeviceMicroBatches * ctx.rank / ctx.world;
  const int end = kDeviceMicroBatches * (ctx.rank + 1) / ctx.world;
  const int passes = (kDeviceMicroBatches + ctx.world - 1) / ctx.world;  // forwards are collective
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    for (int m = 0; m < passes; ++m) {
      const int i = begin + m;
      const bool real = i < end;
      const auto x =
          at::randint(0, 32, {kDeviceRows, 8}, at::detail::createCPUGenerator(1000 * step + (real ? i : 0))).to(kGpu);
      sharded->set_requires_gradient_sync(m == passes - 1);
      sharded->set_backward_counted(real);
      loss_of(model, x).backward();  // not divided: deterministic mode averages over micro-batches
    }
    sharded->set_backward_counted(true);
    const double norm = sharded->clip_grad_norm_(0.05);
    WORKER_CHECK(norm > 0.05, "the test must clip: norm ", norm);
    opt.step();
  }
  const std::vector<at::Tensor> values = full_tensors_by_name(*sharded);
  if (ctx.rank != 0) return;
  torch::save(values, out);
  std::cout << strategy << " world " << ctx.world << " " << ctx.args.at(2) << " saved " << values.size()
            << " parameters" << std::endl;
}

std::vector<at::Tensor> train_on_device(const std::string& strategy, int world, const std::string& out,
                                        const std::string& precision) {
  std::vector<std::string> env = kDeterministicEnv;
  if (world > 1) env.push_back("FSDP_TRANSPORT=shm");  // ranks share cuda:0: host-staged collectives
  auto r = launch("gpu_deterministic_worker", world, {strategy, out, precision}, 300, env);
  EXPECT_TRUE(r.all_ok()) << strategy << " world " << world << " " << precision << "\n" << r.report();
  std::vector<at::Tensor> values;
  if (r.all_ok()) torch::load(values, out);
  return values;
}

TEST(GpuDeterminism, EveryWorldAndStrategyGivesTheParametersOfOneRank) {
  REQUIRE_GPU();
  TempDir dir;
  for (const char* precision : {"fp32", "bf16"}) {
    const auto reference = train_on_device("FULL_SHARD", 1, dir / "reference.pt", precision);
    ASSERT_FALSE(reference.empty()) << precision;
    struct Case {
      const char* strategy;
      int world;
    };
    for (const Case c : {Case{"FULL_SHARD", 2}, Case{"FULL_SHARD", 3}, Case{"SHARD_GRAD_OP", 2}, Case{"NO_SHARD", 3},
                         Case{"HYBRID_SHARD", 4}}) {
      const auto got = train_on_device(c.strategy, c.world, dir / "run.pt", precision);
      EXPECT_TRUE(bit_identical(got, reference))
          << c.strategy << " at world " << c.world << " (" << precision << ") differs from world 1";
    }
  }
}

}  // namespace
}  // namespace fsdp_test
