// Embedding max_norm: the lookup renormalizes the rows the batch names, in place; sharded training
// renormalizes those of every rank's batch, as training on the global batch does.
#include <gtest/gtest.h>

#include <sstream>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

std::vector<std::string> fields(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, sep);) out.push_back(part);
  return out;
}

// args: "kind:strategy[:wrap]".
FSDP_WORKER(max_norm_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (const auto& combo : ctx.args) {
    const auto f = fields(combo, ':');
    const std::string kind = f[0], strategy = f[1];
    torch::manual_seed(3);
    Lookup ref(kind);
    ref->to(at::kDouble);
    torch::manual_seed(3);
    Lookup model(kind);
    model->to(at::kDouble);
    auto opts = fsdp::Options().sharding_strategy(fsdp::parse_sharding_strategy(strategy));
    if (strategy == "HYBRID_SHARD") opts.sharding_factor(2);
    if (f.size() > 2) opts.auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
    auto sharded = fsdp::fully_shard(model, pg, opts);
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
    torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
    const int per_rank = 2;
    int64_t renormed = 0;
    for (int step = 0; step < 4; ++step) {
      auto gen = at::detail::createCPUGenerator(70 + step);
      // Each rank's rows: mostly its own part of the table, so that ranks name different rows.
      auto idx = at::randint(0, LookupImpl::kRows / 2, {per_rank * ctx.world, 3}, gen);
      idx += at::arange(per_rank * ctx.world).div(per_rank, "floor").unsqueeze(1) * 5;
      auto y = at::randn({per_rank * ctx.world, LookupImpl::kRows}, gen).to(at::kDouble);
      const at::Tensor before = ref->weight().detach().clone();
      ref_opt.zero_grad();
      torch::mse_loss(ref(idx), y).backward();
      ref_opt.step();
      renormed += (before.norm(2, 1) > 1.0)
                      .logical_and(at::zeros({LookupImpl::kRows}, at::kBool).index_fill_(0, idx.reshape({-1}), true))
                      .sum()
                      .item<int64_t>();
      opt.zero_grad();
      auto mine = idx.narrow(0, ctx.rank * per_rank, per_rank);
      torch::mse_loss(model(mine), y.narrow(0, ctx.rank * per_rank, per_rank)).backward();
      opt.step();
    }
    WORKER_CHECK(renormed > 0, combo, ": no row was renormalized; the case tests nothing");
    expect_same_parameters(*ref, *sharded, 1e-12, combo);
    if (ctx.rank == 0) std::cout << combo << " ok" << std::endl;
  }
}

TEST(EmbeddingMaxNorm, RowsOfEveryRankAreRenormalizedAsOnTheGlobalBatchUnderEveryStrategy) {
  std::vector<std::string> combos;
  for (const char* kind : {"embedding", "bag", "functional"})
    for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"})
      combos.push_back(std::string(kind) + ":" + strategy);
  combos.push_back("embedding:FULL_SHARD:wrap");
  auto r = launch("max_norm_worker", 3, combos);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "embedding:FULL_SHARD:wrap ok")) << r.report();
}

TEST(EmbeddingMaxNorm, HybridShardRenormalizesTheRowsOfEveryReplica) {
  auto r = launch("max_norm_worker", 4, {"embedding:HYBRID_SHARD", "functional:HYBRID_SHARD:wrap"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "functional:HYBRID_SHARD:wrap ok")) << r.report();
}

}  // namespace
}  // namespace fsdp_test
