// Bad input: wrong arguments, wrong options and misuse of the API are a clear error on every rank,
// naming the mistake, never a hang.
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// Each Linear its own unit, under the strategy named `strategy`.
fsdp::Options linear_units(const std::string& strategy) {
  return fsdp::Options()
      .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
      .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
}

FSDP_WORKER(different_models_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, ctx.rank == 1 ? 11 : 10, 3, 2);  // rank 1 built a different hidden size
  fsdp::fully_shard(model, pg);
}

TEST(BadInput, RanksWithDifferentModelsFailWithTheFirstDifference) {
  auto r = launch("different_models_worker", 2, {}, 120);
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks) {
    EXPECT_NE(rank.exit_code, 0);
    EXPECT_TRUE(contains(rank.output, "built different models")) << rank.output;
    EXPECT_TRUE(contains(rank.output, "layers.0.weight")) << rank.output;
  }
}

FSDP_WORKER(fully_shard_twice_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto first = fsdp::fully_shard(model, pg);
  auto second = fsdp::fully_shard(model, pg);
}

TEST(BadInput, FullyShardTwiceOnOneModelIsAClearErrorOnEveryRank) {
  auto r = launch("fully_shard_twice_worker", 2, {}, 120);
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks) {
    EXPECT_EQ(rank.exit_code, 1) << rank.output;  // an exception, not a signal
    EXPECT_TRUE(contains(rank.output, "is already sharded by an earlier fully_shard()")) << rank.output;
  }
}

FSDP_WORKER(forward_after_shutdown_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.1));
  model->forward(at::ones({2, 6})).sum().backward();
  opt.step();
  pg->shutdown();
  model->forward(at::ones({2, 6}));
}

TEST(BadInput, ForwardAfterTheProcessGroupShutDownIsAClearError) {
  for (const std::string transport : {"shm", "tcp"}) {
    auto r = launch("forward_after_shutdown_worker", 2, {}, 120, {"FSDP_TRANSPORT=" + transport});
    ASSERT_FALSE(r.timed_out) << r.report();
    for (const auto& rank : r.ranks) {
      EXPECT_EQ(rank.exit_code, 1) << transport << "\n" << rank.output;
      EXPECT_TRUE(contains(rank.output, "was issued after the communicator was shut down")) << rank.output;
      EXPECT_TRUE(contains(rank.output, "only after the last forward")) << rank.output;
    }
  }
}

FSDP_WORKER(hybrid_factor_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  // Every rank finishes connecting before any of them fails: rank 0 hosts the store, and a rank
  // still connecting when it exits would report the lost connection instead of the check.
  pg->world()->barrier();
  MLP model(6, 10, 3, 2);
  fsdp::fully_shard(model, pg,
                    fsdp::Options().sharding_strategy(fsdp::ShardingStrategy::kHybridShard).sharding_factor(2));
}

TEST(BadInput, HybridFactorMustDivideWorldSize) {
  auto r = launch("hybrid_factor_worker", 3, {}, 120);
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks)
    EXPECT_TRUE(contains(rank.output, "world size 3 is not divisible by the sharding factor 2")) << rank.output;
}

FSDP_WORKER(shared_param_error_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  TinyTransformer model(32, 16, 2, 1, 8);
  fsdp::fully_shard(model, pg,
                    fsdp::Options()
                        .wrap_modules({model->tok.ptr(), model->head.ptr()})
                        .shared_parameters(fsdp::SharedParameterPolicy::kError));
}

TEST(BadInput, SharedParameterAcrossUnitsRefusedWhenAskedTo) {
  auto r = launch("shared_param_error_worker", 1, {}, 120);
  EXPECT_TRUE(contains(r.ranks[0].output, "'tok.weight', 'head.weight' is shared by modules of different FSDP units"))
      << r.report();
}

