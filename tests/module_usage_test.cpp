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

}  // namespace
}  // namespace fsdp_test
