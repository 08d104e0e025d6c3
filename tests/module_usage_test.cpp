// Module usage: unused modules, two forwards, a module called twice, a submodule alone, eval BatchNorm.
#include <gtest/gtest.h>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// Each case: a loss over (model, inputs) using the model in a particular way.
at::Tensor case_loss(const std::string& name, BranchyImpl& m, const at::Tensor& x) {
  if (name == "unused") return m.b(torch::tanh(m.a(x))).pow(2).mean();                      // 'unused' never read
  if (name == "two_forwards") return m.b(m.a(x)).pow(2).mean() + m.a(x * 2).pow(2).mean();  // a used in two graphs
  if (name == "called_twice") return m.b(m.a(m.a(x))).pow(2).mean();                        // unit module twice
  if (name == "direct_submodule") return m.a->forward(x).sin().mean();                      // only a submodule
  if (name == "eval_bn") return m.b(m.bn(m.a(x))).pow(2).mean();                            // BN with running stats
  throw std::runtime_error("unknown case " + name);
}

FSDP_WORKER(cases_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  for (const auto& name : ctx.args) {
    for (const char* optim : {"sgd", "adamw"}) {
      torch::manual_seed(5);
      Branchy ref;
      torch::manual_seed(5);
      Branchy model;
      if (name == "eval_bn") {  // running statistics are used, so the result is independent of the split
        ref->bn->eval();
        model->bn->eval();
      }
      auto sharded =
          fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()));
      auto make = [&](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
        if (std::string(optim) == "sgd")
          return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.1));
        return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
      };
      auto ref_opt = make(ref->parameters());
      auto opt = make(sharded->parameters());
      const int per_rank = 3;
      for (int step = 0; step < 4; ++step) {
        auto gen = at::detail::createCPUGenerator(50 + step);
        auto x = at::randn({per_rank * ctx.world, 5}, gen);
        ref_opt->zero_grad();
        case_loss(name, *ref, x).backward();
        ref_opt->step();
        opt->zero_grad();
        case_loss(name, *model, x.narrow(0, ctx.rank * per_rank, per_rank)).backward();
        opt->step();
      }
      auto full = sharded->full_state_dict();
      for (const auto& kv : ref->named_parameters()) {
        const double d = rel_diff(full.at(kv.key()), kv.value().detach());
        WORKER_CHECK(d <= 1e-5, name, "/", optim, ": parameter ", kv.key(), " differs from local training by rel ", d);
      }
      if (name == "unused")
        for (const auto& kv : sharded->named_parameters())
          if (kv.first.rfind("unused.", 0) == 0)
            WORKER_CHECK(!kv.second.grad().defined(), "unused parameter ", kv.first, " got a gradient");
    }
    if (ctx.rank == 0) std::cout << name << " ok" << std::endl;
  }
}

TEST(ModuleUsage, UnusedTwoForwardsCalledTwiceDirectSubmoduleAndBuffersMatchLocalTraining) {
  auto r = launch("cases_worker", 3, {"unused", "two_forwards", "called_twice", "direct_submodule", "eval_bn"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "eval_bn ok")) << r.report();
}

// One unit (the root) whose forward takes branch a or b by the batch: every rank's samples take
// one branch, a different one than the rank that holds that branch's shard, so each parameter's
// gradient comes from another rank. `unused` (last in the FlatParameter) no rank reads: at world 3
// the last rank's shard holds nothing else, so it never sees its pieces zeroed.
FSDP_WORKER(used_on_some_ranks_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const bool accumulate = !ctx.args.empty() && ctx.args[0] == "accumulate";
  for (const auto strategy : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kNoShard}) {
    for (const char* optim : {"sgd", "adamw"}) {
      torch::manual_seed(7);
      Branchy ref;
      torch::manual_seed(7);
      Branchy model;
      auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().sharding_strategy(strategy));
      auto make = [&](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
        if (std::string(optim) == "sgd")
          return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
        return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
      };
      auto ref_opt = make(ref->parameters());
      auto opt = make(sharded->parameters());
      // Rank r's samples take branch a when r is odd: the first half of the FlatParameter (a) is
      // then used by ranks that do not hold it.
      auto loss = [](BranchyImpl& m, const at::Tensor& x, int rank) {
        return (rank % 2 == 1 ? m.a(x) : m.b(x)).pow(2).sum();
      };
      for (int step = 0; step < 3; ++step) {
        auto gen = at::detail::createCPUGenerator(70 + step);
        const at::Tensor x = at::randn({ctx.world, 2, 5}, gen);
        const int passes = accumulate ? 2 : 1;  // two backward passes per step, without zero_grad between
        ref_opt->zero_grad();
        for (int pass = 0; pass < passes; ++pass) {
          at::Tensor total = at::zeros({});
          for (int r = 0; r < ctx.world; ++r) total = total + loss(*ref, x[r] * (pass + 1), r);
          (total / ctx.world).backward();
        }
        ref_opt->step();
        opt->zero_grad();
        for (int pass = 0; pass < passes; ++pass) loss(*model, x[ctx.rank] * (pass + 1), ctx.rank).backward();
        opt->step();
      }
      auto full = sharded->full_state_dict();
      for (const auto& kv : ref->named_parameters()) {
        const double d = rel_diff(full.at(kv.key()), kv.value().detach());
        WORKER_CHECK(d <= 1e-5, optim, ": parameter ", kv.key(), " differs from local training by rel ", d);
      }
      for (const auto& kv : sharded->named_parameters())
        if (kv.first.rfind("unused.", 0) == 0)
          WORKER_CHECK(!kv.second.grad().defined(), "unused parameter ", kv.first, " got a gradient");
    }
  }
  if (ctx.rank == 0) std::cout << "used on some ranks ok" << std::endl;
}

TEST(ModuleUsage, ParametersUsedOnSomeRanksOnlyTrainLikeLocal) {
  for (const auto& [world, args] :
       std::vector<std::pair<int, std::vector<std::string>>>{{2, {}}, {3, {}}, {2, {"accumulate"}}}) {
    auto r = launch("used_on_some_ranks_worker", world, args);
    ASSERT_TRUE(r.all_ok()) << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, "used on some ranks ok")) << r.report();
  }
}

}  // namespace
}  // namespace fsdp_test