FSDP_WORKER(wrong_optimizer_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD wrong(model->parameters(), 0.1);
  try {
    sharded->check_optimizer(wrong);
    throw std::runtime_error("check_optimizer accepted the original parameters");
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(contains(e.what(), "Build the optimizer over FullyShardedModule::parameters()"), e.what());
  }
  // An in-place update of an original parameter is refused at the next backward.
  {
    torch::NoGradGuard no_grad;
    model->parameters()[0].mul_(0.5);
  }
  std::cout << "wrote in place" << std::endl;  // the error is on stderr already
  try {
    model->forward(torch::randn({2, 6})).sum().backward();
    throw std::runtime_error("the in-place update of an original parameter was not reported");
  } catch (const std::exception& e) {
    WORKER_CHECK(contains(e.what(), "in-place operation aten::mul_ on parameter 'layers.0.weight'"), e.what());
  }
  std::cout << "wrong optimizer detected" << std::endl;
}

TEST(BadInput, OptimizerOverOriginalParametersIsDetected) {
  auto r = launch("wrong_optimizer_worker", 2, {}, 120);
  ASSERT_TRUE(r.all_ok()) << r.report();
  for (const auto& rank : r.ranks) {
    const size_t reported = rank.output.find("found inside an operator; thrown by the next backward");
    EXPECT_NE(reported, std::string::npos) << r.report();
    EXPECT_LT(reported, rank.output.find("wrote in place")) << "reported after the write's next step\n" << r.report();
  }
}

// A stock optimizer over module->parameters() (not the shards) never gets to train silently: the
// parameters' .grad between backwards is a zero sentinel. Where sharding frees the parameters, the
// first step writes one in place, which is refused by the next forward; where the parameters are
// the shards (a world of one, NO_SHARD), the first step reads a sentinel, which is refused by the
// next backward. args: optimizer (sgd, adam, adamw, adamw_no_decay), strategy
FSDP_WORKER(stock_optimizer_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded = fsdp::fully_shard(model, pg, linear_units(ctx.args.at(1)));
  std::unique_ptr<torch::optim::Optimizer> opt;
  const std::string kind = ctx.args.at(0);
  if (kind == "sgd") opt = std::make_unique<torch::optim::SGD>(model->parameters(), 0.1);
  if (kind == "adam") opt = std::make_unique<torch::optim::Adam>(model->parameters(), 0.1);
  if (kind == "adamw") opt = std::make_unique<torch::optim::AdamW>(model->parameters(), 0.1);
  if (kind == "adamw_no_decay")  // reads each gradient only as a later input of in-place operators
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(0.1).weight_decay(0));
  for (int step = 0; step < 3; ++step) {
    try {
      opt->zero_grad();
      model->zero_grad();  // a module's zero_grad stays harmless
      model->forward(torch::randn({2, 6})).sum().backward();
      opt->step();
    } catch (const std::exception& e) {
      WORKER_CHECK(step == 1, "failed at step ", step,
                   " (expected at the first forward or backward after the first step): ", e.what());
      WORKER_CHECK(contains(e.what(), "build the optimizer over FullyShardedModule::parameters()"), e.what());
      std::cout << "refused: " << e.what() << std::endl;
      return;
    }
  }
  throw std::runtime_error("a stock optimizer over module->parameters() ran 3 steps without an error");
}

TEST(BadInput, StockOptimizerOverModuleParametersFailsAfterItsFirstStep) {
  for (const std::string kind : {"sgd", "adam", "adamw", "adamw_no_decay"})
    for (const auto& [world, strategy] :
         std::vector<std::pair<int, std::string>>{{2, "FULL_SHARD"}, {1, "FULL_SHARD"}, {2, "NO_SHARD"}}) {
      auto r = launch("stock_optimizer_worker", world, {kind, strategy}, 120);
      EXPECT_TRUE(r.all_ok()) << kind << " " << strategy << " world " << world << "\n" << r.report();
    }
}

