// Parameters frozen at fully_shard() and unfrozen later, and autograd::grad with respect to the
// parameters, on CUDA parameters, on one GPU, on the device and offloaded: as
// tests/frozen_parameters_test.cpp and tests/parameter_gradients_test.cpp on the CPU. Skipped where
// no CUDA device is visible.
#include <gtest/gtest.h>

#include <iostream>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: strategy, "1" to offload the shards, which layer is frozen at fully_shard() ("0": the
// first, whose gradient comes last; "6": the last, whose gradient comes first).
FSDP_WORKER(gpu_unfreezing_worker) {
  const std::string strategy = ctx.args.at(0), layer = ctx.args.at(2);
  const bool offload = ctx.args.at(1) == "1";
  fsdp::ProcessGroupOptions pgo;
  pgo.device = kGpu;
  auto pg = fsdp::ProcessGroup::from_env(pgo);
  auto ref = four_linears(kGpu), model = four_linears(kGpu);
  auto set_frozen = [&](torch::nn::Sequential& m, bool frozen) {
    for (auto& p : m[std::stoul(layer)]->parameters()) p.set_requires_grad(!frozen);
  };
  set_frozen(ref, true);
  set_frozen(model, true);
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
  if (offload) options.offload(fsdp::CpuOffload().params(true));
  auto sharded = fsdp::fully_shard(model, pg, options);
  const auto adamw = torch::optim::AdamWOptions(0.02);
  torch::optim::AdamW ref_opt(ref->parameters(), adamw), opt(sharded->parameters(), adamw);
  const int rows = 2;
  for (int step = 0; step < 5; ++step) {
    auto gen = at::detail::createCPUGenerator(step);
    const at::Tensor x = at::randn({rows * ctx.world, 5}, gen).to(kGpu, at::kDouble);
    const at::Tensor mine = x.narrow(0, ctx.rank * rows, rows);
    if (step == 2) {
      set_frozen(ref, false);
      set_frozen(model, false);
      const int64_t before = sharded->memory_stats().param_bytes;
      auto local = torch::autograd::grad({ref->forward(mine).pow(2).mean()}, ref->parameters());
      auto g = torch::autograd::grad({model->forward(mine).pow(2).mean()}, model->parameters());
      for (size_t i = 0; i < g.size(); ++i)
        WORKER_CHECK(rel_diff(g[i].cpu(), local[i].cpu()) < 1e-10, "autograd::grad: gradient ", i,
                     " is not this rank's own");
      WORKER_CHECK(sharded->memory_stats().param_bytes == before, "parameter bytes held after autograd::grad");
    }
    ref_opt.zero_grad();
    opt.zero_grad();
    ref->forward(x).pow(2).mean().backward();
    model->forward(mine).pow(2).mean().backward();
    ref_opt.step();
    opt.step();
  }
  const std::string label = strategy + " offload " + std::to_string(int(offload)) + " layer " + layer;
  expect_same_parameters(*ref, *sharded, 1e-10, label);
  if (ctx.rank == 0) std::cout << label << " ok" << std::endl;
}

TEST(GpuUnfreezing, ParametersFrozenAtFullyShardTrainOnceUnfrozenOnTheDeviceAndOffloaded) {
  REQUIRE_GPU();
  for (const auto& [strategy, world] :
       std::vector<std::pair<std::string, int>>{{"FULL_SHARD", 1}, {"FULL_SHARD", 3}, {"NO_SHARD", 2}})
    for (const char* layer : {"0", "6"})
      for (const char* offload : {"0", "1"}) {
        const std::vector<std::string> env = world > 1
                                                 ? std::vector<std::string>{"FSDP_TRANSPORT=shm", "FSDP_TIMEOUT_S=30"}
                                                 : std::vector<std::string>{};
        auto r = launch("gpu_unfreezing_worker", world, {strategy, offload, layer}, 120, env);
        EXPECT_TRUE(r.all_ok()) << strategy << " world " << world << " offload " << offload << " layer " << layer
                                << "\n"
                                << r.report();
      }
}

}  // namespace
}  // namespace fsdp_test
