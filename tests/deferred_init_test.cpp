// Deferred initialization: fsdp::DeferredInit, fsdp::materialize, and fully_shard of a deferred model.
// Models built under fsdp::DeferredInit allocate nothing, materialize to the values of an eager
// build, and fully_shard never holds more than one unit unsharded.
#include <gtest/gtest.h>

#include <c10/core/CPUAllocator.h>

#include <unordered_set>

#include "counting_allocator.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// Standard LibTorch modules, constructed in registration order, with parameters and buffers.
struct StandardImpl : torch::nn::Module {
  StandardImpl() {
    emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(11, 6).padding_idx(0)));
    conv = register_module("conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(6, 5, 3)));
    bn = register_module("bn", torch::nn::BatchNorm1d(5));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
    fc = register_module("fc", torch::nn::Linear(4, 3));
  }
  torch::Tensor forward(const torch::Tensor& idx) {  // [B, 6] tokens -> [B, 5, 3]
    auto x = emb(idx).transpose(1, 2);               // [B, 6 channels, 6]
    return fc(ln(bn(conv(x))));                      // conv: length 4
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Conv1d conv{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Standard);

TEST(DeferredInit, StandardModulesMaterializeToTheValuesOfAnEagerBuild) {
  if (!fsdp::DeferredInit::supported()) GTEST_SKIP() << "this LibTorch has no DispatchKey::DeferredInit";
  torch::manual_seed(11);
  Standard eager;
  torch::manual_seed(11);
  Standard deferred(nullptr);
  {
    fsdp::DeferredInit outer;
    { fsdp::DeferredInit nested; }
    deferred = Standard();  // still deferred after the nested scope closed
  }
  EXPECT_TRUE(torch::ones({2}).device().is_cpu()) << "tensors made after the scope must be real";
  ASSERT_TRUE(fsdp::has_deferred_tensors(*deferred));
  std::vector<const c10::TensorImpl*> identities;
  for (const auto& p : deferred->parameters()) {
    EXPECT_TRUE(p.is_meta());
    EXPECT_TRUE(p.requires_grad());
    identities.push_back(p.unsafeGetTensorImpl());
  }
  for (const auto& b : deferred->buffers()) EXPECT_TRUE(b.is_meta());

  fsdp::materialize(*deferred);  // default: each module's reset_parameters(), in pre-order
  EXPECT_FALSE(fsdp::has_deferred_tensors(*deferred));
  size_t i = 0;
  for (const auto& p : deferred->parameters()) {
    EXPECT_EQ(p.unsafeGetTensorImpl(), identities[i++]) << "a parameter changed identity";
    EXPECT_TRUE(p.requires_grad());
  }
  const auto eager_params = eager->named_parameters(), deferred_params = deferred->named_parameters();
  for (const auto& kv : eager_params)
    EXPECT_TRUE(torch::equal(kv.value(), deferred_params[kv.key()])) << "parameter " << kv.key();
  const auto eager_buffers = eager->named_buffers(), deferred_buffers = deferred->named_buffers();
  for (const auto& kv : eager_buffers)
    EXPECT_TRUE(torch::equal(kv.value(), deferred_buffers[kv.key()])) << "buffer " << kv.key();

  // Trains like the eager model (autograd works on the materialized parameters).
  torch::optim::SGD eager_opt(eager->parameters(), 0.1), deferred_opt(deferred->parameters(), 0.1);
  const auto idx = torch::randint(0, 11, {4, 6});
  for (auto* pair : {&eager_opt, &deferred_opt}) pair->zero_grad();
  eager->forward(idx).pow(2).mean().backward();
  deferred->forward(idx).pow(2).mean().backward();
  eager_opt.step();
  deferred_opt.step();
  for (const auto& kv : eager->named_parameters())
    EXPECT_TRUE(torch::equal(kv.value(), deferred->named_parameters()[kv.key()])) << "after a step: " << kv.key();
}

// fsdp::Sharded<M> takes over M's tensors; deferred initialization initializes them as M's.
struct ShardedLinearsImpl : torch::nn::Module {
  ShardedLinearsImpl() {
    a = register_module("a", fsdp::Sharded<torch::nn::Linear>(torch::nn::Linear(5, 4)));
    b = register_module("b", fsdp::Sharded<torch::nn::Linear>(torch::nn::Linear(4, 3)));
  }
  fsdp::Sharded<torch::nn::Linear> a{nullptr}, b{nullptr};
};
TORCH_MODULE(ShardedLinears);

TEST(DeferredInit, ShardedWrappersAreInitializedAsTheModuleTheyWrap) {
  if (!fsdp::DeferredInit::supported()) GTEST_SKIP() << "this LibTorch has no DispatchKey::DeferredInit";
  torch::manual_seed(4);
  ShardedLinears eager;
  torch::manual_seed(4);
  ShardedLinears deferred(nullptr);
  {
    fsdp::DeferredInit scope;
    deferred = ShardedLinears();
  }
  fsdp::materialize(*deferred);
  const auto deferred_params = deferred->named_parameters();
  for (const auto& kv : eager->named_parameters())
    EXPECT_TRUE(torch::equal(kv.value(), deferred_params[kv.key()])) << "parameter " << kv.key();
}

// A module type fsdp::reset_parameters does not know, with its own parameter.
struct CustomImpl : torch::nn::Module {
  CustomImpl() {
    scale = register_parameter("scale", torch::ones({3}));
    fc = register_module("fc", torch::nn::Linear(3, 3));
  }
  torch::Tensor scale;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Custom);

TEST(DeferredInit, ErrorsNameTheModuleAndTheFix) {
  if (!fsdp::DeferredInit::supported()) GTEST_SKIP() << "this LibTorch has no DispatchKey::DeferredInit";
  auto deferred_custom = [] {
    fsdp::DeferredInit deferred;
    return Custom();
  };
  try {
    auto model = deferred_custom();
    fsdp::materialize(*model);
    FAIL() << "an unknown module type must be refused";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "CustomImpl") && contains(e.what(), "param_init_fn")) << e.what();
  }
  try {
    auto model = deferred_custom();
    fsdp::materialize(*model, [](const std::string& name, torch::nn::Module& m) {
      if (name.empty()) m.named_parameters(/*recurse=*/false)["scale"].fill_(2.0);
      if (auto* fc = m.as<torch::nn::Linear>()) fc->weight.zero_();  // forgets the bias
    });
    FAIL() << "an unwritten parameter must be refused";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "unwritten") && contains(e.what(), "'fc.bias'")) << e.what();
  }
  {
    auto model = deferred_custom();
    fsdp::materialize(*model, [](const std::string& name, torch::nn::Module& m) {
      if (name.empty())
        m.named_parameters(/*recurse=*/false)["scale"].fill_(2.0);
      else
        fsdp::reset_parameters(name, m);
    });
    EXPECT_TRUE(torch::equal(model->scale, torch::full({3}, 2.0)));
  }
  try {
    fsdp::DeferredInit deferred;
    Custom model;
    fsdp::materialize(*model);
    FAIL() << "materializing inside the scope must be refused";
  } catch (const fsdp::Error& e) {
    EXPECT_TRUE(contains(e.what(), "inside a fsdp::DeferredInit scope")) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// fully_shard of a deferred model, on ranks.

// TinyTransformer's own table `pos` (a raw parameter of the root) is not a standard module's.
void init_tiny(const std::string& name, torch::nn::Module& module) {
  if (name.empty()) {
    module.named_parameters(/*recurse=*/false)["pos"].normal_(0.0, 0.02);
    return;
  }
  fsdp::reset_parameters(name, module);
}

TinyTransformer build_deferred_tiny() {
  torch::manual_seed(21);
  fsdp::DeferredInit deferred;
  return TinyTransformer(50, 32, 4, 12, 8);
}

FSDP_WORKER(deferred_fully_shard_worker) {
  // Counts every CPU tensor byte from here on, to see what fully_shard holds at its peak.
  auto* counting = new fsdp_bench::CountingAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(counting, /*priority=*/100);
  const auto strategy = fsdp::parse_sharding_strategy(ctx.args.at(0));
  auto pg = fsdp::ProcessGroup::from_env();

  auto ref = build_deferred_tiny();
  fsdp::materialize(*ref, init_tiny);
  int64_t whole = 0;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : ref->parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) whole += p.nbytes();

  auto model = build_deferred_tiny();
  WORKER_CHECK(fsdp::has_deferred_tensors(*model), "the model should be deferred");
  const int64_t live_before = counting->live();
  counting->reset_peak();
  auto sharded = fsdp::fully_shard(model, pg,
                                   fsdp::Options()
                                       .sharding_strategy(strategy)
                                       .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>())
                                       .param_init_fn(init_tiny));
  const int64_t init_peak = counting->peak() - live_before;
  WORKER_CHECK(!fsdp::has_deferred_tensors(*model), "fully_shard left meta tensors");

  // Peak: the shards, the root unit's tensors (materialized first, flattened last, after the tied
  // head), and one block at a time as materialized tensors plus its flat copy.
  const auto& units = sharded->units();
  int64_t shards = 0, largest_block = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    shards += units[u].shard_bytes;
    if (u > 0) largest_block = std::max(largest_block, units[u].padded_bytes);
  }
  const int64_t bound = shards + units[0].padded_bytes + 2 * largest_block + 16 * 1024;
  if (strategy == fsdp::ShardingStrategy::kFullShard)
    WORKER_CHECK(bound < whole, "the model is too small for the bound to mean anything");
  WORKER_CHECK(init_peak <= bound, fsdp::to_string(strategy), ": fully_shard held ", init_peak,
               " tensor bytes at its peak, more than shards ", shards, " + root ", units[0].padded_bytes,
               " + 2 x largest block ", largest_block, " (+16 KiB); the whole model is ", whole, " bytes");

  // The same values as the local materialization, bit for bit, then the same training (SGD: Adam
  // would blow the reduction-order rounding of near-zero gradients up to full-size steps).
  auto full = sharded->full_state_dict();
  for (const auto& kv : ref->named_parameters())
    WORKER_CHECK(torch::equal(full.at(kv.key()), kv.value()), "initial value of ", kv.key());
  torch::optim::SGD ref_opt(unique_parameters(*ref), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt(sharded->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const int rows = 2;
  for (int step = 0; step < 3; ++step) {
    auto gen = at::detail::createCPUGenerator(100 + step);
    const auto x = at::randint(0, 50, {rows * ctx.world, 8}, gen, at::TensorOptions().dtype(at::kLong));
    step_side_by_side(ref, ref_opt, model, opt, x, ctx.rank, rows);
  }
  full = sharded->full_state_dict();
  for (const auto& kv : ref->named_parameters())
    WORKER_CHECK(rel_diff(full.at(kv.key()), kv.value().detach()) <= 1e-5, "after training: ", kv.key(), " differs by ",
                 rel_diff(full.at(kv.key()), kv.value().detach()));
  if (ctx.rank == 0)
    std::cout << fsdp::to_string(strategy) << " init peak " << init_peak << " of whole model " << whole << " ok"
              << std::endl;
}

TEST(DeferredInit, FullyShardMaterializesUnitByUnitAndTrainsLikeLocal) {
  if (!fsdp::DeferredInit::supported()) GTEST_SKIP() << "this LibTorch has no DispatchKey::DeferredInit";
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    auto r = launch("deferred_fully_shard_worker", 3, {strategy});  // 3 ranks: every unit is padded
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
    EXPECT_TRUE(contains(r.ranks[0].output, std::string(strategy) + " init peak")) << r.report();
  }
}

FSDP_WORKER(deferred_bad_init_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto model = build_deferred_tiny();
  fsdp::fully_shard(model, pg);  // no param_init_fn: the root's raw `pos` table has no known initializer
}

TEST(DeferredInit, FullyShardWithoutAnInitializerForACustomModuleFailsOnEveryRank) {
  if (!fsdp::DeferredInit::supported()) GTEST_SKIP() << "this LibTorch has no DispatchKey::DeferredInit";
  auto r = launch("deferred_bad_init_worker", 2, {}, 120);
  ASSERT_FALSE(r.timed_out) << r.report();
  for (const auto& rank : r.ranks) {
    EXPECT_NE(rank.exit_code, 0) << r.report();
    EXPECT_TRUE(contains(rank.output, "TinyTransformerImpl") && contains(rank.output, "param_init_fn")) << r.report();
  }
}

}  // namespace
}  // namespace fsdp_test