// Writes that bypass the parameter's own tensor: through .data(), .detach(), set_data(), or
// torch::load of a module file (set_, which also gives the parameter a new AccumulateGrad node).
// Each is refused by the next forward or backward, naming the parameter. args: route
FSDP_WORKER(write_route_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  const std::string route = ctx.args.at(0);
  auto options = fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
  if (ctx.args.size() > 1) options.sharding_strategy(fsdp::parse_sharding_strategy(ctx.args[1]));
  auto sharded = fsdp::fully_shard(model, pg, options);
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  model->forward(torch::randn({2, 6})).sum().backward();
  opt.step();
  at::Tensor p = model->named_parameters()["layers.0.weight"];
  if (route == "torch_load") {
    const TempDir dir;
    MLP other(6, 10, 3, 2);
    torch::save(other, dir / "other.pt");
    torch::load(model, dir / "other.pt");
  }
  {
    torch::NoGradGuard no_grad;
    if (route == "data") p.data().mul_(0.5);
    if (route == "detach") p.detach().copy_(torch::zeros_like(p));
    if (route == "set_data") p.set_data(torch::randn(p.sizes()));
  }
  try {
    opt.zero_grad();
    model->forward(torch::randn({2, 6})).sum().backward();
    opt.step();
    throw std::runtime_error("a write through " + route + " was not reported");
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(contains(e.what(), "'layers.0.weight'"), e.what());
    WORKER_CHECK(contains(e.what(), "summon_full_params(/*writeback=*/true)"), e.what());
    std::cout << "refused: " << e.what() << std::endl;
  }
}

TEST(BadInput, WritesThroughDataDetachSetDataOrTorchLoadAreRefused) {
  for (const std::string route : {"data", "detach", "set_data", "torch_load"}) {
    auto r = launch("write_route_worker", 2, {route}, 120);
    EXPECT_TRUE(r.all_ok()) << route << "\n" << r.report();
  }
  // NO_SHARD installs no operator hook (the parameters are the shard, so .data() writes take
  // effect); set_data is caught by the gradient pre-hook's storage check.
  auto r = launch("write_route_worker", 2, {"set_data", "NO_SHARD"}, 120);
  EXPECT_TRUE(r.all_ok()) << "set_data NO_SHARD\n" << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "no longer shows FSDP's storage")) << r.report();
}

// module->to(another dtype) after fully_shard() replaces every parameter's data, and with it the
// gradient hooks: the first backward after it throws, naming the parameter and the cause, under
// every strategy (also where no operator is intercepted), before training or during it; to() its
// own dtype and device changes nothing. args: strategy, when ("before" or "after" a first step)
// [, "unchanged"]
FSDP_WORKER(module_to_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded = fsdp::fully_shard(model, pg, linear_units(ctx.args.at(0)));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  if (ctx.args.at(1) == "after") {
    model->forward(torch::randn({2, 6})).sum().backward();
    opt.step();
  }
  if (ctx.args.size() > 2) {  // to() its own dtype and device changes nothing: training goes on
    model->to(torch::kFloat);
    model->to(torch::kCPU);
    const at::Tensor before = sharded->full_state_dict().at("layers.0.weight").clone();
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      model->forward(torch::randn({2, 6})).sum().backward();
      opt.step();
    }
    WORKER_CHECK(!torch::equal(sharded->full_state_dict().at("layers.0.weight"), before), "nothing was trained");
    return;
  }
  model->to(torch::kDouble);
  try {
    opt.zero_grad();
    model->forward(torch::randn({2, 6}, torch::kDouble)).sum().backward();
    opt.step();
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(contains(e.what(), "parameter 'layers."), e.what());
    WORKER_CHECK(contains(e.what(), "module->to(dtype or device)"), e.what());
    std::cout << "refused: " << e.what() << std::endl;
    return;
  }
  throw std::runtime_error("a step after module->to(kDouble) ran without an error");
}

TEST(BadInput, ModuleToAnotherDtypeAfterFullyShardIsRefusedAtTheNextBackward) {
  for (const auto& [world, strategy, when] :
       std::vector<std::tuple<int, std::string, std::string>>{{2, "FULL_SHARD", "before"},
                                                              {2, "FULL_SHARD", "after"},
                                                              {1, "FULL_SHARD", "before"},
                                                              {2, "NO_SHARD", "before"},
                                                              {2, "SHARD_GRAD_OP", "before"}}) {
    auto r = launch("module_to_worker", world, {strategy, when}, 120);
    EXPECT_TRUE(r.all_ok()) << strategy << " world " << world << " " << when << "\n" << r.report();
  }
  for (const auto& [world, strategy] : std::vector<std::pair<int, std::string>>{{2, "FULL_SHARD"}, {1, "NO_SHARD"}}) {
    auto r = launch("module_to_worker", world, {strategy, "before", "unchanged"}, 120);
    EXPECT_TRUE(r.all_ok()) << "to() its own dtype and device, " << strategy << " world " << world << "\n"
                            << r.report();
  }
}

