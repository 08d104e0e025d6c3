// Gradient clipping across shards (FullyShardedModule::clip_grad_norm_): equal to local clipping of
// the same model on the same batches, for every strategy and norm type.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <utility>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: strategy, norm type ("inf" or a number)
FSDP_WORKER(clip_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  const double p = ctx.args.at(1) == "inf" ? std::numeric_limits<double>::infinity() : std::stod(ctx.args.at(1));
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  torch::optim::SGD ref_opt(unique_parameters(*ref), 0.5), opt(sharded->parameters(), 0.5);
  const int rows = 2;
  for (int step = 0; step < 3; ++step) {
    const auto x = at::randint(0, 32, {rows * ctx.world, 8}, at::detail::createCPUGenerator(50 + step));
    ref_opt.zero_grad();
    loss_of(ref, x).backward();
    // max_norm below the norm for the first steps, above it later: both branches run.
    const double max_norm = step < 2 ? 0.05 : 1e6;
    const double ref_norm = torch::nn::utils::clip_grad_norm_(unique_parameters(*ref), max_norm, p);
    ref_opt.step();
    opt.zero_grad();
    loss_of(model, x.narrow(0, ctx.rank * rows, rows)).backward();
    const double norm = sharded->clip_grad_norm_(max_norm, p);
    opt.step();
    WORKER_CHECK(std::abs(norm - ref_norm) <= 1e-12 * ref_norm, "norm ", norm, " vs local ", ref_norm, " at step ",
                 step);
    if (step == 0) WORKER_CHECK(ref_norm > 0.05, "the test must clip: local norm ", ref_norm);
  }
  expect_same_parameters(*ref, *sharded, 1e-12, "clipped");
  if (ctx.rank == 0) std::cout << strategy << " clip ok" << std::endl;
}

TEST(GradClip, EqualsLocalClippingForEveryStrategyAndNorm) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"})
    for (const char* p : {"2", "1.5", "inf"}) {
      auto r = launch("clip_worker", strategy == std::string("HYBRID_SHARD") ? 4 : 3, {strategy, p});
      ASSERT_TRUE(r.all_ok()) << strategy << " p=" << p << "\n" << r.report();
    }
}

// args: strategy, "torch" (LibTorch's clip_grad_norm_ over the shards) or "fsdp" (the module's own,
// and grad_norms())
FSDP_WORKER(shard_norm_note_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const bool torch_clip = ctx.args.at(1) == "torch";
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(ctx.args.at(0)));
  torch::optim::SGD opt(sharded->parameters(), 0.5);
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    loss_of(model, at::randint(0, 32, {2, 8}, at::detail::createCPUGenerator(60 + step))).backward();
    if (torch_clip) {
      torch::nn::utils::clip_grad_norm_(sharded->parameters(), 0.05);
    } else {
      sharded->clip_grad_norm_(0.05);
      WORKER_CHECK(!sharded->grad_norms().empty(), "no gradient norms");
    }
    opt.step();
  }
}

size_t occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(GradClip, LibTorchsClippingOverTheShardsPrintsANoteOnce) {
  const std::string note = "took a norm of the gradient of shard piece";
  auto r = launch("shard_norm_note_worker", 2, {"FULL_SHARD", "torch"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  for (const auto& rank : r.ranks) {
    EXPECT_EQ(occurrences(rank.output, note), 1u) << rank.output;
    EXPECT_TRUE(contains(rank.output, "Clip with FullyShardedModule::clip_grad_norm_(max_norm)")) << rank.output;
  }
  // FSDP's own norms combine the parts; NO_SHARD's pieces are whole parameters.
  for (const auto& [strategy, mode] : {std::pair{"FULL_SHARD", "fsdp"}, std::pair{"NO_SHARD", "torch"}}) {
    r = launch("shard_norm_note_worker", 2, {strategy, mode});
    ASSERT_TRUE(r.all_ok()) << strategy << " " << mode << "\n" << r.report();
    for (const auto& rank : r.ranks) EXPECT_EQ(occurrences(rank.output, note), 0u) << rank.output;
  }
}

}  // namespace
}  // namespace fsdp_test
