// Per original parameter, through the shards: FullyShardedModule::shard_pieces() (each piece with its
// parameter's name, shape and element range) and grad_norms() (each parameter's gradient norm,
// equal to local training's); reading a sharded parameter's .grad placeholder as a gradient is an
// error that names the way to the gradient. torch::autograd::grad with respect to the parameters
// gives this rank's own gradient, frees what it gathered, and leaves training as it was; a penalty
// on the input gradient (create_graph) trains like local training.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

MLP make_mlp() {
  torch::manual_seed(11);
  return MLP(5, 7, 3, 2);  // 5x7 + 7, 7x7 + 7, 3x7 + 3: 133 elements, padding at worlds 2, 3 and 4
}

fsdp::Options strategy_options(const std::string& strategy) {
  auto o = fsdp::Options().sharding_strategy(fsdp::parse_sharding_strategy(strategy));
  if (strategy == "HYBRID_SHARD") o.sharding_factor(2);
  return o;
}

// args: strategy. Each piece holds the elements of its parameter that `begin` says, with the
// parameter's shape, and the pieces of all ranks of a shard group cover each parameter exactly once.
FSDP_WORKER(shard_pieces_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model = make_mlp();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& kv : model->named_parameters()) shapes[kv.key()] = kv.value().sizes().vec();
  auto sharded = fsdp::fully_shard(model, pg, strategy_options(ctx.args.at(0)));
  const auto full = sharded->full_state_dict();
  std::vector<std::string> names;
  for (const auto& kv : shapes) names.push_back(kv.first);
  at::Tensor covered = at::zeros({static_cast<int64_t>(names.size())}, at::kLong);
  for (const auto& p : sharded->shard_pieces()) {
    WORKER_CHECK(p.shape == shapes.at(p.name), "piece of '", p.name, "' has shape ", at::IntArrayRef(p.shape));
    const at::Tensor whole = full.at(p.name).reshape({-1});
    WORKER_CHECK(p.begin >= 0 && p.begin + p.piece.numel() <= whole.numel(), "piece of '", p.name, "' at ", p.begin);
    WORKER_CHECK(torch::equal(p.piece.detach(), whole.narrow(0, p.begin, p.piece.numel())), "piece of '", p.name,
                 "' does not hold elements from ", p.begin);
    const auto i = std::find(names.begin(), names.end(), p.name) - names.begin();
    covered[i] += p.piece.numel();
  }
  // Sum over the world: every element once per shard group.
  pg->world()->all_reduce(covered)->wait();
  const int groups = sharded->world_size() / sharded->sharding_factor();
  for (size_t i = 0; i < names.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : shapes.at(names[i])) numel *= d;
    WORKER_CHECK(covered[i].item<int64_t>() == numel * groups, "'", names[i], "' covered ", covered[i].item<int64_t>(),
                 " times over ", groups, " shard groups of ", numel, " elements");
  }
}

