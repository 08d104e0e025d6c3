// Exactness: FSDP training equals single-process training of the same model on the same global batch.
// Every strategy, world size (3 forces padding), optimizer and dtype, over shared memory and TCP.
#include <gtest/gtest.h>

#include <sstream>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(item);
  return out;
}

struct Batch {
  at::Tensor x, y;
};

// The global batch of step `step` is the same whatever the world size; rank r trains on rows
// [r*b, (r+1)*b).
Batch global_batch(const std::string& model, int step, int rows, at::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  if (model == "mlp") return {at::randn({rows, 6}, gen).to(dtype), at::randn({rows, 3}, gen).to(dtype)};
  return {at::randint(0, 32, {rows, 8}, gen), at::randint(0, 32, {rows, 8}, gen)};
}

std::shared_ptr<torch::nn::Module> make_model(const std::string& model, at::ScalarType dtype) {
  torch::manual_seed(7);
  std::shared_ptr<torch::nn::Module> m;
  if (model == "mlp")
    m = MLP(6, 10, 3, 3).ptr();
  else if (model == "gpt4")
    m = TinyTransformer(32, 16, 2, 4, 8).ptr();
  else
    m = TinyTransformer(32, 16, 2, 2, 8).ptr();
  m->to(dtype);
  return m;
}

at::Tensor forward_loss(const std::string& model, torch::nn::Module& m, const Batch& b) {
  if (model == "mlp") return torch::mse_loss(m.as<MLPImpl>()->forward(b.x), b.y);
  // gpt, gpt4
  auto logits = m.as<TinyTransformerImpl>()->forward(b.x);
  return lm_loss(logits, b.y);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name, std::vector<at::Tensor> params) {
  if (name == "sgd")
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}

// overlap: "" (library defaults) or '+'-separated: pre|post|none (backward prefetch), fwd
// (forward prefetch), lim<K> (rate limiter with K) or nolim.
fsdp::Options options_for(const std::string& model, const std::string& strategy, std::shared_ptr<torch::nn::Module> m,
                          const std::string& overlap = "") {
  auto opts = fsdp::Options().sharding_strategy(fsdp::parse_sharding_strategy(strategy));
  for (const auto& o : split(overlap, '+')) {
    if (o == "pre")
      opts.backward_prefetch(fsdp::BackwardPrefetch::kBackwardPre);
    else if (o == "post")
      opts.backward_prefetch(fsdp::BackwardPrefetch::kBackwardPost);
    else if (o == "none")
      opts.backward_prefetch(fsdp::BackwardPrefetch::kNone);
    else if (o == "fwd")
      opts.forward_prefetch(true);
    else if (o == "nolim")
      opts.limit_all_gathers(false);
    else if (o.rfind("lim", 0) == 0)
      opts.limit_all_gathers(true).all_gather_limit(std::stoi(o.substr(3)));
    else
      throw std::runtime_error("unknown overlap option " + o);
  }
  if (strategy == "HYBRID_SHARD") opts.sharding_factor(2);
  if (model == "mlp") {
    opts.auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
  } else {
    // Blocks are units; tok and head are annotated as units too, so the tied weight they share
    // must move to their lowest common ancestor (the root).
    auto* t = m->as<TinyTransformerImpl>();
    opts.auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>()).wrap_modules({t->tok.ptr(), t->head.ptr()});
  }
  return opts;
}

