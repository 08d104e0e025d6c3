// fsdp::Sharded<M>, the explicit form of a unit: unchanged names, exact training, freed on return.
#include <gtest/gtest.h>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

FSDP_WORKER(sharded_exact_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (const auto& combo : ctx.args) {  // "STRATEGY:dtype"
    const auto colon = combo.find(':');
    const auto strategy = fsdp::parse_sharding_strategy(combo.substr(0, colon));
    const auto dtype = combo.substr(colon + 1) == "f64" ? at::kDouble : at::kFloat;
    const double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
    torch::manual_seed(11);
    TinyTransformer reference(32, 16, 2, 3, 8);  // the same model written without FSDP
    torch::manual_seed(11);
    TinyTransformer model(32, 16, 2, 3, 8, /*explicit_units=*/true);
    reference->to(dtype);
    model->to(dtype);
    std::vector<std::string> ref_names, names;
    for (const auto& kv : reference->named_parameters()) ref_names.push_back(kv.key());
    for (const auto& kv : model->named_parameters()) names.push_back(kv.key());
    WORKER_CHECK(names == ref_names, "Sharded changed parameter names");

    auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().sharding_strategy(strategy));  // no policy
    WORKER_CHECK(sharded->units().size() == 4 && sharded->units()[1].name == "blocks.0",
                 "the Sharded blocks must be units: ", sharded->describe());
    torch::optim::AdamW ref_opt(unique_parameters(*reference), torch::optim::AdamWOptions(0.01));
    torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
    const int per_rank = 2;
    for (int step = 0; step < 5; ++step) {
      auto gen = at::detail::createCPUGenerator(500 + step);
      at::Tensor x = at::randint(0, 32, {per_rank * ctx.world, 8}, gen),
                 y = at::randint(0, 32, {per_rank * ctx.world, 8}, gen);
      ref_opt.zero_grad();
      auto ref_loss = lm_loss(reference->forward(x), y);
      ref_loss.backward();
      ref_opt.step();
      opt.zero_grad();
      auto loss = lm_loss(model->forward(x.narrow(0, ctx.rank * per_rank, per_rank)),
                          y.narrow(0, ctx.rank * per_rank, per_rank));
      loss.backward();
      opt.step();
      at::Tensor mean = loss.detach().reshape({1}).clone();
      pg->world()->all_reduce(mean)->wait();
      mean.div_(ctx.world);
      WORKER_CHECK(rel_diff(mean, ref_loss.detach().reshape({1})) <= tol, combo, " step ", step, ": loss differs");
    }
    auto full = sharded->full_state_dict();
    for (const auto& kv : reference->named_parameters())
      WORKER_CHECK(rel_diff(full.at(kv.key()), kv.value().detach()) <= tol, combo, ": ", kv.key(), " differs");
    if (ctx.rank == 0) std::cout << combo << " ok" << std::endl;
  }
}

TEST(Sharded, KeepsNamesAndMatchesLocalTraining) {
  for (int world : {2, 3}) {
    auto r = launch("sharded_exact_worker", world,
                    {"FULL_SHARD:f32", "FULL_SHARD:f64", "SHARD_GRAD_OP:f64", "NO_SHARD:f32"});
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
    EXPECT_NE(r.ranks[0].output.find("NO_SHARD:f32 ok"), std::string::npos) << r.report();
  }
}

// A unit whose forward is the model's last operation: the explicit form frees it on return; the
// implicit form cannot tell that its forward is over and keeps it until backward.
FSDP_WORKER(sharded_free_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (const bool explicit_form : {true, false}) {
    torch::manual_seed(2);
    torch::nn::Sequential model;
    if (explicit_form) {
      model->push_back(fsdp::Sharded<torch::nn::Linear>(torch::nn::Linear(6, 10)));
      model->push_back(torch::nn::Tanh());
      model->push_back(fsdp::Sharded<torch::nn::Linear>(torch::nn::Linear(10, 3)));
    } else {
      model->push_back(torch::nn::Linear(6, 10));
      model->push_back(torch::nn::Tanh());
      model->push_back(torch::nn::Linear(10, 3));
    }
    auto opts = fsdp::Options();
    if (!explicit_form) opts.auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
    auto sharded = fsdp::fully_shard(model.ptr(), pg, opts);
    WORKER_CHECK(sharded->units().size() == 3, "expected 2 Linear units and the root");
    const int64_t resting = sharded->memory_stats().param_bytes;
    auto out = model->forward(torch::randn({4, 6}));
    const int64_t after_forward = sharded->memory_stats().param_bytes;
    const int64_t last_unit = sharded->units()[2].padded_bytes;
    if (explicit_form)
      WORKER_CHECK(after_forward == resting, "explicit: after forward ", after_forward, " bytes, expected the shards ",
                   resting);
    else
      WORKER_CHECK(after_forward == resting + last_unit, "implicit: after forward ", after_forward, " bytes, expected ",
                   resting + last_unit);
    out.pow(2).mean().backward();
    WORKER_CHECK(sharded->memory_stats().param_bytes == resting, "after backward: parameters must be resharded");
  }
  if (ctx.rank == 0) std::cout << "free on return ok" << std::endl;
}

TEST(Sharded, FreesParametersWhenTheUnitReturns) {
  auto r = launch("sharded_free_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_NE(r.ranks[0].output.find("free on return ok"), std::string::npos) << r.report();
}

TEST(Sharded, WithoutFullyShardBehavesLikeTheWrappedModule) {
  torch::manual_seed(3);
  torch::nn::Linear plain(4, 2);
  torch::manual_seed(3);
  fsdp::Sharded<torch::nn::Linear> wrapped(torch::nn::Linear(4, 2));
  auto x = torch::randn({3, 4});
  EXPECT_TRUE(torch::equal(plain(x), wrapped(x)));
  EXPECT_EQ(wrapped->named_parameters().keys(), plain->named_parameters().keys());
}

}  // namespace
}  // namespace fsdp_test
