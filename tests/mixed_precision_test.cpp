// Mixed precision: full-precision shards, compute in param_dtype, gradients reduced in
// reduce_dtype; equal to a local reference that performs the same casts at the same points. The
// sharded gradient scaler for float16: a non-finite gradient on any rank skips the step on every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "harness.h"
#include "mixed_precision_reference.h"
#include "models.h"

namespace fsdp_test {
namespace {

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "bf16") return at::kBFloat16;
  if (s == "fp16") return at::kHalf;
  if (s == "fp32") return at::kFloat;
  throw std::runtime_error("unknown dtype " + s);
}

fsdp::Options options(const std::string& strategy, const fsdp::MixedPrecision& mp) {
  auto o = fsdp::Options()
               .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
               .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>())
               .mixed_precision(mp);
  if (strategy == "HYBRID_SHARD") o.sharding_factor(2);
  return o;
}

// args: strategy, param dtype, reduce dtype. bf16 compute: per-rank losses and parameters after 3
// AdamW steps equal to the local reference within 1e-6 relative.
FSDP_WORKER(mixed_precision_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  const auto param_dtype = parse_dtype(ctx.args.at(1)), reduce_dtype = parse_dtype(ctx.args.at(2));
  MixedPrecisionTriplet models;
  TinyTransformer ref = models.master, model = models.model;
  LocalMixedPrecision<TinyTransformer> local(ref, models.compute, param_dtype, reduce_dtype);
  const auto mp = fsdp::MixedPrecision().param_dtype(param_dtype).reduce_dtype(reduce_dtype);
  auto sharded = fsdp::fully_shard(model, pg, options(strategy, mp));

  // The parameters compute in param_dtype; the pieces the optimizer steps stay float32.
  for (const auto& p : model->parameters())
    WORKER_CHECK(p.scalar_type() == param_dtype, "a parameter is ", p.scalar_type(), " under mixed precision");
  for (const auto& p : sharded->parameters())
    WORKER_CHECK(p.scalar_type() == at::kFloat, "a piece is ", p.scalar_type());
  for (const auto& u : sharded->units())
    WORKER_CHECK(u.padded_bytes == u.padded_numel * static_cast<int64_t>(c10::elementSize(param_dtype)), "unit '",
                 u.name, "' unsharded bytes ", u.padded_bytes, " for ", u.padded_numel, " elements");

  torch::optim::AdamW ref_opt(local.parameters(), torch::optim::AdamWOptions(0.01)),
      opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
  const int rows = 2;
  for (int step = 0; step < 3; ++step) {
    const auto x = at::randint(0, 32, {rows * ctx.world, 8}, at::detail::createCPUGenerator(50 + step));
    ref_opt.zero_grad();
    const auto losses = local.backward(x, ctx.world, rows, 1.0, cast_lm_loss);
    ref_opt.step();
    opt.zero_grad();
    at::Tensor loss = cast_lm_loss(model, x.narrow(0, ctx.rank * rows, rows));
    loss.backward();
    opt.step();
    const double mine = loss.item<double>(), theirs = losses.at(ctx.rank);
    WORKER_CHECK(std::abs(mine - theirs) <= 1e-6 * std::abs(theirs), "step ", step, " loss ", mine, " vs local ",
                 theirs);
    for (const auto& p : sharded->parameters())
      WORKER_CHECK(!p.grad().defined() || p.grad().scalar_type() == at::kFloat, "a piece's gradient is ",
                   p.grad().scalar_type());
  }
  expect_same_parameters(*ref, *sharded, 1e-6, strategy + " " + ctx.args.at(1));
  if (ctx.rank == 0) std::cout << strategy << " world " << ctx.world << " mixed precision ok" << std::endl;
}

TEST(MixedPrecision, Bf16ComputeFp32ReduceEqualsLocalReferenceForEveryStrategyAndWorld) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"})
    for (int world : {1, 2, 3, 4}) {
      if (world == 1 && std::string(strategy) != "FULL_SHARD") continue;  // one rank: the strategies coincide
      auto r = launch("mixed_precision_worker", world, {strategy, "bf16", "fp32"});
      ASSERT_TRUE(r.all_ok()) << strategy << " world " << world << "\n" << r.report();
    }
  auto r = launch("mixed_precision_worker", 4, {"HYBRID_SHARD", "bf16", "fp32"});
  ASSERT_TRUE(r.all_ok()) << "HYBRID_SHARD\n" << r.report();
}

