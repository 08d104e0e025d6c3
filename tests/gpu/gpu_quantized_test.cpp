// Quantized communication on the device: int8 gathers and reductions at worlds 2-4 sharing cuda:0
// (the host-staged communicator's all-to-all) train as the same job does on the CPU, whose
// quantized training the CPU suite checks against an independent reference, and far from
// unquantized training. Skipped where no CUDA device is visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: "gpu" or "cpu", strategy, "int8" or "none", output file. An MLP whose Linear layers are
// units, every unit's gathers and reductions quantized (block 16); four SGD steps; rank 0 saves
// the full parameters.
FSDP_WORKER(gpu_quantized_worker) {
  const bool gpu = ctx.args.at(0) == "gpu";
  const std::string strategy = ctx.args.at(1), out = ctx.args.at(3);
  const bool quantized = ctx.args.at(2) == "int8";
  const torch::Device device = gpu ? kGpu : torch::Device(torch::kCPU);
  fsdp::ProcessGroupOptions group;
  group.device = device;
  auto pg = fsdp::ProcessGroup::from_env(group);
  torch::manual_seed(11);
  MLP model(6, 24, 5, 2);
  model->to(device);
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
  if (strategy == "HYBRID_SHARD") options.sharding_factor(2);
  if (quantized) {
    const auto every_unit =
        fsdp::Quantization::int8(16).units([](const std::string&, const torch::nn::Module&) { return true; });
    options.all_gather_quantization(every_unit).reduce_quantization(every_unit);
  }
  auto sharded = fsdp::fully_shard(model, pg, options);
  torch::optim::SGD opt(sharded->parameters(), 0.2);
  for (int step = 0; step < 4; ++step) {
    const at::Tensor x = at::randn({2 * ctx.world, 6}, at::detail::createCPUGenerator(90 + step));
    opt.zero_grad();
    model->forward(x.narrow(0, 2 * ctx.rank, 2).to(device)).pow(2).mean().backward();
    opt.step();
  }
  const std::vector<at::Tensor> values = full_tensors_by_name(*sharded);
  if (ctx.rank != 0) return;
  torch::save(values, out);
  std::cout << ctx.args.at(0) << " " << strategy << " " << ctx.args.at(2) << " world " << ctx.world << " via "
            << pg->world()->transport() << std::endl;
}

std::vector<at::Tensor> train(const std::string& where, const std::string& strategy, const std::string& quantize,
                              int world, const std::string& out) {
  auto r = launch("gpu_quantized_worker", world, {where, strategy, quantize, out}, 300,
                  {"FSDP_TRANSPORT=shm", "FSDP_TIMEOUT_S=60"});
  EXPECT_TRUE(r.all_ok()) << where << " " << strategy << " " << quantize << " world " << world << "\n" << r.report();
  std::vector<at::Tensor> values;
  if (r.all_ok()) {
    torch::load(values, out);
    std::cout << lines_starting_with(where, r.ranks[0].output);
  }
  return values;
}

double largest_rel_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, rel_diff(a[i], b[i]));
  return d;
}

TEST(GpuQuantized, Int8CollectivesThroughTheHostStagedAllToAllTrainAsOnTheCpu) {
  REQUIRE_GPU();
  TempDir dir;
  struct Case {
    const char* strategy;
    int world;
  };
  for (const Case c : {Case{"FULL_SHARD", 2}, Case{"FULL_SHARD", 3}, Case{"SHARD_GRAD_OP", 2}, Case{"NO_SHARD", 3},
                       Case{"HYBRID_SHARD", 4}}) {
    const auto on_gpu = train("gpu", c.strategy, "int8", c.world, dir / "gpu.pt");
    const auto on_cpu = train("cpu", c.strategy, "int8", c.world, dir / "cpu.pt");
    const auto unquantized = train("gpu", c.strategy, "none", c.world, dir / "plain.pt");
    ASSERT_FALSE(on_gpu.empty() || on_cpu.empty() || unquantized.empty()) << c.strategy << " world " << c.world;
    // The device's kernels differ from the CPU's in the last bits, which may move a value across a
    // rounding boundary of its block: a code step, far below what quantization itself changes.
    const double to_cpu = largest_rel_diff(on_gpu, on_cpu), to_plain = largest_rel_diff(on_gpu, unquantized);
    std::cout << c.strategy << " world " << c.world << ": " << to_cpu << " from the CPU's quantized run, " << to_plain
              << " from unquantized training on the device" << std::endl;
    EXPECT_LT(to_cpu, 1e-4) << c.strategy << " world " << c.world;
    EXPECT_GT(to_plain, 10 * std::max(to_cpu, 1e-7)) << c.strategy << " world " << c.world;
  }
}

}  // namespace
}  // namespace fsdp_test
