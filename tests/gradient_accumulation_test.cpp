// Gradient accumulation and user-handled gradients between steps match local training.
#include <gtest/gtest.h>

#include <functional>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// Gradient accumulation over micro-batches (backward twice, one step) and the ways a user handles
// gradients between steps: zeroed in place (zero_grad in LibTorch 1.x), dropped (set to none),
// scaled in place between micro-batches (as gradient clipping does), replaced by the user's own
// tensor. Each is mirrored on the local model, elementwise (a piece is a slice of the parameter).
FSDP_WORKER(accumulation_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  torch::manual_seed(4);
  MLP ref(6, 10, 3, 3);
  ref->to(at::kDouble);
  torch::manual_seed(4);
  MLP model(6, 10, 3, 3);
  model->to(at::kDouble);
  auto sharded = fsdp::fully_shard(model, pg,
                                   fsdp::Options()
                                       .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                                       .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD ref_opt(ref->parameters(), sgd), opt(sharded->parameters(), sgd);
  auto for_each_grad = [&](const std::function<void(at::Tensor & param, at::Tensor & grad)>& fn) {
    for (auto& p : ref->parameters()) fn(p, p.mutable_grad());
    for (auto& p : sharded->parameters()) fn(p, p.mutable_grad());
  };
  const int per_rank = 2;
  const char* clearing[] = {"zero_grad", "set_to_none", "keep", "user_tensor", "zero_grad"};
  for (int step = 0; step < 5; ++step) {
    const std::string clear = clearing[step];
    at::NoGradGuard no_grad;
    if (clear == "zero_grad") {
      zero_grad_in_place(ref_opt);
      zero_grad_in_place(opt);
    } else if (clear == "set_to_none") {
      for_each_grad([](at::Tensor&, at::Tensor& g) { g.reset(); });
      WORKER_CHECK(sharded->memory_stats().grad_bytes == 0, strategy,
                   ": gradients dropped by the user are still held: ", sharded->memory_stats().grad_bytes, " bytes");
    } else if (clear == "user_tensor") {
      for_each_grad([](at::Tensor& p, at::Tensor& g) { g = p.detach() * 0.01; });
    }  // "keep": the previous step's gradients stay and the new ones add to them
    for (int micro = 0; micro < 2; ++micro) {
      if (micro == 1 && step == 3)
        for_each_grad([](at::Tensor&, at::Tensor& g) {
          if (g.defined()) g.mul_(0.5);
        });
      const auto gen_x =
          at::randn({per_rank * ctx.world, 6}, at::detail::createCPUGenerator(10 * step + micro)).to(at::kDouble);
      at::AutoGradMode grad_on(true);
      ref->forward(gen_x).pow(2).mean().backward();
      model->forward(gen_x.narrow(0, ctx.rank * per_rank, per_rank)).pow(2).mean().backward();
    }
    ref_opt.step();
    opt.step();
  }
  auto full = sharded->full_state_dict();
  for (const auto& kv : ref->named_parameters()) {
    const double d = rel_diff(full.at(kv.key()), kv.value().detach());
    WORKER_CHECK(d <= 1e-10, strategy, ": parameter ", kv.key(), " differs from local training by rel ", d);
  }
  if (ctx.rank == 0) std::cout << strategy << " accumulation ok" << std::endl;
}

TEST(GradientAccumulation, MicroBatchesAndUserHandledGradientsMatchLocalTraining) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    auto r = launch("accumulation_worker", 3, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, std::string(strategy) + " accumulation ok")) << r.report();
  }
}

}  // namespace
}  // namespace fsdp_test