// Where nothing is sharded, that watch costs a model that is only run forward (evaluation) two
// forwards: once every parameter has been read twice from FSDP's storage, no operator callback
// is left. args: strategy
FSDP_WORKER(forward_only_watch_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  WORKER_CHECK(!at::hasGlobalCallbacks(), "an operator callback exists before fully_shard()");
  auto sharded = fsdp::fully_shard(model, pg, linear_units(ctx.args.at(0)));
  WORKER_CHECK(at::hasGlobalCallbacks(), "no operator callback watches the first forward");
  torch::NoGradGuard no_grad;
  model->forward(torch::randn({2, 6}));
  WORKER_CHECK(at::hasGlobalCallbacks(), "the watch ended after one forward");
  model->forward(torch::randn({2, 6}));
  WORKER_CHECK(!at::hasGlobalCallbacks(), "an operator callback is left after two forwards");
}

TEST(BadInput, WhereNothingIsShardedAModelRunOnlyForwardIsWatchedForTwoForwards) {
  for (const auto& [world, strategy] : std::vector<std::pair<int, std::string>>{{1, "FULL_SHARD"}, {2, "NO_SHARD"}}) {
    auto r = launch("forward_only_watch_worker", world, {strategy}, 120);
    EXPECT_TRUE(r.all_ok()) << strategy << " world " << world << "\n" << r.report();
  }
}

// The module's parameters changed after fully_shard (added, replaced, removed): the next backward
// throws on every rank, naming the change. args: change
FSDP_WORKER(changed_module_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model(6, 10, 3, 2);
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  model->forward(torch::randn({2, 6})).sum().backward();
  opt.step();
  const std::string change = ctx.args.at(0);
  if (change == "add") model->register_parameter("extra", torch::zeros({3}));
  if (change == "replace")
    model->replace_module("layers", torch::nn::Sequential(torch::nn::Linear(6, 10), torch::nn::Linear(10, 3)));
  if (change == "remove") model->unregister_module("layers");
  try {
    opt.zero_grad();
    model->forward(torch::randn({2, 6})).sum().backward();
    throw std::runtime_error("a parameter change (" + change + ") after fully_shard was not reported");
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(contains(e.what(), "the model's parameters changed after fully_shard()"), e.what());
    WORKER_CHECK(contains(e.what(), change == "remove" ? "was removed" : "(added or replaced since)"), e.what());
    std::cout << "refused: " << e.what() << std::endl;
  }
}

TEST(BadInput, ParametersChangedAfterFullyShardAreAClearError) {
  for (const std::string change : {"add", "replace", "remove"}) {
    auto r = launch("changed_module_worker", 2, {change}, 120);
    EXPECT_TRUE(r.all_ok()) << change << "\n" << r.report();
  }
}

// A module that keeps a view of its parameter made in its constructor: after fully_shard() the view
// still shows the parameter's initial memory, so training would compute with the initial values.
// Its first read is refused under every strategy, naming the parameter. args: strategy.
struct KeptViewImpl : torch::nn::Module {
  KeptViewImpl() {
    w = register_parameter("w", torch::randn({4, 6}));
    wt = w.t();
  }
  at::Tensor forward(const at::Tensor& x) { return x.matmul(wt); }
  at::Tensor w, wt;
};
TORCH_MODULE(KeptView);

FSDP_WORKER(kept_view_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  KeptView model;
  auto sharded =
      fsdp::fully_shard(model, pg, fsdp::Options().sharding_strategy(fsdp::parse_sharding_strategy(ctx.args.at(0))));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  try {
    model->forward(torch::randn({2, 6})).sum().backward();
    opt.step();
    throw std::runtime_error("a view kept from before fully_shard was read unreported");
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(contains(e.what(), "parameter 'w' had before fully_shard()"), e.what());
    std::cout << "refused: " << e.what() << std::endl;
  }
}

TEST(BadInput, AViewOfAParameterKeptFromBeforeFullyShardIsRefusedWhenRead) {
  for (const std::string strategy : {"FULL_SHARD", "NO_SHARD"}) {
    auto r = launch("kept_view_worker", 2, {strategy}, 120);
    EXPECT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

}  // namespace
}  // namespace fsdp_test
