// CUDA path (built only against a CUDA LibTorch): the NCCL communicator, stream ordering, and
// FSDP on a GPU against plain LibTorch training of the same model. World size 1 on one device:
// NCCL refuses two ranks on one GPU. Skipped where no CUDA device is visible.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>

#include <torch/torch.h>
#include <map>

#include "fsdp/fsdp.h"
#include "harness.h"
#include "model.h"

namespace {

using fsdp_test::kGpu;
using fsdp_test::rel_diff;

fsdp::ProcessGroupPtr gpu_group() {
  fsdp::ProcessGroupOptions o;
  o.device = kGpu;
  return fsdp::ProcessGroup::create(fsdp::RankEnv{}, o);
}

TEST(Gpu, NcclCollectivesAtWorld1) {
  REQUIRE_GPU();
  auto pg = gpu_group();
  auto comm = pg->world();
  EXPECT_EQ(comm->transport(), "NCCL");
  EXPECT_TRUE(comm->device().is_cuda());
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kDouble}) {
    auto opts = torch::TensorOptions().dtype(dtype).device(kGpu);
    auto in = torch::arange(1000, opts);
    auto out = torch::empty({1000}, opts);
    comm->all_gather_into(out, in)->wait();
    EXPECT_TRUE(out.equal(in)) << dtype;
    auto rs_out = torch::empty({1000}, opts);
    comm->reduce_scatter(rs_out, in.clone())->wait();
    EXPECT_TRUE(rs_out.equal(in)) << dtype;
    auto t = in.clone();
    comm->all_reduce(t)->wait();
    comm->broadcast(t, 0)->wait();
    EXPECT_TRUE(t.equal(in)) << dtype;
    ASSERT_TRUE(comm->has_all_to_all());
    auto a2a_out = torch::empty({1000}, opts);
    comm->all_to_all_into(a2a_out, in)->wait();  // grouped send and receive to itself
    EXPECT_TRUE(a2a_out.equal(in)) << dtype;
  }
  auto packed = torch::randint(0, 256, {4096}, torch::TensorOptions().dtype(torch::kByte).device(kGpu));
  auto packed_out = torch::empty_like(packed);
  comm->all_to_all_into(packed_out, packed)->wait();  // the quantized reductions' bytes
  EXPECT_TRUE(packed_out.equal(packed));
  comm->barrier();
}

// The collective runs on the communicator's own stream, after the work already queued on the
// caller's stream (a long matrix product writing its input), and the caller's stream reads the
// output only after wait(): no CPU synchronization anywhere, yet the result is exact.
TEST(Gpu, CollectivesAreOrderedWithTheCallersStreamByEvents) {
  REQUIRE_GPU();
  auto pg = gpu_group();
  auto comm = pg->world();
  auto opts = torch::TensorOptions().dtype(torch::kFloat).device(kGpu);
  auto a = torch::randn({4096, 4096}, opts);
  for (int round = 0; round < 5; ++round) {
    auto big = torch::mm(a, a);  // queued on the current stream, still running when the gather is issued
    auto in = big.narrow(0, 0, 1).reshape({-1}).contiguous();
    auto out = torch::empty_like(in);
    auto work = comm->all_gather_into(out, in);
    work->wait();  // the current stream waits for the gather's event; the CPU does not block
    auto expected = torch::mm(a.narrow(0, 0, 1), a).reshape({-1});
    EXPECT_LT(rel_diff(out, expected), 1e-4);
  }
  // A stream other than the default works the same way.
  auto side = c10::cuda::getStreamFromPool(false, 0);
  c10::cuda::CUDAStreamGuard guard(side);
  auto in = torch::full({4096}, 3.0, opts);
  auto out = torch::empty({4096}, opts);
  comm->all_gather_into(out, in)->wait();
  EXPECT_TRUE(out.eq(3.0).all().item<bool>());
}

TEST(Gpu, BadInputIsRefusedWithTheFix) {
  REQUIRE_GPU();
  auto pg = gpu_group();
  auto cpu = torch::ones({4});
  try {
    pg->world()->all_reduce(cpu)->wait();
    FAIL() << "a CPU tensor was accepted by the NCCL communicator";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be a contiguous tensor on cuda:0"), std::string::npos) << e.what();
  }
  torch::nn::Linear cpu_model(4, 4);
  try {
    fsdp::fully_shard(cpu_model, pg);
    FAIL() << "a CPU model was accepted by a CUDA process group";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("move the model to that device"), std::string::npos) << e.what();
  }
}