// args: param dtype, reduce dtype. Prints the bytes the world communicator's modeled link sent in
// the second iteration.
FSDP_WORKER(wire_bytes_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(3);
  TinyTransformer model(32, 16, 2, 3, 8);
  fsdp::MixedPrecision mp;
  if (ctx.args.at(0) != "fp32") mp.param_dtype(parse_dtype(ctx.args.at(0))).reduce_dtype(parse_dtype(ctx.args.at(1)));
  auto sharded = fsdp::fully_shard(model, pg, options("FULL_SHARD", mp));
  torch::optim::SGD opt(sharded->parameters(), 0.1);
  int64_t before = 0;
  for (int step = 0; step < 2; ++step) {
    const auto stats = fsdp::modeled_link_stats(*pg->world());
    WORKER_CHECK(stats.has_value(), "the world communicator is not modeled; FSDP_NETWORK_MODEL must be set");
    before = stats->wire_bytes;
    opt.zero_grad();
    cast_lm_loss(model, at::randint(0, 32, {2, 8}, at::detail::createCPUGenerator(7 + step))).backward();
    opt.step();
  }
  std::cout << "wire_bytes " << fsdp::modeled_link_stats(*pg->world())->wire_bytes - before << std::endl;
}

int64_t wire_bytes_of(const LaunchResult& r) {
  const std::string& out = r.ranks.at(0).output;
  const auto at = out.find("wire_bytes ");
  return at == std::string::npos ? -1 : std::stoll(out.substr(at + 11));
}

TEST(MixedPrecision, Bf16GathersMoveHalfTheBytes) {
  const std::vector<std::string> env = {"FSDP_NETWORK_MODEL=intra_gbps=1000,inter_gbps=1000"};
  auto full = launch("wire_bytes_worker", 2, {"fp32", "fp32"}, 300, env);
  auto gather_half = launch("wire_bytes_worker", 2, {"bf16", "fp32"}, 300, env);
  auto all_half = launch("wire_bytes_worker", 2, {"bf16", "bf16"}, 300, env);
  ASSERT_TRUE(full.all_ok() && gather_half.all_ok() && all_half.all_ok())
      << full.report() << gather_half.report() << all_half.report();
  const int64_t f = wire_bytes_of(full), g = wire_bytes_of(gather_half), a = wire_bytes_of(all_half);
  std::cout << "wire bytes per iteration: fp32 " << f << ", bf16 gathers + fp32 reduce " << g
            << ", bf16 gathers + bf16 reduce " << a << std::endl;
  ASSERT_GT(f, 0);
  // Everything in bf16: exactly half. bf16 gathers only: the gathers' half (forward and backward
  // gathers are two thirds of FULL_SHARD's traffic) saved.
  EXPECT_EQ(2 * a, f);
  EXPECT_LT(g, f);
  EXPECT_GT(g, a);
}

// An elementwise model (float16 matrix products have no CPU kernel in LibTorch 1.13).
struct ScaleShiftImpl : torch::nn::Module {
  explicit ScaleShiftImpl(int d) {
    w = register_parameter("w", torch::randn({d}) * 0.5 + 1);
    b = register_parameter("b", torch::randn({d}) * 0.1);
  }
  // Softsign: LibTorch 1.13 has no CPU float16 kernel for tanh, sigmoid or clamp.
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = x * w + b;
    return y / (y.abs() + 1);
  }
  torch::Tensor w, b;
};
TORCH_MODULE(ScaleShift);

struct ScaleShiftStackImpl : torch::nn::Module {
  explicit ScaleShiftStackImpl(int d) {
    for (int i = 0; i < 3; ++i) blocks->push_back(ScaleShift(d));
    register_module("blocks", blocks);
    out = register_parameter("out", torch::randn({d}));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& blk : *blocks) x = blk->as<ScaleShiftImpl>()->forward(x);
    return x * out;
  }
  torch::nn::ModuleList blocks;
  torch::Tensor out;
};
TORCH_MODULE(ScaleShiftStack);

at::Tensor square_loss(ScaleShiftStack& m, const at::Tensor& x) { return m->forward(x).to(at::kFloat).pow(2).mean(); }

