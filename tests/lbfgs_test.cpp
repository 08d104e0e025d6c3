// fsdp::LBFGS: L-BFGS over a sharded module equals torch::optim::LBFGS on the unsharded model and
// the global batch (float64, within rounding), with and without the strong Wolfe line search and
// with a history short enough to drop pairs, at worlds 1-4 under every strategy, also where ranks
// hold no piece; the same iterations and closure evaluations; and torch::optim::LBFGS over the
// pieces is refused.
#include <gtest/gtest.h>

#include "harness.h"
#include "lbfgs_side_by_side.h"
#include "models.h"

namespace fsdp_test {
namespace {

// Three steps of both optimizers on the same batches; the parameters, the iterations and the
// closure evaluations must agree.
void expect_local_lbfgs(const WorkerContext& ctx, const fsdp::ProcessGroupPtr& pg, const std::string& strategy,
                        bool line_search) {
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  fsdp::LBFGS opt(*sharded, lbfgs_options(line_search));
  torch::optim::LBFGS ref_opt(unique_parameters(*ref), lbfgs_options(line_search));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = token_batch(ctx.world, step);
    lbfgs_step_side_by_side(
        ref_opt, [&, &ref = ref] { return loss_of(ref, x); }, opt,
        [&, &model = model] { return loss_of(model, x.narrow(0, ctx.rank * 2, 2)); });
  }
  const std::string what =
      strategy + (line_search ? " strong_wolfe" : " fixed step") + " world " + std::to_string(ctx.world);
  expect_same_lbfgs_counts(opt, ref_opt, what);
  expect_same_parameters(*ref, *sharded, 1e-10, what);
  if (ctx.rank == 0) std::cout << what << ": " << opt.iterations() << " iterations ok" << std::endl;
}

FSDP_WORKER(lbfgs_strategies_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  std::vector<std::string> strategies{"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"};
  if (ctx.world % 2 == 0 && ctx.world >= 4) strategies.emplace_back("HYBRID_SHARD");
  for (const auto& strategy : strategies)
    for (bool line_search : {false, true}) expect_local_lbfgs(ctx, pg, strategy, line_search);
}

// A model of two scalars over up to four ranks: ranks that hold no piece take part with empty
// vectors, and the run stops early (the strong Wolfe search converges) on every rank alike.
FSDP_WORKER(lbfgs_empty_ranks_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(0);
  torch::nn::Linear ref(1, 1);
  ref->to(at::kDouble);
  torch::manual_seed(0);
  torch::nn::Linear model(1, 1);
  model->to(at::kDouble);
  auto sharded = fsdp::fully_shard(model, pg, fsdp::Options());
  WORKER_CHECK(ctx.rank < 2 || sharded->parameters().empty(), "rank ", ctx.rank, " holds ",
               sharded->parameters().size(), " pieces of the two scalars");
  const auto o = torch::optim::LBFGSOptions(1).line_search_fn("strong_wolfe").max_iter(8);
  torch::optim::LBFGS ref_opt(ref->parameters(), o);
  fsdp::LBFGS opt(*sharded, o);
  const at::Tensor x = at::randn({4 * ctx.world, 1}, at::detail::createCPUGenerator(5)).to(at::kDouble);
  const at::Tensor y = 3 * x + 1;
  const int64_t rows = 4 * ctx.rank;
  for (int step = 0; step < 2; ++step)
    lbfgs_step_side_by_side(
        ref_opt, [&] { return torch::mse_loss(ref->forward(x), y); }, opt,
        [&] { return torch::mse_loss(model->forward(x.narrow(0, rows, 4)), y.narrow(0, rows, 4)); });
  const std::string what = "two scalars at world " + std::to_string(ctx.world);
  expect_same_lbfgs_counts(opt, ref_opt, what);
  expect_same_parameters(*ref, *sharded, 1e-10, what);
}

// torch::optim::LBFGS over the pieces on more than one rank, and a closure without a loss.
FSDP_WORKER(lbfgs_refusals_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options("FULL_SHARD"));
  torch::optim::LBFGS stock(sharded->parameters());
  if (ctx.world > 1)
    expect_error([&] { sharded->check_optimizer(stock); }, "fsdp::LBFGS(*sharded", "torch::optim::LBFGS");
  else
    sharded->check_optimizer(stock);
  fsdp::LBFGS opt(*sharded);
  expect_error([&] { opt.step([] { return at::Tensor(); }); }, "the closure must return the loss",
               "a closure without a loss");
  expect_error([&] { fsdp::LBFGS(*sharded, torch::optim::LBFGSOptions().line_search_fn("backtracking")); },
               "line_search_fn must be unset or \"strong_wolfe\"", "another line search");
}

