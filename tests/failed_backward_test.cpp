// A backward that ends in an exception, caught on every rank: the next iteration starts clean, and
// training after zero_grad() equals local training that skipped that batch.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <chrono>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: strategy, then when the failed step's gradients are zeroed: "before_forward" (right after
// the exception) or "after_call" (after another libfsdp call, a state dict); optional "no_sync":
// the failure comes in the second micro-batch of an accumulation, whose held gradients go with it.
FSDP_WORKER(failed_backward_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0), when = ctx.args.at(1);
  const bool no_sync = ctx.args.size() > 2 && ctx.args[2] == "no_sync";
  const bool one_rank = ctx.args.size() > 2 && ctx.args[2] == "one_rank";  // the others' backward succeeds
  auto ref = four_linears(), model = four_linears();
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
  if (strategy == "HYBRID_SHARD") options.sharding_factor(2);
  auto sharded = fsdp::fully_shard(model, pg, options);
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::optim::SGD ref_opt(ref->parameters(), sgd), opt(sharded->parameters(), sgd);
  const int rows = 2;
  for (int step = 0; step < 4; ++step) {
    const auto x = at::randn({rows * ctx.world, 5}, at::detail::createCPUGenerator(step)).to(at::kDouble);
    const auto y = at::randn({rows * ctx.world, 3}, at::detail::createCPUGenerator(50 + step)).to(at::kDouble);
    const auto mine = x.narrow(0, ctx.rank * rows, rows), my_y = y.narrow(0, ctx.rank * rows, rows);
    if (step == 2) {  // the failed step: nothing of it reaches the local model
      opt.zero_grad();
      if (no_sync) {
        auto guard = sharded->no_sync();
        torch::mse_loss(model->forward(mine), my_y).backward();
      }
      bool failed = false;
      try {
        if (one_rank && ctx.rank != 1)
          torch::mse_loss(model->forward(mine), my_y).backward();
        else
          torch::mse_loss(forward_failing_in_backward(model, mine), my_y).backward();
      } catch (const std::exception& e) {
        failed = contains(e.what(), "a failure inside backward");
      }
      WORKER_CHECK(failed || (one_rank && ctx.rank != 1), "the backward did not fail as arranged");
      if (when == "after_call") (void)sharded->full_state_dict();
      opt.zero_grad();
    }
    ref_opt.zero_grad();
    opt.zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    torch::mse_loss(model->forward(mine), my_y).backward();
    ref_opt.step();
    opt.step();
  }
  expect_same_parameters(*ref, *sharded, 1e-12, strategy + " " + when + (no_sync ? " no_sync" : ""));
  if (ctx.rank == 0) std::cout << strategy << " " << when << " ok" << std::endl;
}

TEST(FailedBackward, TrainingAfterACaughtFailureInBackwardEqualsLocalTrainingWithoutThatBatch) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"})
    for (const char* when : {"before_forward", "after_call"}) {
      auto r = launch("failed_backward_worker", 3, {strategy, when});
      ASSERT_TRUE(r.all_ok()) << strategy << " " << when << "\n" << r.report();
    }
  auto r = launch("failed_backward_worker", 4, {"HYBRID_SHARD", "before_forward"});
  ASSERT_TRUE(r.all_ok()) << r.report();
}

TEST(FailedBackward, AFailureInAnAccumulationDropsTheHeldGradients) {
  for (const char* strategy : {"FULL_SHARD", "NO_SHARD"}) {
    auto r = launch("failed_backward_worker", 3, {strategy, "before_forward", "no_sync"});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

// A failure on one rank only: that rank's next collectives differ from its peers', and every rank
// fails at once, naming both (Note [Collective fingerprints]).
TEST(FailedBackward, AFailureOnOneRankOnlyFailsEveryRankFastNamingBothCollectives) {
  for (const char* strategy : {"FULL_SHARD", "NO_SHARD"}) {
    const auto t0 = std::chrono::steady_clock::now();
    RunningRanks running =
        start("failed_backward_worker", 3, {strategy, "before_forward", "one_rank"}, {"FSDP_TIMEOUT_S=120"});
    auto r = wait_for(running, 240);
    ASSERT_FALSE(r.timed_out) << strategy << "\n" << r.report();
    for (int rank = 0; rank < 3; ++rank) {
      EXPECT_NE(r.ranks[rank].exit_code, 0) << strategy << ": rank " << rank << " finished\n" << r.report();
      EXPECT_TRUE(contains(r.ranks[rank].output, "ranks diverged: member")) << strategy << "\n" << r.report();
    }
    EXPECT_LT(seconds_since(t0), 45) << strategy << "\n" << r.report();  // the timeout is 120 s
  }
}

}  // namespace
}  // namespace fsdp_test