struct Trained {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;  // the full parameters after training, by name
};

gpt::GPTConfig small_gpt() {
  gpt::GPTConfig c;
  c.layers = 3, c.width = 96, c.heads = 4, c.context = 32;
  return c;
}

// Trains the GPT for `steps` AdamW steps on the same tokens: plain LibTorch (strategy empty) or FSDP.
Trained train(const std::string& strategy, torch::Dtype dtype, bool deferred, int steps = 5, bool fused = false) {
  const auto cfg = small_gpt();
  torch::manual_seed(7);
  torch::cuda::manual_seed_all(7);
  gpt::GPT model{nullptr};
  if (deferred) {
    fsdp::DeferredInit d;
    model = gpt::GPT(cfg);
  } else {
    model = gpt::GPT(cfg);
  }
  model->to(dtype);
  if (!deferred) model->to(kGpu);
  auto init = [cfg](const std::string& name, torch::nn::Module& m) {
    gpt::initialize(cfg, name, m);
  };
  std::shared_ptr<fsdp::FullyShardedModule> sharded;
  std::vector<at::Tensor> trained;
  if (strategy.empty()) {
    if (deferred) fsdp::materialize(*model, init, kGpu);
    for (const auto& kv : model->named_parameters())
      if (std::find_if(trained.begin(), trained.end(), [&](const at::Tensor& t) { return t.is_same(kv.value()); }) ==
          trained.end())
        trained.push_back(kv.value());
  } else {
    sharded = fsdp::fully_shard(model, gpu_group(),
                                fsdp::Options()
                                    .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                                    .auto_wrap_policy(fsdp::wrap::by_type<gpt::BlockImpl>())
                                    .param_init_fn(init));
    for (const auto& kv : sharded->named_parameters()) trained.push_back(kv.second);
  }
  std::unique_ptr<torch::optim::Optimizer> opt_ptr;
  if (fused)
    opt_ptr = std::make_unique<fsdp::FusedAdamW>(trained, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  else
    opt_ptr = std::make_unique<torch::optim::AdamW>(trained, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  torch::optim::Optimizer& opt = *opt_ptr;
  auto gen = at::cuda::detail::createCUDAGenerator(0);
  gen.set_current_seed(11);
  Trained out;
  for (int s = 0; s < steps; ++s) {
    auto tokens = torch::randint(0, cfg.vocab_size, {4, cfg.context + 1}, gen,
                                 torch::TensorOptions().dtype(torch::kLong).device(kGpu));
    opt.zero_grad();
    auto logits = model->forward(tokens.narrow(1, 0, cfg.context));
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, cfg.vocab_size}).to(torch::kFloat),
                                          tokens.narrow(1, 1, cfg.context).reshape({-1}));
    loss.backward();
    opt.step();
    out.losses.push_back(loss.item<double>());
    if (fused) {
      EXPECT_TRUE(static_cast<fsdp::FusedAdamW&>(opt).last_step_fused());
    }
  }
  if (sharded) {
    for (const auto& kv : sharded->full_state_dict()) out.params[kv.first] = kv.second.to(torch::kCPU);
  } else {
    for (const auto& kv : model->named_parameters()) out.params[kv.key()] = kv.value().detach().to(torch::kCPU);
  }
  return out;
}

// Every parameter both runs report (the tied weight may appear under one name only) within `tol`.
void expect_same_parameters(const Trained& got, const Trained& expected, double tol) {
  int compared = 0;
  for (const auto& [name, p] : expected.params) {
    auto it = got.params.find(name);
    if (it == got.params.end()) continue;
    EXPECT_LT(rel_diff(it->second, p), tol) << name;
    ++compared;
  }
  EXPECT_GE(compared, 3 * 12) << "too few parameters compared";
}

class GpuStrategyTest : public ::testing::TestWithParam<std::string> {};

