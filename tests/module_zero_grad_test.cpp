// Module::zero_grad(): zeroing (or dropping) the module's own gradients zeroes (or drops) the shard
// pieces' gradients, as it zeroes the gradients the optimizer steps in local training.
#include <gtest/gtest.h>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// Each step: module->zero_grad(set_to_none) on both models, `micro` backward passes, the step. The
// 'unused' Linear gets a gradient in even steps only: after zero_grad(true) the optimizer skips it
// in odd steps, after zero_grad(false) its weight decay and momentum still move it.
// args: "strategy:mode[:deterministic]", mode zero, none or accum (zero, 2 micro-batches).
FSDP_WORKER(module_zero_grad_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (const auto& combo : ctx.args) {
    const std::string strategy = combo.substr(0, combo.find(':'));
    const bool none = contains(combo, ":none"), accum = contains(combo, ":accum");
    const bool deterministic = contains(combo, ":deterministic");
    torch::manual_seed(5);
    Branchy ref;
    torch::manual_seed(5);
    Branchy model;
    auto opts = fsdp::Options()
                    .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                    .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>())
                    .deterministic(deterministic);
    if (strategy == "HYBRID_SHARD") opts.sharding_factor(2);
    auto sharded = fsdp::fully_shard(model, pg, opts);
    const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.1);
    torch::optim::SGD ref_opt(ref->parameters(), sgd);
    torch::optim::SGD opt(sharded->parameters(), sgd);
    auto loss = [](BranchyImpl& m, const at::Tensor& x, int step) {
      at::Tensor l = m.b(torch::tanh(m.a(x))).pow(2).mean();
      return step % 2 == 0 ? l + m.unused(x).pow(2).mean() : l;
    };
    const int per_rank = 2, micro = accum ? 2 : 1;
    for (int step = 0; step < 5; ++step) {
      ref->zero_grad(none);
      model->zero_grad(none);
      for (int m = 0; m < micro; ++m) {
        const at::Tensor x = at::randn({per_rank * ctx.world, 5}, at::detail::createCPUGenerator(40 + 2 * step + m));
        // Deterministic mode averages over every backward pass, the others sum the micro-batches.
        (loss(*ref, x, step) / (deterministic ? micro : 1)).backward();
        sharded->set_requires_gradient_sync(m + 1 == micro);
        loss(*model, x.narrow(0, ctx.rank * per_rank, per_rank), step).backward();
      }
      ref_opt.step();
      opt.step();
    }
    expect_same_parameters(*ref, *sharded, 1e-5, combo);
    if (ctx.rank == 0) std::cout << combo << " ok" << std::endl;
  }
}

TEST(ModuleZeroGrad, ZeroesOrDropsThePiecesGradientsUnderEveryStrategy) {
  std::vector<std::string> combos;
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"})
    for (const char* mode : {"zero", "none", "accum"}) combos.push_back(std::string(strategy) + ":" + mode);
  auto r = launch("module_zero_grad_worker", 3, combos);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "NO_SHARD:accum ok")) << r.report();
}

TEST(ModuleZeroGrad, WorldOfOneHybridShardAndDeterministicMode) {
  auto r = launch("module_zero_grad_worker", 1, {"FULL_SHARD:zero", "NO_SHARD:none"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  r = launch(
      "module_zero_grad_worker", 4,
      {"HYBRID_SHARD:zero", "HYBRID_SHARD:none", "FULL_SHARD:accum:deterministic", "NO_SHARD:none:deterministic"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "NO_SHARD:none:deterministic ok")) << r.report();
}

}  // namespace
}  // namespace fsdp_test
