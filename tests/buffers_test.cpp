// Buffers: train-mode BatchNorm running statistics stay replicated across ranks.
#include <gtest/gtest.h>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// Train-mode BatchNorm: running statistics differ per rank's batch; FSDP keeps them replicated
// (rank 0's, broadcast after every backward).
FSDP_WORKER(buffers_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(5);
  Branchy model;
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto x = torch::randn({4, 5}) + ctx.rank;  // different data per rank
    model->b(model->bn(model->a(x))).pow(2).mean().backward();
    opt.step();
  }
  at::Tensor mean = model->bn->running_mean.clone();
  at::Tensor from_rank0 = mean.clone();
  pg->world()->broadcast(from_rank0, 0)->wait();
  WORKER_CHECK(torch::equal(mean, from_rank0), "BatchNorm running_mean differs from rank 0's");
  WORKER_CHECK(mean.abs().sum().item<double>() > 0, "running_mean never updated");
}

TEST(Buffers, StayReplicatedAcrossRanks) {
  auto r = launch("buffers_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace fsdp_test
