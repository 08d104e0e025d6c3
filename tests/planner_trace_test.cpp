// The planner's operator trace (PlanRequest::trace_forward): one forward on the meta device counts
// what the rules cannot see (convolutions, attention, normalization, pooling), operators without a
// meta kernel in this LibTorch included, and equals the rules where they apply.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fsdp/cluster.h"
#include "fsdp/fsdp.h"
#include "fsdp/planner.h"
#include "harness.h"

namespace fsdp_test {
namespace {

namespace nn = torch::nn;

fsdp::PlanRequest world_one() {
  return fsdp::PlanRequest()
      .global_batch(1)
      .strategies({fsdp::ShardingStrategy::kFullShard})
      .precisions({at::kFloat})
      .cpu_offload({false})
      .grads_kept_between_steps(true);
}

// The forward FLOPs per token a plan entry was built from: TFLOP/s counts three forwards per step.
double forward_flops_per_token(const fsdp::PlanEntry& e, int64_t tokens) {
  return e.time.tflops_per_device * 1e12 * e.time.step_s / (3.0 * static_cast<double>(tokens));
}

// Blocks of two Linear layers: by rule and by trace, each keeps its input (d values per token) and
// its hidden layer (4d).
struct LinearStackImpl : nn::Module {
  LinearStackImpl(int d, int depth) {
    for (int i = 0; i < depth; ++i) blocks->push_back(nn::Sequential(nn::Linear(d, 4 * d), nn::Linear(4 * d, d)));
    register_module("blocks", blocks);
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& block : *blocks) x = block->as<nn::Sequential>()->forward(x);
    return x;
  }
  nn::ModuleList blocks;
};
TORCH_MODULE(LinearStack);

TEST(PlannerTrace, EqualsTheRulesOnLinearLayers) {
  fsdp::DeferredInit deferred;
  LinearStack model(64, 3);
  const int64_t seq = 128, d = 64;
  auto request = world_one().seq_len(seq).wrap_policies({{"block", fsdp::wrap::by_type<nn::SequentialImpl>()}});
  const fsdp::Plan by_rules = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  request.trace_forward([&] { model->forward(torch::zeros({1, seq, d})); });
  const fsdp::Plan traced = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  ASSERT_EQ(by_rules.entries.size(), 2U);
  ASSERT_EQ(traced.entries.size(), 2U);
  for (size_t i = 0; i < 2; ++i) {
    const auto& r = by_rules.entries[i];
    const auto& t = traced.entries[i];
    EXPECT_EQ(t.candidate.describe(), r.candidate.describe());
    EXPECT_EQ(t.memory.activations, r.memory.activations) << t.candidate.describe();
    EXPECT_EQ(t.memory.activations,
              t.candidate.activation_checkpointing ? (3 * d + 5 * d) * seq * 4 : 3 * 5 * d * seq * 4);
    EXPECT_NEAR(forward_flops_per_token(t, seq), 3 * 2 * (2.0 * d * 4 * d), 1e-6 * 3 * 2 * (2.0 * d * 4 * d));
    EXPECT_NEAR(t.time.step_s, r.time.step_s, 1e-12);
  }
}

// A small convolutional network: the rules cannot see its spatial sizes, the trace can.
struct ConvNetImpl : nn::Module {
  ConvNetImpl() {
    features = register_module(
        "features", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 8, 3).padding(1)), nn::BatchNorm2d(8), nn::ReLU(),
                                   nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(8, 16, 3).padding(1).groups(2)),
                                   nn::ReLU(), nn::AdaptiveAvgPool2d(1), nn::Flatten()));
    head = register_module("head", nn::Linear(16, 10));
  }
  at::Tensor forward(const at::Tensor& x) { return head->forward(features->forward(x)); }
  nn::Sequential features{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(ConvNet);

TEST(PlannerTrace, CountsConvolutionsPoolingAndNormalizationFromShapes) {
  fsdp::DeferredInit deferred;
  ConvNet model;
  const int64_t images = 2;
  auto request =
      world_one().global_batch(static_cast<int>(images)).micro_batches({2}).activation_checkpointing({false});
  request.trace_sequences(images).trace_forward([&] {
    auto y = model->forward(torch::zeros({images, 3, 16, 16}));
    nn::functional::cross_entropy(y, torch::zeros({images}, torch::kLong));
  });
  const fsdp::Plan plan = fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
  ASSERT_EQ(plan.entries.size(), 1U);
  const fsdp::PlanEntry& e = plan.entries[0];
  // Per image: 8 x 16 x 16 outputs of 3 x 3 x 3 weights, 16 x 8 x 8 of 4 x 3 x 3 (two groups), 16 x 10.
  const double flops = 2.0 * (8 * 16 * 16) * 27 + 2.0 * (16 * 8 * 8) * 36 + 2.0 * 16 * 10;
  EXPECT_NEAR(forward_flops_per_token(e, images), flops, 1e-6 * flops);
  // Kept per image, in values: the image (768); the batch norm's input (2048) and its two statistics
  // (8 + 8 per batch); the ReLU's output (2048); the pool's int64 indices (512, two values' bytes each);
  // the second convolution's input (512) and its ReLU's output (1024); the average pool's input (the
  // same); the head's input (16); the log-softmax's output (10); the loss's targets (int64, 2 values).
  const double kept = images * (768 + 2048 + 2048 + 2 * 512 + 512 + 1024 + 16 + 10 + 2) + 16;
  EXPECT_EQ(e.memory.activations, static_cast<int64_t>(kept * 4)) << plan.table();
}

TEST(PlannerTrace, RefusesAMaterializedModelValueReadsAndBothWaysOfCounting) {
  LinearStack real(8, 1);
  auto request = world_one().seq_len(4).trace_forward([&] { real->forward(torch::zeros({1, 4, 8})); });
  try {
    fsdp::plan(*real, fsdp::Cluster::parse("cpu:1x1"), request);
    FAIL() << "a model on the CPU was traced";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "build the model inside fsdp::DeferredInit")) << e.what();
  }
  fsdp::DeferredInit deferred;
  LinearStack model(8, 1);
  request.trace_forward([&] { model->forward(torch::zeros({1, 4, 8})).sum().item<float>(); });
  try {
    fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
    FAIL() << "a forward that reads a value was traced";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "trace_forward failed on the meta device")) << e.what();
    EXPECT_TRUE(contains(e.what(), "reads a tensor's value")) << e.what();
  }
  request.trace_forward([&] { model->forward(torch::zeros({1, 4, 8})).nonzero(); });
  try {
    fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request);
    FAIL() << "an operator whose result's shape depends on values was traced";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "trace_forward failed on the meta device")) << e.what();
    EXPECT_TRUE(contains(e.what(), "nonzero")) << e.what();
  }
  request.trace_forward([&] {
           model->forward(torch::zeros({1, 4, 8}));
         })
      .module_cost([](const std::string&, const nn::Module&, int64_t) { return fsdp::ModuleCost{}; });
  EXPECT_THROW(fsdp::plan(*model, fsdp::Cluster::parse("cpu:1x1"), request), fsdp::Error);
}

}  // namespace
}  // namespace fsdp_test