// args: strategy. float16 compute, float32 reduce, the sharded scaler from a scale that overflows:
// the first steps are skipped on every rank until the scale has backed off; one later step gets a
// NaN injected into one rank's gradient and is skipped on every rank. Equal to a local reference
// with the same scaler rules.
FSDP_WORKER(grad_scaler_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0);
  const int d = 37;  // not a multiple of the world: padding
  torch::manual_seed(5);
  ScaleShiftStack ref(d);
  torch::manual_seed(5);
  ScaleShiftStack ref_compute(d);
  torch::manual_seed(5);
  ScaleShiftStack model(d);
  LocalMixedPrecision<ScaleShiftStack> local(ref, ref_compute, at::kHalf, at::kFloat);
  auto o = fsdp::Options()
               .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
               .auto_wrap_policy(fsdp::wrap::by_type<ScaleShiftImpl>())
               .mixed_precision(fsdp::MixedPrecision().param_dtype(at::kHalf).reduce_dtype(at::kFloat));
  auto sharded = fsdp::fully_shard(model, pg, o);
  const double init_scale = 1 << 24;  // float16 overflows above 65504: the first steps overflow
  fsdp::GradScaler scaler(*sharded, fsdp::GradScalerOptions().init_scale(init_scale).growth_interval(3));
  torch::optim::SGD ref_opt(local.parameters(), 0.1), opt(sharded->parameters(), 0.1);
  double ref_scale = init_scale;
  int ref_tracker = 0, skipped = 0;
  const int rows = 3, inject_step = 8;
  for (int step = 0; step < 12; ++step) {
    const auto x = at::randn({rows * ctx.world, d}, at::detail::createCPUGenerator(70 + step));
    // Local reference with PyTorch's GradScaler rules.
    ref_opt.zero_grad();
    local.backward(x.to(at::kHalf), ctx.world, rows, ref_scale, square_loss);
    bool ref_inf = step == inject_step;
    {
      at::NoGradGuard no_grad;
      for (auto& p : local.parameters())
        if (p.grad().defined()) {
          p.mutable_grad().mul_(1.0 / ref_scale);
          ref_inf = ref_inf || !at::isfinite(p.grad()).all().item<bool>();
        }
    }
    if (!ref_inf) ref_opt.step();
    if (ref_inf) {
      ref_scale *= 0.5, ref_tracker = 0;
    } else if (++ref_tracker == 3) {
      ref_scale *= 2, ref_tracker = 0;
    }
    // Sharded.
    opt.zero_grad();
    const at::Tensor mine = sharded->cast_forward_input(x.narrow(0, ctx.rank * rows, rows));
    WORKER_CHECK(mine.scalar_type() == at::kHalf, "cast_forward_input gave ", mine.scalar_type());
    scaler.scale(square_loss(model, mine)).backward();
    if (step == inject_step && ctx.rank == ctx.world - 1) {
      for (auto& p : sharded->parameters())
        if (p.grad().defined() && p.grad().numel() > 0) {
          p.mutable_grad()[0] = std::nan("");
          break;
        }
    }
    const bool stepped = scaler.step(opt);
    scaler.update();
    WORKER_CHECK(stepped == !ref_inf, "step ", step, ": stepped ", stepped, " but the local reference ",
                 ref_inf ? "skipped" : "stepped");
    WORKER_CHECK(scaler.get_scale() == ref_scale, "step ", step, ": scale ", scaler.get_scale(), " vs ", ref_scale);
    skipped += !stepped;
  }
  WORKER_CHECK(skipped >= 2, "the test must skip steps for overflow and for the injected NaN; skipped ", skipped);
  expect_same_parameters(*ref, *sharded, 1e-6, strategy + " fp16 scaler");
  if (ctx.rank == 0) std::cout << strategy << " scaler ok, " << skipped << " steps skipped" << std::endl;
}

TEST(MixedPrecision, Fp16WithShardedScalerSkipsOverflowingStepsOnEveryRank) {
  for (const char* strategy : {"FULL_SHARD", "NO_SHARD"}) {
    auto r = launch("grad_scaler_worker", 3, {strategy});
    ASSERT_TRUE(r.all_ok()) << strategy << "\n" << r.report();
  }
}

// Bad dtypes are refused with the fix in the message.
FSDP_WORKER(bad_mixed_precision_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  torch::manual_seed(3);
  TinyTransformer model(32, 16, 2, 1, 8);
  try {
    fsdp::fully_shard(model, pg, fsdp::Options().mixed_precision(fsdp::MixedPrecision().param_dtype(at::kInt)));
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(contains(e.what(), "param_dtype must be a floating-point dtype"), "message: ", e.what());
    return;
  }
  WORKER_CHECK(false, "an integer param_dtype was accepted");
}

TEST(MixedPrecision, IntegerDtypeIsAClearError) {
  auto r = launch("bad_mixed_precision_worker", 1);
  ASSERT_TRUE(r.all_ok()) << r.report();
}

}  // namespace
}  // namespace fsdp_test