// args: phase (save: 2 steps at world 4, then a checkpoint into dir; load: the checkpoint into an
// optimizer built with another rate, then 2 more steps), dir, strategy, "wolfe" or "fixed". After
// load, equal to 4 steps of torch::optim::LBFGS on the global batches, with its counts.
FSDP_WORKER(lbfgs_checkpoint_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string phase = ctx.args.at(0), dir = ctx.args.at(1), strategy = ctx.args.at(2);
  const bool line_search = ctx.args.at(3) == "wolfe";
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  auto loss = [&, &model = model](int step) {
    return [&, step] {
      return loss_of(model, token_batch(ctx.world, step).narrow(0, ctx.rank * 2, 2));
    };
  };
  if (phase == "save") {
    fsdp::LBFGS opt(*sharded, lbfgs_options(line_search));
    for (int step = 0; step < 2; ++step)
      opt.step([&, f = loss(step)] {
        opt.zero_grad();
        at::Tensor l = f();
        l.backward();
        return l;
      });
    fsdp::checkpoint::save(dir, *sharded, opt);
    return;
  }
  fsdp::LBFGS opt(*sharded, lbfgs_options(line_search).lr(0.01));
  fsdp::checkpoint::load(dir, *sharded, opt);
  torch::optim::LBFGS ref_opt(unique_parameters(*ref), lbfgs_options(line_search));
  const int saved_world = 4;
  for (int step = 0; step < 4; ++step) {
    const at::Tensor x = token_batch(step < 2 ? saved_world : ctx.world, step);
    auto ref_loss = [&, &ref = ref] {
      return loss_of(ref, x);
    };
    if (step < 2)
      ref_opt.step([&] {
        ref_opt.zero_grad();
        at::Tensor l = ref_loss();
        l.backward();
        return l;
      });
    else
      lbfgs_step_side_by_side(ref_opt, ref_loss, opt, loss(step));
  }
  const std::string what = strategy + " " + ctx.args.at(3) + " resumed at world " + std::to_string(ctx.world);
  expect_same_lbfgs_counts(opt, ref_opt, what);
  expect_same_parameters(*ref, *sharded, 1e-10, what);
  if (ctx.rank == 0) std::cout << what << " ok" << std::endl;
}

TEST(LBFGS, EqualsTorchLbfgsOnTheGlobalBatchUnderEveryStrategyAtWorlds1To4) {
  for (int world : {1, 2, 3, 4}) {
    auto r = launch("lbfgs_strategies_worker", world);
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
  }
}

TEST(LBFGS, RanksHoldingNoPieceTakePartAndStopWithTheOthers) {
  for (int world : {3, 4}) {
    auto r = launch("lbfgs_empty_ranks_worker", world);
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
  }
}

TEST(LBFGS, TorchLbfgsOverThePiecesAndAClosureWithoutALossAreRefused) {
  for (int world : {1, 2}) {
    auto r = launch("lbfgs_refusals_worker", world);
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
  }
}

TEST(LBFGS, HistorySavedAtWorld4ResumesAtWorlds3And2And1AsUninterruptedTorchLbfgs) {
  for (const char* search : {"wolfe", "fixed"}) {
    TempDir tmp;
    auto r = launch("lbfgs_checkpoint_worker", 4, {"save", tmp / "ckpt", "FULL_SHARD", search});
    ASSERT_TRUE(r.all_ok()) << search << " save\n" << r.report();
    for (auto [world, strategy] :
         {std::pair<int, const char*>{3, "FULL_SHARD"}, {2, "SHARD_GRAD_OP"}, {1, "NO_SHARD"}}) {
      r = launch("lbfgs_checkpoint_worker", world, {"load", tmp / "ckpt", strategy, search});
      ASSERT_TRUE(r.all_ok()) << search << " load at world " << world << "\n" << r.report();
    }
  }
}

}  // namespace
}  // namespace fsdp_test