// args: combos "model:strategy:optimizer:dtype[:overlap]", e.g. "mlp:FULL_SHARD:sgd:f32",
// "gpt4:FULL_SHARD:adamw:f32:post+fwd+lim1"
FSDP_WORKER(exact_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int steps = 5, per_rank = 2;
  for (const auto& combo : ctx.args) {
    auto f = split(combo, ':');
    const std::string model = f[0], strategy = f[1], optim = f[2];
    const auto dtype = f[3] == "f64" ? at::kDouble : at::kFloat;
    const double tol = f[3] == "f64" ? 1e-12 : 1e-5;

    auto reference = make_model(model, dtype);
    auto sharded_model = make_model(model, dtype);
    auto sharded =
        fsdp::fully_shard(sharded_model, pg, options_for(model, strategy, sharded_model, f.size() > 4 ? f[4] : ""));
    auto ref_opt = make_optimizer(optim, unique_parameters(*reference));
    auto opt = make_optimizer(optim, sharded->parameters());
    sharded->check_optimizer(*opt);

    for (int step = 0; step < steps; ++step) {
      Batch g = global_batch(model, step, per_rank * ctx.world, dtype);
      ref_opt->zero_grad();
      auto ref_loss = forward_loss(model, *reference, g);
      ref_loss.backward();
      ref_opt->step();

      Batch local{g.x.narrow(0, ctx.rank * per_rank, per_rank), g.y.narrow(0, ctx.rank * per_rank, per_rank)};
      opt->zero_grad();
      auto loss = forward_loss(model, *sharded_model, local);
      loss.backward();
      opt->step();
      at::Tensor mean_loss = loss.detach().clone().reshape({1});
      pg->world()->all_reduce(mean_loss)->wait();
      mean_loss.div_(ctx.world);
      const double d = rel_diff(mean_loss, ref_loss.detach().reshape({1}));
      WORKER_CHECK(d <= tol, combo, " step ", step, ": loss ", mean_loss.item<double>(), " vs local ",
                   ref_loss.item<double>(), " (rel diff ", d, ")");
    }
    auto full = sharded->full_state_dict();
    for (const auto& kv : reference->named_parameters()) {
      auto it = full.find(kv.key());
      WORKER_CHECK(it != full.end(), combo, ": parameter ", kv.key(), " missing from full_state_dict");
      const double d = rel_diff(it->second, kv.value().detach());
      WORKER_CHECK(d <= tol, combo, ": parameter ", kv.key(), " differs from local training by rel ", d);
    }
    if (ctx.rank == 0) std::cout << combo << " ok" << std::endl;
  }
}

std::vector<std::string> combos_for(int world) {
  std::vector<std::string> strategies{"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"};
  if (world == 4) strategies.push_back("HYBRID_SHARD");
  std::vector<std::string> out;
  for (const char* model : {"mlp", "gpt"})
    for (const auto& s : strategies)
      for (const char* o : {"sgd", "adamw"})
        for (const char* d : {"f32", "f64"}) out.push_back(std::string(model) + ":" + s + ":" + o + ":" + d);
  if (world == 4) {  // hybrid with the overlap options (FULL_SHARD's are covered in overlap_test)
    // Not adamw:f32 here: on this 4-block model at world 4, AdamW in float32 ends 1.16e-5 (rel)
    // from local training with or without the overlap options (summation order; Adam rescales
    // near-zero gradients); the same run in float64 agrees to 1e-12.
    out.push_back("gpt4:HYBRID_SHARD:sgd:f32:post+fwd+lim1");
    out.push_back("gpt4:HYBRID_SHARD:adamw:f64:pre+fwd+nolim");
  }
  return out;
}

class ExactTest : public ::testing::TestWithParam<int> {};

TEST_P(ExactTest, MatchesLocalTrainingForEveryStrategyOptimizerAndDtype) {
  const int world = GetParam();
  auto r = launch("exact_worker", world, combos_for(world));
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_NE(r.ranks[0].output.find("gpt:" + std::string(world == 4 ? "HYBRID_SHARD" : "NO_SHARD") + ":adamw:f64 ok"),
            std::string::npos)
      << r.report();
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ExactTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// The same over Gloo's TCP transport (the runs above use shared memory, the default within a host):
// world 3 (padding) and world 4 (hybrid sharding's two groups).
class ExactOverTcpTest : public ::testing::TestWithParam<int> {};

TEST_P(ExactOverTcpTest, MatchesLocalTrainingForEveryStrategyOptimizerAndDtype) {
  const int world = GetParam();
  auto r = launch("exact_worker", world, combos_for(world), 300, {"FSDP_TRANSPORT=tcp"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_NE(r.ranks[0].output.find("gpt:" + std::string(world == 4 ? "HYBRID_SHARD" : "NO_SHARD") + ":adamw:f64 ok"),
            std::string::npos)
      << r.report();
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ExactOverTcpTest, ::testing::Values(3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace fsdp_test