TEST(ParameterGradients, ShardPiecesNameShapeAndElementRangeOfTheirParameters) {
  for (int world : {1, 2, 3}) {
    auto r = launch("shard_pieces_worker", world, {"FULL_SHARD"});
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
  }
  for (const char* strategy : {"NO_SHARD", "HYBRID_SHARD"}) {
    auto r = launch("shard_pieces_worker", 4, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

// args: strategy. After one backward on the global batch (2 rows per rank), grad_norms() (2-norm
// and infinity) equals the norms of local training's gradients; the frozen first bias has none.
FSDP_WORKER(grad_norms_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP ref = make_mlp(), model = make_mlp();
  for (MLP* m : {&ref, &model}) (*m)->named_parameters()["layers.0.bias"].set_requires_grad(false);
  auto sharded = fsdp::fully_shard(model, pg, strategy_options(ctx.args.at(0)));
  const int rows = 2;
  const at::Tensor x = at::randn({rows * ctx.world, 5}, at::detail::createCPUGenerator(5));
  torch::mse_loss(ref->forward(x), x.narrow(1, 0, 3)).backward();
  const at::Tensor mine = x.narrow(0, ctx.rank * rows, rows);
  torch::mse_loss(model->forward(mine), mine.narrow(1, 0, 3)).backward();
  for (double p : {2.0, std::numeric_limits<double>::infinity()}) {
    const auto norms = sharded->grad_norms(p);
    size_t expected = 0;
    for (const auto& kv : ref->named_parameters()) {
      if (!kv.value().requires_grad()) continue;
      ++expected;
      const double want =
          std::isinf(p) ? kv.value().grad().abs().max().item<double>() : kv.value().grad().norm().item<double>();
      auto it = std::find_if(norms.begin(), norms.end(), [&](const auto& n) { return n.first == kv.key(); });
      WORKER_CHECK(it != norms.end(), "no norm for '", kv.key(), "'");
      WORKER_CHECK(std::abs(it->second - want) <= 1e-5 * want, "'", kv.key(), "' ", p, "-norm ", it->second,
                   " vs local ", want);
    }
    WORKER_CHECK(norms.size() == expected, norms.size(), " norms for ", expected, " trainable parameters");
  }
}

TEST(ParameterGradients, GradNormsEqualLocalTrainingsPerParameter) {
  for (int world : {1, 2, 3}) {
    auto r = launch("grad_norms_worker", world, {"FULL_SHARD"});
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
  }
  for (const char* strategy : {"SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
    auto r = launch("grad_norms_worker", 4, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

// After backward, zeroing the original parameters' .grad is fine; reading one as a gradient makes
// the next backward fail, naming the parameter and the way to its gradient. args: strategy
FSDP_WORKER(placeholder_read_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model = make_mlp();
  auto sharded = fsdp::fully_shard(model, pg, strategy_options(ctx.args.at(0)));
  const at::Tensor x = at::randn({2, 5});
  model->forward(x).sum().backward();
  zero_grad_in_place(*std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1)));
  model->forward(x).sum().backward();  // zeroing did not fail anything
  const at::Tensor g = model->named_parameters()["layers.0.weight"].grad();
  WORKER_CHECK(g.defined(), "no placeholder");
  (void)g.norm();  // reads zeros: kept as an error for the next FSDP call
  try {
    model->forward(x).sum().backward();
    WORKER_CHECK(false, "reading the placeholder was not reported");
  } catch (const std::exception& e) {
    WORKER_CHECK(contains(e.what(), "parameter 'layers.0.weight'") && contains(e.what(), "placeholder") &&
                     contains(e.what(), "shard_pieces()") && contains(e.what(), "grad_norms()"),
                 e.what());
  }
}

TEST(ParameterGradients, ReadingAParametersPlaceholderGradIsAnErrorNamingTheWayToTheGradient) {
  // The parameters are the shards at a world of one and under NO_SHARD.
  for (const auto& [world, strategy] :
       std::vector<std::pair<int, std::string>>{{2, "FULL_SHARD"}, {1, "FULL_SHARD"}, {2, "NO_SHARD"}}) {
    auto r = launch("placeholder_read_worker", world, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << " world " << world << "\n" << r.report();
  }
}

// A module's own zero_grad() (which detaches each .grad, the placeholder included) is harmless
// beside an optimizer over the shards, which trains. args: strategy
FSDP_WORKER(module_own_zero_grad_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  MLP model = make_mlp();
  auto sharded = fsdp::fully_shard(model, pg, strategy_options(ctx.args.at(0)));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  const at::Tensor before = sharded->full_state_dict().at("layers.0.weight").clone();
  for (int step = 0; step < 3; ++step) {
    model->zero_grad();
    opt.zero_grad();
    model->forward(at::randn({2, 5})).sum().backward();
    opt.step();
  }
  WORKER_CHECK(!torch::equal(sharded->full_state_dict().at("layers.0.weight"), before), "nothing was trained");
}

TEST(ParameterGradients, AModulesZeroGradIsHarmless) {
  for (const auto& [world, strategy] :
       std::vector<std::pair<int, std::string>>{{2, "FULL_SHARD"}, {1, "FULL_SHARD"}, {2, "NO_SHARD"}}) {
    auto r = launch("module_own_zero_grad_worker", world, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << " world " << world << "\n" << r.report();
  }
}

// loss(m, x) + 0.1 * mean over rows of |d sum(m(x)) / dx|^2: per row, so its mean over the global
// batch is the mean of the ranks' means.
at::Tensor penalized_loss(MLP& m, const at::Tensor& rows) {
  auto x = rows.clone().requires_grad_(true);
  auto out = m->forward(x);
  auto gx = torch::autograd::grad({out.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  return out.pow(2).mean() + 0.1 * gx.pow(2).sum(1).mean();
}

// args: strategy.
FSDP_WORKER(autograd_grad_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  MLP ref = make_mlp(), model = make_mlp();
  auto sharded = fsdp::fully_shard(
      model, pg, strategy_options(strategy).auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(0.05)),
      opt(sharded->parameters(), torch::optim::AdamWOptions(0.05));
  const int rows = 2;
  for (int step = 0; step < 4; ++step) {
    const at::Tensor x = at::randn({rows * ctx.world, 5}, at::detail::createCPUGenerator(60 + step));
    const at::Tensor mine = x.narrow(0, ctx.rank * rows, rows);
    if (step == 1) {  // between steps: a gradient with respect to the parameters, as for logging
      const int64_t before = sharded->memory_stats().param_bytes;
      auto local = torch::autograd::grad({ref->forward(mine).pow(2).mean()}, ref->parameters());
      auto g = torch::autograd::grad({model->forward(mine).pow(2).mean()}, model->parameters());
      WORKER_CHECK(g.size() == local.size(), "autograd::grad gave ", g.size(), " gradients");
      for (size_t i = 0; i < g.size(); ++i)
        WORKER_CHECK(rel_diff(g[i], local[i]) < 1e-5, "autograd::grad: gradient ", i, " is not this rank's own");
      WORKER_CHECK(sharded->memory_stats().param_bytes == before, strategy, ": ", sharded->memory_stats().param_bytes,
                   " parameter bytes held after autograd::grad, ", before, " before it");
    }
    ref_opt.zero_grad();
    penalized_loss(ref, x).backward();
    ref_opt.step();
    opt.zero_grad();
    penalized_loss(model, mine).backward();
    opt.step();
  }
  expect_same_parameters(*ref, *sharded, 1e-5, strategy);
}

TEST(ParameterGradients, AutogradGradAndAnInputGradientPenaltyTrainLikeLocal) {
  for (const auto& [strategy, world] : std::vector<std::pair<std::string, int>>{
           {"FULL_SHARD", 3}, {"SHARD_GRAD_OP", 2}, {"NO_SHARD", 3}, {"HYBRID_SHARD", 4}}) {
    auto r = launch("autograd_grad_worker", world, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

}  // namespace
}  // namespace fsdp_test
