// Embedding max_norm on CUDA parameters, on one GPU: the rows of every rank's batch renormalized in
// every rank's copy and in the shards (on the device, or offloaded to host memory), as local
// training on the global batch does (tests/embedding_max_norm_test.cpp on the CPU). At world > 1
// the ranks share cuda:0 through the host-staged communicator. Skipped where no CUDA device is
// visible.
#include <gtest/gtest.h>

#include <iostream>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: kind (embedding, bag or functional), strategy, "1" to offload the shards. Four steps of
// float64 training on the device against the same model trained locally on the device.
FSDP_WORKER(gpu_max_norm_worker) {
  const std::string kind = ctx.args.at(0), strategy = ctx.args.at(1);
  const bool offload = ctx.args.at(2) == "1";
  fsdp::ProcessGroupOptions pgo;
  pgo.device = kGpu;
  auto pg = fsdp::ProcessGroup::from_env(pgo);
  torch::manual_seed(3);
  Lookup ref(kind);
  ref->to(kGpu, at::kDouble);
  torch::manual_seed(3);
  Lookup model(kind);
  model->to(kGpu, at::kDouble);
  auto options = fsdp::Options().sharding_strategy(fsdp::parse_sharding_strategy(strategy));
  if (offload) options.offload(fsdp::CpuOffload().params(true));
  auto sharded = fsdp::fully_shard(model, pg, options);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
  torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
  const int per_rank = 2;
  for (int step = 0; step < 4; ++step) {
    auto gen = at::detail::createCPUGenerator(70 + step);
    at::Tensor idx = at::randint(0, LookupImpl::kRows / 2, {per_rank * ctx.world, 3}, gen);
    idx += at::arange(per_rank * ctx.world).div(per_rank, "floor").unsqueeze(1) * 5;
    const at::Tensor y = at::randn({per_rank * ctx.world, LookupImpl::kRows}, gen).to(kGpu, at::kDouble);
    idx = idx.to(kGpu);
    ref_opt.zero_grad();
    torch::mse_loss(ref(idx), y).backward();
    ref_opt.step();
    opt.zero_grad();
    torch::mse_loss(model(idx.narrow(0, ctx.rank * per_rank, per_rank)), y.narrow(0, ctx.rank * per_rank, per_rank))
        .backward();
    opt.step();
  }
  // CUDA's kernel takes a row's norm its own way: the rows other ranks name may differ in the last bits.
  const std::string what =
      kind + " " + strategy + " world " + std::to_string(ctx.world) + " offload " + std::to_string(int(offload));
  expect_same_parameters(*ref, *sharded, 1e-10, what);
  if (ctx.rank == 0) std::cout << what << " ok" << std::endl;
}

TEST(GpuEmbeddingMaxNorm, RowsOfEveryRankAreRenormalizedOnTheDeviceAndOffloaded) {
  REQUIRE_GPU();
  for (const auto& [strategy, world] :
       std::vector<std::pair<std::string, int>>{{"FULL_SHARD", 1}, {"FULL_SHARD", 3}, {"NO_SHARD", 2}})
    for (const char* kind : {"embedding", "bag", "functional"})
      for (const char* offload : {"0", "1"}) {
        const std::vector<std::string> env = world > 1
                                                 ? std::vector<std::string>{"FSDP_TRANSPORT=shm", "FSDP_TIMEOUT_S=30"}
                                                 : std::vector<std::string>{};
        auto r = launch("gpu_max_norm_worker", world, {kind, strategy, offload}, 120, env);
        EXPECT_TRUE(r.all_ok()) << kind << " " << strategy << " world " << world << " offload " << offload << "\n"
                                << r.report();
      }
}

}  // namespace
}  // namespace fsdp_test
