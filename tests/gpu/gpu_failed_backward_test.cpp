// A failure inside backward and gradients dropped between micro-batches, on CUDA parameters, on
// one GPU, on the device and offloaded: as tests/failed_backward_test.cpp and
// tests/no_sync_test.cpp on the CPU (reductions in flight and host copies of the shards'
// gradients are dropped, not landed). Skipped where no CUDA device is visible.
#include <gtest/gtest.h>

#include <iostream>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: strategy, "1" to offload the shards, case ("failed_backward" or "dropped_between").
FSDP_WORKER(gpu_failed_backward_worker) {
  const std::string strategy = ctx.args.at(0), what = ctx.args.at(2);
  const bool offload = ctx.args.at(1) == "1";
  fsdp::ProcessGroupOptions pgo;
  pgo.device = kGpu;
  auto pg = fsdp::ProcessGroup::from_env(pgo);
  auto ref = four_linears(kGpu), model = four_linears(kGpu);
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
  if (offload) options.offload(fsdp::CpuOffload().params(true));
  auto sharded = fsdp::fully_shard(model, pg, options);
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::optim::SGD ref_opt(ref->parameters(), sgd), opt(sharded->parameters(), sgd);
  const int rows = 2;
  for (int step = 0; step < 4; ++step) {
    auto gen = at::detail::createCPUGenerator(step);
    const at::Tensor x = at::randn({rows * ctx.world, 5}, gen).to(kGpu, at::kDouble);
    const at::Tensor y = at::randn({rows * ctx.world, 3}, gen).to(kGpu, at::kDouble);
    const at::Tensor mine = x.narrow(0, ctx.rank * rows, rows), my_y = y.narrow(0, ctx.rank * rows, rows);
    if (step == 2 && what == "failed_backward") {  // nothing of this step reaches the local model
      opt.zero_grad();
      bool failed = false;
      try {
        torch::mse_loss(forward_failing_in_backward(model, mine), my_y).backward();
      } catch (const std::exception& e) {
        failed = contains(e.what(), "a failure inside backward");
      }
      WORKER_CHECK(failed, "the backward did not fail as arranged");
    }
    if (step == 2 && what == "dropped_between") {  // a micro-batch whose gradients are then dropped
      sharded->set_requires_gradient_sync(false);
      torch::mse_loss(model->forward(mine * 2), my_y).backward();
      sharded->set_requires_gradient_sync(true);
    }
    ref_opt.zero_grad();
    opt.zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    torch::mse_loss(model->forward(mine), my_y).backward();
    ref_opt.step();
    opt.step();
  }
  const std::string label = strategy + " offload " + std::to_string(int(offload)) + " " + what;
  expect_same_parameters(*ref, *sharded, 1e-10, label);
  if (ctx.rank == 0) std::cout << label << " ok" << std::endl;
}

TEST(GpuFailedBackward, NothingOfAFailedBackwardOrOfDroppedHeldGradientsLandsOnTheDeviceOrOffloaded) {
  REQUIRE_GPU();
  for (const auto& [strategy, world] :
       std::vector<std::pair<std::string, int>>{{"FULL_SHARD", 1}, {"FULL_SHARD", 3}, {"NO_SHARD", 2}})
    for (const char* what : {"failed_backward", "dropped_between"})
      for (const char* offload : {"0", "1"}) {
        const std::vector<std::string> env = world > 1
                                                 ? std::vector<std::string>{"FSDP_TRANSPORT=shm", "FSDP_TIMEOUT_S=30"}
                                                 : std::vector<std::string>{};
        auto r = launch("gpu_failed_backward_worker", world, {strategy, offload, what}, 120, env);
        EXPECT_TRUE(r.all_ok()) << strategy << " world " << world << " offload " << offload << " " << what << "\n"
                                << r.report();
      }
}

}  // namespace
}  // namespace fsdp_test
