// UnitPlan (src/unit_plan.h): module tree + wrap policy -> units and their FlatParameters, on one rank.
#include <gtest/gtest.h>

#include <set>

#include "fsdp/check.h"
#include "fsdp/sharded.h"
#include "models.h"
#include "unit_plan.h"

namespace {

using fsdp_test::Block;
using fsdp_test::BlockImpl;
using fsdp_test::TinyTransformer;

const c10::Device kCpu(c10::kCPU);

std::vector<std::string> unit_names(const fsdp::UnitPlan& plan) {
  std::vector<std::string> names;
  for (const auto& u : plan.units) names.push_back(u.name);
  return names;
}

TEST(UnitPlan, ByTypePolicyMakesEachBlockAUnitUnderTheRoot) {
  TinyTransformer model(50, 16, 2, 3, 8);
  auto plan = fsdp::plan_units(*model, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>()), kCpu);
  EXPECT_EQ(unit_names(plan), (std::vector<std::string>{"", "blocks.0", "blocks.1", "blocks.2"}));
  for (size_t u = 1; u < plan.units.size(); ++u) {
    EXPECT_EQ(plan.units[u].parent, 0);
    EXPECT_EQ(plan.units[u].ancestors, std::vector<int>{0});
  }
  // Every parameter appears once; a block's go to its unit, the rest to the root.
  int64_t numel = 0;
  for (const auto& p : plan.params) {
    numel += p.param.numel();
    const bool in_block = p.name.rfind("blocks.", 0) == 0;
    EXPECT_EQ(p.unit == 0, !in_block) << p.name;
  }
  int64_t expected = 0;  // parameters() lists the tied weight once per module registering it
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : model->parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) expected += p.numel();
  EXPECT_EQ(numel, expected);
}

TEST(UnitPlan, TiedWeightGoesToTheLowestCommonAncestorOnceWithItsAlias) {
  TinyTransformer model(50, 16, 2, 1, 8);
  auto policy = fsdp::wrap::by_predicate(
      [](const std::string& name, const torch::nn::Module&) { return name == "tok" || name == "head"; });
  auto plan = fsdp::plan_units(*model, fsdp::Options().auto_wrap_policy(policy), kCpu);
  const auto it =
      std::find_if(plan.params.begin(), plan.params.end(), [](const auto& p) { return p.name == "tok.weight"; });
  ASSERT_NE(it, plan.params.end());
  EXPECT_EQ(it->aliases, std::vector<std::string>{"head.weight"});
  EXPECT_EQ(it->unit, 0);  // tok and head are separate units: their common ancestor is the root
  // The head unit owns no parameter of its own, so it is dropped.
  EXPECT_EQ(unit_names(plan), (std::vector<std::string>{""}));
  EXPECT_THROW(
      fsdp::plan_units(*model,
                       fsdp::Options().auto_wrap_policy(policy).shared_parameters(fsdp::SharedParameterPolicy::kError),
                       kCpu),
      fsdp::Error);
}

TEST(UnitPlan, FlatParamsGroupByDtypeAndRequiresGradInModuleOrder) {
  TinyTransformer model(50, 16, 2, 1, 8);  // `pos` is frozen
  model->blocks[0]->as<BlockImpl>()->fc2->to(torch::kFloat64);
  auto plan = fsdp::plan_units(*model, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>()), kCpu);
  ASSERT_EQ(plan.units.size(), 2u);
  // Root: float trainable (tok, ln_f) and float frozen (pos). Block: float and double.
  EXPECT_EQ(plan.units[0].flat_params.size(), 2u);
  EXPECT_EQ(plan.units[1].flat_params.size(), 2u);
  for (const auto& fp : plan.flat_params) {
    const auto& first = plan.params[fp.params[0]].param;
    for (size_t k = 0; k < fp.params.size(); ++k) {
      const auto& p = plan.params[fp.params[k]];
      EXPECT_EQ(p.unit, fp.unit);
      EXPECT_EQ(p.param.scalar_type(), first.scalar_type());
      EXPECT_EQ(p.param.requires_grad(), first.requires_grad());
      if (k > 0) {
        EXPECT_LT(fp.params[k - 1], fp.params[k]);  // module order
      }
    }
  }
}

TEST(UnitPlan, ExplicitUnitsAndAnnotationsBecomeUnitsAndNestedUnitsKnowTheirChain) {
  struct Net : torch::nn::Module {
    Net() {
      outer =
          register_module("outer", torch::nn::Sequential(fsdp::Sharded<Block>(Block(8, 2)), torch::nn::Linear(8, 8)));
      last = register_module("last", torch::nn::Linear(8, 4));
    }
    torch::nn::Sequential outer{nullptr};
    torch::nn::Linear last{nullptr};
  };
  auto net = std::make_shared<Net>();
  auto plan = fsdp::plan_units(*net, fsdp::Options().wrap_modules({net->outer.ptr()}), kCpu);
  EXPECT_EQ(unit_names(plan), (std::vector<std::string>{"", "outer", "outer.0"}));
  EXPECT_EQ(plan.units[2].ancestors, (std::vector<int>{1, 0}));
  EXPECT_THROW(fsdp::plan_units(*net, fsdp::Options().wrap_modules({torch::nn::Linear(2, 2).ptr()}), kCpu),
               fsdp::Error);
}

TEST(UnitPlan, BySizePolicyCountsOnlyParametersNoNestedUnitTook) {
  fsdp_test::MLP mlp(8, 8, 2, 3);  // Linear(8,8) x3 (72 elements each), Linear(8,2)
  auto plan = fsdp::plan_units(*mlp, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_size(70)), kCpu);
  // Each 72-element Linear becomes a unit; the 18-element output layer stays in the root.
  EXPECT_EQ(unit_names(plan), (std::vector<std::string>{"", "layers.0", "layers.2", "layers.4"}));
}

TEST(UnitPlan, DescribeIsEqualForEqualModelsAndNamesTheDifference) {
  TinyTransformer a(50, 16, 2, 2, 8), b(50, 16, 2, 2, 8), c(50, 24, 2, 2, 8);
  const auto opts = fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>());
  EXPECT_EQ(fsdp::plan_units(*a, opts, kCpu).describe(), fsdp::plan_units(*b, opts, kCpu).describe());
  EXPECT_NE(fsdp::plan_units(*a, opts, kCpu).describe(), fsdp::plan_units(*c, opts, kCpu).describe());
}

TEST(UnitPlan, BadParametersAreRefusedWithTheirName) {
  struct IntParam : torch::nn::Module {
    IntParam() { register_parameter("count", torch::zeros({3}, torch::kInt64), /*requires_grad=*/false); }
  };
  auto ok = fsdp::plan_units(*std::make_shared<IntParam>(), fsdp::Options(), kCpu);  // frozen integers are fine
  EXPECT_EQ(ok.params.size(), 1u);
  auto lin = torch::nn::Linear(2, 2);
  try {
    fsdp::plan_units(*lin, fsdp::Options(), c10::Device(c10::kCUDA, 0));
    FAIL() << "a CPU model planned for a CUDA process group";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'weight' is on cpu"), std::string::npos) << e.what();
  }
}

}  // namespace