// Every strategy at world 1 on the GPU trains exactly as plain LibTorch does on the same device.
TEST_P(GpuStrategyTest, MatchesLocalTrainingOnTheDevice) {
  REQUIRE_GPU();
  const auto local = train("", torch::kFloat, /*deferred=*/false);
  const auto fsdp_run = train(GetParam(), torch::kFloat, /*deferred=*/false);
  ASSERT_EQ(local.losses.size(), fsdp_run.losses.size());
  for (size_t i = 0; i < local.losses.size(); ++i)
    EXPECT_NEAR(fsdp_run.losses[i], local.losses[i], 1e-5 * std::abs(local.losses[i])) << "step " << i;
  EXPECT_GT(local.losses.front() - local.losses.back(), 0.0) << "training did not lower the loss";
  expect_same_parameters(fsdp_run, local, 1e-5);
}
INSTANTIATE_TEST_SUITE_P(Strategies, GpuStrategyTest, ::testing::Values("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"));

// fsdp::FusedAdamW over FSDP's shards computes what LibTorch's AdamW computes over the plain model.
// In float64: Adam divides by sqrt(v), which turns the kernels' different rounding into visible
// differences where a gradient is near zero (1e-3 relative after 6 steps in float32); in float64
// that stays far below what a wrong term (a missing weight decay: ~1e-4 here) would leave.
TEST(Gpu, FusedAdamWOverShardsMatchesAdamW) {
  REQUIRE_GPU();
  const auto local = train("", torch::kDouble, /*deferred=*/false, /*steps=*/6, /*fused=*/false);
  const auto fused = train("FULL_SHARD", torch::kDouble, /*deferred=*/false, /*steps=*/6, /*fused=*/true);
  for (size_t i = 0; i < local.losses.size(); ++i)
    EXPECT_NEAR(fused.losses[i], local.losses[i], 1e-10 * std::abs(local.losses[i])) << "step " << i;
  expect_same_parameters(fused, local, 1e-8);
}

// bf16 end to end with deferred initialization on the device: the same weights and losses as the
// plain model built the same way.
TEST(Gpu, Bf16DeferredInitFullShardMatchesLocal) {
  REQUIRE_GPU();
  const auto local = train("", torch::kBFloat16, /*deferred=*/true);
  const auto fsdp_run = train("FULL_SHARD", torch::kBFloat16, /*deferred=*/true);
  for (size_t i = 0; i < local.losses.size(); ++i)
    EXPECT_NEAR(fsdp_run.losses[i], local.losses[i], 2e-2 * std::abs(local.losses[i])) << "step " << i;
  EXPECT_LT(std::abs(fsdp_run.losses[0] - local.losses[0]), 1e-6 * std::abs(local.losses[0]))
      << "the first step's loss depends only on the initial weights, which must be identical";
}

// FSDP's transient buffers come from PyTorch's caching allocator and are given back when a unit
// is resharded: the parameter peak is the shards + the unsharded units the rate limiter allows,
// and the allocator's figures are reported.
TEST(Gpu, MemoryFiguresComeFromTheCachingAllocator) {
  REQUIRE_GPU();
  const auto cfg = small_gpt();
  torch::manual_seed(3);
  gpt::GPT model(cfg);
  model->to(kGpu);
  auto sharded = fsdp::fully_shard(model, gpu_group(),
                                   fsdp::Options()
                                       .sharding_strategy(fsdp::ShardingStrategy::kFullShard)
                                       .auto_wrap_policy(fsdp::wrap::by_type<gpt::BlockImpl>()));
  fsdp::reset_device_peak_memory_stats(kGpu);
  sharded->reset_peak_memory_stats();
  auto tokens =
      torch::randint(0, cfg.vocab_size, {2, cfg.context}, torch::TensorOptions().dtype(torch::kLong).device(kGpu));
  model->forward(tokens).sum().backward();
  const auto dev = fsdp::device_memory_stats(kGpu);
  ASSERT_TRUE(dev.available);
  const auto mem = sharded->memory_stats();
  EXPECT_GT(dev.allocated_peak_bytes, mem.param_peak_bytes);
  EXPECT_GE(dev.reserved_peak_bytes, dev.allocated_peak_bytes);
  // After backward every block unit is resharded: only shards (and the root, resharded too) remain.
  int64_t shard_bytes = 0;
  for (const auto& u : sharded->units()) shard_bytes += u.shard_bytes;
  EXPECT_EQ(mem.param_bytes, shard_bytes);
  EXPECT_FALSE(fsdp::device_memory_stats(torch::Device(torch::kCPU)).available);
}

}  // namespace
