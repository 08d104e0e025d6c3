// Modules that keep full precision under mixed precision (MixedPrecision::keep_full_precision,
// BatchNorm by default): a convolutional network with BatchNorm and a raw parameter trains under
// bfloat16 with no further option, equal to a local reference in which BatchNorm's parameters and
// running statistics stay float32 and the rest computes in bfloat16; buffer_dtype leaves BatchNorm's
// statistics alone; a forgotten input cast fails with a hint naming the unit and the fix; copies
// of the parameters made before a step are not used after it.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <thread>

#include "fsdp/activation_checkpoint.h"
#include "harness.h"
#include "mixed_precision_reference.h"

namespace fsdp_test {
namespace {

// A convolution, BatchNorm and ReLU: one unit each under the wrap policy below.
struct ConvBnImpl : torch::nn::Module {
  explicit ConvBnImpl(int channels) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, channels, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(channels));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(bn(conv(x))); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(ConvBn);

// Input channels 3 -> 8, two residual ConvBn blocks, one scaled by a raw per-channel parameter (a
// layer scale), global average pooling, a linear head over 4 classes. With `standardize`, an input
// standardization with float32 mean and std buffers comes first; with `checkpointed`, the blocks are
// fsdp::Checkpointed (the same parameter and buffer names).
struct ResNetImpl : torch::nn::Module {
  explicit ResNetImpl(bool standardize, bool checkpointed = false) {
    if (standardize) {
      mean = register_buffer("mean", torch::full({1, 3, 1, 1}, 0.1));
      std_dev = register_buffer("std", torch::full({1, 3, 1, 1}, 2.0));
    }
    stem = register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    stem_bn = register_module("stem_bn", torch::nn::BatchNorm2d(8));
    for (auto* block : {&block1, &block2}) {
      *block =
          checkpointed ? torch::nn::AnyModule(fsdp::Checkpointed<ConvBn>(ConvBn(8))) : torch::nn::AnyModule(ConvBn(8));
      register_module(block == &block1 ? "block1" : "block2", block->ptr());
    }
    layer_scale = register_parameter("layer_scale", torch::full({1, 8, 1, 1}, 0.5));
    head = register_module("head", torch::nn::Linear(8, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (mean.defined()) x = (x - mean) / std_dev;
    auto h = torch::relu(stem_bn(stem(x)));
    h = h + block1.forward(h);
    h = h + layer_scale * block2.forward(h);
    return head(h.mean({2, 3}));
  }
  torch::Tensor mean, std_dev;
  torch::nn::Conv2d stem{nullptr};
  torch::nn::BatchNorm2d stem_bn{nullptr};
  torch::nn::AnyModule block1, block2;
  torch::Tensor layer_scale;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ResNet);

ResNet make_resnet(bool standardize, bool checkpointed = false) {
  torch::manual_seed(7);
  return ResNet(standardize, checkpointed);
}

// Cross entropy of the float32 logits of `x` (images) against labels derived from it.
at::Tensor classification_loss(ResNet& m, const at::Tensor& x) {
  const at::Tensor labels = x.sum({1, 2, 3}).gt(0).to(at::kLong) + 2 * x.select(1, 0).mean({1, 2}).gt(0).to(at::kLong);
  return torch::cross_entropy_loss(m->forward(x).to(at::kFloat), labels);
}

// args: strategy, "standardize" or "plain", optionally "checkpointed" or "sgd_peek". 3 AdamW steps
// on 2 images of 6x6 per rank, bfloat16 compute, float32 reduction, no other option (buffer_dtype
// bfloat16 with "standardize"). "sgd_peek": SGD with momentum (LibTorch's writes the parameters
// without moving their version counters), and the module's parameters read between backward and
// the step (which gathers or casts them before the step changes the shards).
FSDP_WORKER(full_precision_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  const bool standardize = ctx.args.at(1) == "standardize";
  const bool checkpointed = ctx.args.size() > 2 && ctx.args[2] == "checkpointed";
  const bool sgd_peek = ctx.args.size() > 2 && ctx.args[2] == "sgd_peek";
  ResNet ref = make_resnet(standardize), compute = make_resnet(standardize),
         model = make_resnet(standardize, checkpointed);
  LocalMixedPrecision<ResNet> local(ref, compute, at::kBFloat16, at::kFloat, fsdp::MixedPrecision::is_batch_norm);
  if (standardize) {
    at::NoGradGuard no_grad;
    compute->mean.set_data(compute->mean.to(at::kBFloat16));  // as buffer_dtype casts it
    compute->std_dev.set_data(compute->std_dev.to(at::kBFloat16));
  }
  auto mp = fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
  if (standardize) mp.buffer_dtype(at::kBFloat16);
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<ConvBnImpl>())
                     .mixed_precision(mp);
  if (strategy == "HYBRID_SHARD") options.sharding_factor(2);
  auto sharded = fsdp::fully_shard(model, pg, options);

  // BatchNorm's parameters and statistics stay float32; every other parameter computes in bfloat16.
  for (const auto& kv : model->named_parameters()) {
    const bool norm = contains(kv.key(), "bn.") || contains(kv.key(), "stem_bn.");
    WORKER_CHECK(kv.value().scalar_type() == (norm ? at::kFloat : at::kBFloat16), "parameter '", kv.key(), "' is ",
                 kv.value().scalar_type());
  }
  for (const auto& kv : model->named_buffers()) {
    const bool stats = contains(kv.key(), "running_");
    if (stats)
      WORKER_CHECK(kv.value().scalar_type() == at::kFloat, "buffer '", kv.key(), "' is ", kv.value().scalar_type());
    if (standardize && !contains(kv.key(), "bn"))
      WORKER_CHECK(kv.value().scalar_type() == at::kBFloat16, "buffer '", kv.key(), "' is ", kv.value().scalar_type());
  }

  std::unique_ptr<torch::optim::Optimizer> ref_opt, opt;
  if (sgd_peek) {
    ref_opt = std::make_unique<torch::optim::SGD>(local.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    opt = std::make_unique<torch::optim::SGD>(sharded->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  } else {
    ref_opt = std::make_unique<torch::optim::AdamW>(local.parameters(), torch::optim::AdamWOptions(0.01));
    opt = std::make_unique<torch::optim::AdamW>(sharded->parameters(), torch::optim::AdamWOptions(0.01));
  }
  const int rows = 2;
  for (int step = 0; step < 3; ++step) {
    const auto x = at::randn({rows * ctx.world, 3, 6, 6}, at::detail::createCPUGenerator(60 + step));
    ref_opt->zero_grad();
    const auto losses = local.backward(x, ctx.world, rows, 1.0, [&](ResNet& m, const at::Tensor& xs) {
      return classification_loss(m, xs.to(at::kBFloat16));
    });
    ref_opt->step();
    opt->zero_grad();
    // The handle's forward casts the root's input (as PyTorch FSDP does): no cast in user code.
    const at::Tensor rows_here = x.narrow(0, ctx.rank * rows, rows);
    const at::Tensor labels =
        rows_here.sum({1, 2, 3}).gt(0).to(at::kLong) + 2 * rows_here.select(1, 0).mean({1, 2}).gt(0).to(at::kLong);
    at::Tensor loss = torch::cross_entropy_loss(sharded->forward(rows_here).to(at::kFloat), labels);
    loss.backward();
    if (sgd_peek) {
      double sum = 0;
      for (const auto& p : model->parameters()) sum += p.to(at::kDouble).sum().item<double>();
      WORKER_CHECK(std::isfinite(sum), "the parameters read before the step");
    }
    opt->step();
    const double mine = loss.item<double>(), theirs = losses.at(ctx.rank);
    WORKER_CHECK(std::abs(mine - theirs) <= 1e-6 * std::abs(theirs), "step ", step, " loss ", mine, " vs local ",
                 theirs);
  }
  expect_same_parameters(*ref, *sharded, 1e-5, strategy);
  // Rank 0's statistics after 3 steps, broadcast to every rank, as in the reference.
  auto ref_buffers = compute->named_buffers();
  for (const auto& kv : model->named_buffers()) {
    const at::Tensor& theirs = ref_buffers[kv.key()];
    WORKER_CHECK(kv.value().scalar_type() == theirs.scalar_type(), "buffer '", kv.key(), "'");
    WORKER_CHECK(rel_diff(kv.value().to(at::kDouble), theirs.to(at::kDouble)) <= 1e-6, "buffer '", kv.key(),
                 "' differs by ", rel_diff(kv.value().to(at::kDouble), theirs.to(at::kDouble)));
  }
  // Each forward counts once, also in a checkpointed block (its recompute leaves buffers alone).
  for (const auto& kv : model->named_buffers())
    if (contains(kv.key(), "num_batches_tracked"))
      WORKER_CHECK(kv.value().item<int64_t>() == 3, kv.key(), " ", kv.value().item<int64_t>());
  if (ctx.rank == 0) std::cout << strategy << " world " << ctx.world << " full precision modules ok" << std::endl;
}

TEST(FullPrecisionModules, BatchNormKeepsFloat32AndTrainsLikeTheReferenceUnderBf16) {
  for (int world : {1, 2, 4}) {
    auto r = launch("full_precision_worker", world, {"FULL_SHARD", "plain"});
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
  }
  for (const char* strategy : {"SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}) {
    auto r = launch("full_precision_worker", 4, {strategy, "plain"});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

// Gathered or cast copies made after backward do not outlive the step that changes their shards,
// whether the optimizer moves the pieces' version counters or not.
TEST(FullPrecisionModules, CopiesMadeBeforeTheStepAreNotUsedAfterIt) {
  for (int world : {1, 2}) {
    for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
      auto r = launch("full_precision_worker", world, {strategy, "plain", "sgd_peek"});
      ASSERT_TRUE(r.all_ok()) << strategy << " world " << world << "\n" << r.report();
    }
  }
}

TEST(FullPrecisionModules, CheckpointedBlocksUpdateBatchNormStatisticsOnce) {
  for (int world : {1, 2, 4}) {
    auto r = launch("full_precision_worker", world, {"FULL_SHARD", "plain", "checkpointed"});
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
  }
}

TEST(FullPrecisionModules, BufferDtypeCastsOtherBuffersAndLeavesBatchNormStatisticsFloat32) {
  auto r = launch("full_precision_worker", 2, {"FULL_SHARD", "standardize"});
  ASSERT_TRUE(r.all_ok()) << r.report();
}

// args: what the policy keeps ("default", "none", "linear"). Checks each parameter's dtype, then
// (with "none") runs a forward on an input left in float32, which must fail with the hint.
FSDP_WORKER(keep_policy_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string keep = ctx.args.at(0);
  ResNet model = make_resnet(false);
  auto mp = fsdp::MixedPrecision().param_dtype(at::kBFloat16);
  if (keep == "none") mp.keep_full_precision(nullptr);
  if (keep == "linear") mp.keep_full_precision_of<torch::nn::Linear, torch::nn::BatchNorm2dImpl>();
  auto sharded = fsdp::fully_shard(
      model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<ConvBnImpl>()).mixed_precision(mp));
  for (const auto& kv : model->named_parameters()) {
    const bool bn = contains(kv.key(), "bn.");
    const bool kept = (keep != "none" && bn) || (keep == "linear" && contains(kv.key(), "head."));
    WORKER_CHECK(kv.value().scalar_type() == (kept ? at::kFloat : at::kBFloat16), "parameter '", kv.key(), "' is ",
                 kv.value().scalar_type(), " with keep ", keep);
  }
  if (keep == "none") {
    try {
      model->forward(torch::randn({2, 3, 6, 6}));  // not cast: the stem's bfloat16 weight meets a float32 input
      WORKER_CHECK(false, "a float32 input to bfloat16 parameters did not fail");
    } catch (const c10::Error&) {
    }
  }
}

TEST(FullPrecisionModules, ThePolicyChoosesWhichModulesKeepFloat32) {
  for (const char* keep : {"default", "none", "linear"}) {
    auto r = launch("keep_policy_worker", 2, {keep});
    ASSERT_TRUE(r.all_ok()) << keep << "\n" << r.report();
  }
}

// A unit per ConvBn block, bfloat16 compute with BatchNorm in float32 (the default policy).
fsdp::Options bf16_by_block() {
  return fsdp::Options()
      .auto_wrap_policy(fsdp::wrap::by_type<ConvBnImpl>())
      .mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16));
}

// The same mistake in a program that catches nothing: the exception ends the process without
// unwinding, and the hint still comes out before the kernel's error.
FSDP_WORKER(uncaught_input_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  ResNet model = make_resnet(false);
  auto sharded = fsdp::fully_shard(model, pg, bf16_by_block());
  std::thread([&] { model->forward(torch::randn({2, 3, 6, 6})); }).join();  // no handler: std::terminate
  WORKER_CHECK(false, "a float32 input to bfloat16 parameters did not end the program");
}

TEST(FullPrecisionModules, AnUncaughtErrorStillPrintsTheHint) {
  auto r = launch("uncaught_input_worker", 1);
  ASSERT_EQ(r.ranks.size(), 1u);
  EXPECT_NE(r.ranks[0].exit_code, 0) << r.report();
  const std::string& out = r.ranks[0].output;
  const auto hint = out.find("libfsdp: operator aten::");
  EXPECT_NE(hint, std::string::npos) << out;
  EXPECT_TRUE(contains(out, "parameter 'stem.weight' of unit '<root>' in BFloat16")) << out;
  EXPECT_LT(hint, out.find("terminate called")) << out;
}

// Through the handle the root's input is cast, but the model's own float32 buffers (the input
// standardization, no buffer_dtype) promote it back: the error thrown names the unit and the fix.
FSDP_WORKER(hint_through_handle_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  ResNet model = make_resnet(true);
  auto sharded = fsdp::fully_shard(model, pg, bf16_by_block());
  expect_error(
      [&] {
        sharded->forward(torch::randn({2, 3, 6, 6}));
      },
      "parameter 'stem.weight' of unit '<root>' in BFloat16", "a float32 buffer");
  expect_error(
      [&] {
        sharded->forward(torch::randn({2, 3, 6, 6}));
      },
      "MixedPrecision::buffer_dtype casts buffers", "again");
}

// BatchNorm taken out of full precision (keep_full_precision(nullptr)) without buffer_dtype: its
// float32 running statistics meet its bfloat16 parameters. The error opens with the hint.
FSDP_WORKER(batch_norm_in_bf16_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  ResNet model = make_resnet(false);
  auto sharded = fsdp::fully_shard(
      model, pg,
      fsdp::Options()
          .auto_wrap_policy(fsdp::wrap::by_type<ConvBnImpl>())
          .mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).keep_full_precision(nullptr)));
  try {
    sharded->forward(torch::randn({2, 3, 6, 6}));
  } catch (const fsdp::Error& e) {
    const std::string what = e.what();
    WORKER_CHECK(what.rfind("libfsdp: operator aten::", 0) == 0, "the hint does not come first: ", what);
    WORKER_CHECK(contains(what, "bn.weight' of unit") && contains(what, "MixedPrecision::buffer_dtype"), what);
    return;
  }
  WORKER_CHECK(false, "float32 running statistics under bfloat16 BatchNorm parameters did not fail");
}

TEST(FullPrecisionModules, BatchNormInBf16WithFloat32StatisticsFailsWithTheHintFirst) {
  auto r = launch("batch_norm_in_bf16_worker", 1);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

TEST(FullPrecisionModules, AnInputLeftInFloat32FailsWithAHintNamingTheUnitAndTheFix) {
  auto r = launch("keep_policy_worker", 2, {"none"});
  ASSERT_TRUE(r.all_ok()) << r.report();
  for (const auto& rank : r.ranks) {
    EXPECT_TRUE(contains(rank.output, "libfsdp: operator aten::")) << rank.output;
    EXPECT_TRUE(contains(rank.output, "parameter 'stem.weight' of unit '<root>' in BFloat16")) << rank.output;
    EXPECT_TRUE(contains(rank.output, "FullyShardedModule::cast_forward_input(x)")) << rank.output;
  }
  r = launch("hint_through_handle_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace fsdp_test
