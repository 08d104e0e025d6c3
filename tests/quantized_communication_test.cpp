// Options::all_gather_quantization and reduce_quantization: the block quantization round trip stays
// within its bound, and training whose all-gathers and gradient reductions (reduce-scatters, the
// all-reduces of NO_SHARD and of HYBRID_SHARD's replicas) carry int8 codes equals a local
// reference that quantizes the same shards, gradient parts and sums with its own code (every value
// rounded to nearest on a scale of max|block| / 127), with and without error feedback, under every
// strategy at worlds 1-4; the full-precision shards stay the optimizer's master copy.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "block_quantization.h"
#include "fsdp/checkpoint.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

TEST(QuantizedCommunication, RoundTripStaysWithinTheBound) {
  std::vector<fsdp::QuantizedDtype> dtypes = {fsdp::QuantizedDtype::kInt8};
  if (fsdp::has_float8()) dtypes.push_back(fsdp::QuantizedDtype::kFloat8E4M3);
  for (const auto dtype : dtypes)
    for (const int64_t block : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{256},
                                std::numeric_limits<int64_t>::max()})  // the last: one block per segment
      for (const int64_t n : {0, 1, 63, 64, 1000, 4099})
        for (const bool with_cuts : {false, true}) {
          // With cuts: a part of a flat buffer from offset 37 whose parameters start at 30, 40, 41,
          // 100 and 700 (blocks restart at each that falls inside the part).
          fsdp::BlockFormat f{dtype, block,
                              with_cuts ? fsdp::parameter_cuts({0, 700, 30, 41, 40, 100}, 5000) : nullptr};
          const int64_t origin = with_cuts ? 37 : 0;
          const std::string what = fsdp::to_string(dtype) + " block " + std::to_string(block) + " n " +
                                   std::to_string(n) + (with_cuts ? " with cuts" : "");
          auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(n * 31 + block));
          // Magnitudes over several orders, one block of zeros, one of a single huge value.
          at::Tensor x = at::randn({n}, gen) * at::pow(10.0, at::randint(-3, 3, {n}, gen).to(at::kFloat));
          if (n / 2 > block) {
            x.narrow(0, 0, block).zero_();
            x[block] = 1e30;
          }
          std::vector<std::pair<int64_t, int64_t>> blocks;
          f.for_each_block(origin, n, [&](int64_t start, int64_t len) { blocks.emplace_back(start, len); });
          // The blocks tile the part in order, none longer than `block`, none across a cut.
          int64_t covered = 0;
          for (const auto& [start, len] : blocks) {
            ASSERT_EQ(start, covered) << what;
            ASSERT_TRUE(len >= 1 && len <= block) << what;
            if (with_cuts) {
              for (const int64_t cut : *f.cuts) {
                ASSERT_FALSE(origin + start < cut && cut < origin + start + len) << what;
              }
            }
            covered += len;
          }
          ASSERT_EQ(covered, n) << what;
          at::Tensor packed = at::empty({f.packed_bytes(n, origin)}, at::kByte);
          ASSERT_EQ(packed.numel(), static_cast<int64_t>(4 * blocks.size()) + n) << what;
          fsdp::quantize_into(packed, x, f, origin);
          at::Tensor back = at::empty({n});
          fsdp::dequantize_into(back, packed, f, origin);
          for (const auto& [start, len] : blocks) {
            const at::Tensor xs = x.narrow(0, start, len), ys = back.narrow(0, start, len);
            const double bound = fsdp::error_bound(xs.abs().max().item<double>(), f);
            const double err = (xs.to(at::kDouble) - ys.to(at::kDouble)).abs().max().item<double>();
            ASSERT_LE(err, bound) << what << " block at " << start;
          }
          if (n / 2 > block && !with_cuts) {
            EXPECT_TRUE(back.narrow(0, 0, block).eq(0).all().item<bool>());
          }
          // The one-pass CPU path (float32 in, int8 codes; float32 or bf16 out) and the tensor
          // operations (any other dtype) give the same bytes and values.
          at::Tensor generic = at::empty_like(packed);
          fsdp::quantize_into(generic, x.to(at::kDouble), f, origin);
          ASSERT_TRUE(torch::equal(generic, packed)) << what;
          at::Tensor wide = at::empty({n}, at::kDouble), narrow = at::empty({n}, at::kBFloat16);
          fsdp::dequantize_into(wide, packed, f, origin);
          fsdp::dequantize_into(narrow, packed, f, origin);
          ASSERT_TRUE(torch::equal(wide.to(at::kFloat), back)) << what;
          ASSERT_TRUE(torch::equal(narrow, back.to(at::kBFloat16))) << what;
          // A packed form at an odd byte offset (a slot of a gathered buffer) reads the same.
          at::Tensor shifted = at::empty({packed.numel() + 3}, at::kByte);
          fsdp::quantize_into(shifted.narrow(0, 3, packed.numel()), x.to(at::kDouble), f, origin);
          ASSERT_TRUE(torch::equal(shifted.narrow(0, 3, packed.numel()), packed)) << what;
          // The one-pass sum of packed parts (vectorized where the CPU allows) against the tensor
          // operations' dequantized parts added in float32 in order.
          const int64_t stride = packed.numel() + 5;
          at::Tensor parts = at::zeros({3 * stride}, at::kByte);
          at::Tensor expected = at::zeros({n});
          for (int64_t r = 0; r < 3; ++r) {
            const at::Tensor part = parts.narrow(0, r * stride, packed.numel());
            fsdp::quantize_into(part, x * std::array<double, 3>{1.0, -0.5, 3.0}[r], f, origin);
            at::Tensor values = at::empty({n}, at::kDouble);
            fsdp::dequantize_into(values, part, f, origin);
            expected = r == 0 ? values.to(at::kFloat) : expected + values.to(at::kFloat);
          }
          at::Tensor sum = at::empty({n});
          fsdp::sum_dequantized_into(sum, parts, 3, stride, f, origin);
          ASSERT_TRUE(torch::equal(sum, expected)) << what;
        }
}

// A NaN or an infinity reaches the decoded values (its whole block is not finite: the block's
// scale is not), as it would unquantized, so clipping and loss scaling see it; the other blocks stay
// finite, and error feedback's residual keeps none of it for the next steps.
TEST(QuantizedCommunication, NonFiniteValuesStayNonFiniteAndLeaveNoResidual) {
  std::vector<fsdp::QuantizedDtype> dtypes = {fsdp::QuantizedDtype::kInt8};
  if (fsdp::has_float8()) dtypes.push_back(fsdp::QuantizedDtype::kFloat8E4M3);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const auto dtype : dtypes)
    for (const float bad : {nan, -nan, inf, -inf})
      for (const int64_t at : {0, 5, 20, 37, 63}) {  // in the vector loops' bodies and their tails
        const fsdp::BlockFormat f{dtype, 64, nullptr};
        const int64_t n = 192;
        const std::string what = fsdp::to_string(dtype) + " value " + std::to_string(bad) + " at " + std::to_string(at);
        at::Tensor x = at::randn({n}, at::detail::createCPUGenerator(at));
        x[64 + at] = bad;
        for (const at::ScalarType in : {at::kFloat, at::kDouble}) {  // the one-pass loop and the tensor operations
          at::Tensor packed = at::empty({f.packed_bytes(n, 0)}, at::kByte);
          fsdp::quantize_into(packed, x.to(in), f, 0);
          at::Tensor back = at::empty({n});
          fsdp::dequantize_into(back, packed, f, 0);
          EXPECT_TRUE(at::isfinite(back.narrow(0, 0, 64)).all().item<bool>()) << what;
          EXPECT_TRUE(at::isfinite(back.narrow(0, 128, 64)).all().item<bool>()) << what;
          EXPECT_FALSE(at::isfinite(back[64 + at]).item<bool>()) << what;
          at::Tensor sum = at::empty({n});
          fsdp::sum_dequantized_into(sum, packed, 1, packed.numel(), f, 0);
          EXPECT_FALSE(at::isfinite(sum[64 + at]).item<bool>()) << what;
        }
        at::Tensor residual = at::zeros({n});
        at::Tensor packed = at::empty({f.packed_bytes(n, 0)}, at::kByte);
        fsdp::quantize_with_feedback(packed, x, residual, f, 0);
        EXPECT_TRUE(at::isfinite(residual).all().item<bool>()) << what;
        fsdp::quantize_with_feedback(packed, at::ones({n}), residual, f, 0);  // a clean step after it
        at::Tensor back = at::empty({n});
        fsdp::dequantize_into(back, packed, f, 0);
        EXPECT_TRUE(at::isfinite(back).all().item<bool>()) << what;
      }
}

// The one-pass float8 codes (vectorized where the CPU allows) equal LibTorch's float8 conversion on
// float bit patterns spread over every binade up to 448, both signs, the subnormals and ties included: in
// blocks of 256 that each start with 448, so every other value is coded on a scale of exactly 1.
TEST(QuantizedCommunication, Fp8CodesEqualLibTorchsConversion) {
  if (!fsdp::has_float8()) GTEST_SKIP() << "this LibTorch has no float8 type";
  constexpr int64_t kBlock = 256;
  // A sweep with an odd stride, and every pattern on the grid of half a float8 step (the ties).
  const at::Tensor patterns =
      at::cat({at::arange(0, 0x43e00001, 997, at::kLong), at::arange(0, 0x43e00001, 1 << 19, at::kLong)}).to(at::kInt);
  at::Tensor v = at::cat({patterns.view(at::kFloat), patterns.view(at::kFloat).neg()});
  const int64_t per = kBlock - 1, blocks = (v.numel() + per - 1) / per;
  v = at::constant_pad_nd(v, {0, blocks * per - v.numel()}).view({blocks, per});
  const at::Tensor x = at::cat({at::full({blocks, 1}, 448.0f), v}, 1).reshape({-1});
  const fsdp::BlockFormat f{fsdp::QuantizedDtype::kFloat8E4M3, kBlock, nullptr};
  at::Tensor ours = at::empty({f.packed_bytes(x.numel(), 0)}, at::kByte), theirs = at::empty_like(ours);
  fsdp::quantize_into(ours, x, f, 0);                    // float32: the one-pass codes
  fsdp::quantize_into(theirs, x.to(at::kDouble), f, 0);  // any other dtype: LibTorch's conversion
  const at::Tensor differ = ours.ne(theirs);
  ASSERT_FALSE(differ.any().item<bool>()) << differ.sum().item<int64_t>() << " of " << ours.numel() << " bytes differ";
  // Decoding: the one-pass values equal the tensor operations' (float8 to float32, times the scale).
  at::Tensor one_pass = at::empty({x.numel()}), generic = at::empty({x.numel()}, at::kDouble);
  fsdp::dequantize_into(one_pass, ours, f, 0);
  fsdp::dequantize_into(generic, ours, f, 0);
  ASSERT_TRUE(torch::equal(one_pass, generic.to(at::kFloat)));
}

// `v` (|v| <= 448) rounded to the nearest float8 e4m3fn value (ties to even): 3 bits below the
// leading one, exponents from -6, values below 2^-6 on the subnormal grid of 2^-9.
float reference_e4m3(float v) {
  if (v == 0) return v;
  int e = 0;
  std::frexp(v, &e);  // |v| = m 2^e, m in [0.5, 1)
  const float step = std::ldexp(1.0f, std::max(e - 1, -6) - 3);
  return std::copysign(std::min(448.0f, std::nearbyint(std::fabs(v) / step) * step), v);
}

// The reference's own quantization of one part of a unit's flat buffer (from `origin`; the unit's
// parameters start at `starts`): int8 codes on max|block| / 127 per block of `block` values (fp8:
// e4m3 codes on max|block| / 448), blocks restarting where a parameter (or the padding) starts,
// rounded to nearest (ties to even), scale and product in float32.
at::Tensor reference_round_trip(const at::Tensor& part, int64_t block, const std::vector<int64_t>& starts,
                                int64_t origin, bool fp8 = false) {
  auto x = part.contiguous();
  at::Tensor y = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  const int64_t n = x.numel();
  for (int64_t start = 0; start < n;) {
    int64_t end = std::min(n, start + block);
    for (const int64_t s : starts)  // a parameter starting inside the block ends it there
      if (s - origin > start && s - origin < end) end = s - origin;
    float amax = 0;
    for (int64_t i = start; i < end; ++i) amax = std::max(amax, std::fabs(src[i]));
    const float scale = amax / (fp8 ? 448.0f : 127.0f);
    for (int64_t i = start; i < end; ++i) {
      if (fp8) {
        dst[i] = scale > 0 ? reference_e4m3(src[i] / scale) * scale : 0.0f;
        continue;
      }
      const float q = scale > 0 ? std::nearbyint(src[i] / scale) : 0.0f;
      dst[i] = std::min(127.0f, std::max(-127.0f, q)) * scale;
    }
    // The next block starts here, or at the next block boundary of this parameter's run.
    start = end;
  }
  return y;
}

// Where each parameter of unit `u` starts in its flat buffer, and where the padding starts.
std::vector<int64_t> parameter_starts(torch::nn::Module& model, const fsdp::UnitInfo& u) {
  const auto params = model.named_parameters();
  std::vector<int64_t> starts;
  int64_t offset = 0;
  for (const auto& name : u.parameters) {
    starts.push_back(offset);
    offset += params[name].numel();
  }
  starts.push_back(offset);
  return starts;
}

// Overwrites `model`'s parameters unit by unit with what a quantized gather delivers: each unit's
// flat parameter padded to a multiple of `shards` and each shard quantized on its own.
void quantize_like_the_gather(torch::nn::Module& model, const std::vector<fsdp::UnitInfo>& units, int shards,
                              int64_t block, bool fp8) {
  const auto params = model.named_parameters();
  torch::NoGradGuard no_grad;
  for (const auto& u : units) {
    if (u.parameters.empty()) continue;
    std::vector<at::Tensor> flat;
    for (const auto& name : u.parameters) flat.push_back(params[name].reshape({-1}));
    at::Tensor all = torch::cat(flat);
    const int64_t padded = (all.numel() + shards - 1) / shards * shards, per = padded / shards;
    all = at::constant_pad_nd(all, {0, padded - all.numel()});
    std::vector<at::Tensor> parts;
    const std::vector<int64_t> starts = parameter_starts(model, u);
    for (int s = 0; s < shards; ++s)
      parts.push_back(reference_round_trip(all.narrow(0, s * per, per), block, starts, s * per, fp8));
    at::Tensor back = torch::cat(parts);
    int64_t offset = 0;
    for (const auto& name : u.parameters) {
      at::Tensor p = params[name];
      p.copy_(back.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
  }
}

// The reference's error feedback: per rank, flat parameter, quantization point and part, what
// rounding dropped (float32), added to the next values sent there; none when off.
struct ReferenceFeedback {
  bool on = false;
  bool fp8 = false;  // the codes' format: float8 e4m3, else int8
  std::map<std::string, at::Tensor> residuals;
  // What travels of `x` (a unit's flat values from `origin`) from quantization point `key`: its
  // round trip, after feedback.
  at::Tensor send(const at::Tensor& x, const std::string& key, int64_t block, const std::vector<int64_t>& starts,
                  int64_t origin) {
    if (!on) return reference_round_trip(x, block, starts, origin, fp8);
    auto it = residuals.emplace(key, at::zeros_like(x)).first;
    const at::Tensor v = x + it->second, y = reference_round_trip(v, block, starts, origin, fp8);
    it->second = v - y;
    return y;
  }
};

std::string key(int rank, size_t unit, const char* point, int64_t part) {
  return std::to_string(rank) + "/" + std::to_string(unit) + "/" + point + "/" + std::to_string(part);
}

// The reference's quantized all-reduce of `inputs` (member m's values, global rank ranks[m]; the
// unit's flat values from `origin`): W parts of ceil(N / W) values, each member's part quantized,
// summed by its owner in member order, the sum quantized once and given to every member.
at::Tensor reference_all_reduce(const std::vector<at::Tensor>& inputs, const std::vector<int>& ranks, size_t unit,
                                int64_t block, const std::vector<int64_t>& starts, int64_t origin,
                                ReferenceFeedback& fb) {
  const int W = static_cast<int>(inputs.size());
  const int64_t N = inputs[0].numel(), p = (N + W - 1) / W;
  std::vector<at::Tensor> parts;
  for (int o = 0; o < W; ++o) {
    const int64_t len = std::max<int64_t>(0, std::min(p, N - o * p));
    if (len == 0) continue;
    at::Tensor sum;
    for (int m = 0; m < W; ++m) {
      const at::Tensor got =
          fb.send(inputs[m].narrow(0, o * p, len), key(ranks[m], unit, "sent", o), block, starts, origin + o * p);
      sum = m == 0 ? got.clone() : sum.add_(got);
    }
    parts.push_back(fb.send(sum, key(ranks[o], unit, "summed", 0), block, starts, origin + o * p));
  }
  return torch::cat(parts);
}

// The reference's gradient for a step: each rank's gradient (its own rows) flattened per unit and
// padded to `shards` parts. Sharded (shards > 1): each part quantized on its own as it travels,
// summed over the shard group in rank order in float32; with several shard groups, those sums
// all-reduced across replicas as reference_all_reduce does. NO_SHARD (shards 1, world > 1): the
// gradients all-reduced so. Divided by the world size.
void quantized_mean_gradient(MLP& ref, const std::vector<fsdp::UnitInfo>& units, const at::Tensor& x, int world,
                             int shards, int64_t block, ReferenceFeedback& fb) {
  auto params = ref->named_parameters();
  std::vector<std::vector<at::Tensor>> grads(units.size());  // per unit, per rank: the padded flat gradient
  for (int r = 0; r < world; ++r) {
    for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
    ref->forward(x.narrow(0, 2 * r, 2)).pow(2).mean().backward();
    for (size_t u = 0; u < units.size(); ++u) {
      if (units[u].parameters.empty()) continue;
      std::vector<at::Tensor> flat;
      for (const auto& name : units[u].parameters) flat.push_back(params[name].grad().reshape({-1}));
      at::Tensor all = torch::cat(flat);
      const int64_t padded = (all.numel() + shards - 1) / shards * shards;
      grads[u].push_back(at::constant_pad_nd(all, {0, padded - all.numel()}));
    }
  }
  const int groups = world / shards;
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].parameters.empty()) continue;
    const std::vector<int64_t> starts = parameter_starts(*ref, units[u]);
    at::Tensor total;
    if (shards == 1) {
      std::vector<int> ranks;
      for (int r = 0; r < world; ++r) ranks.push_back(r);
      total = reference_all_reduce(grads[u], ranks, u, block, starts, 0, fb);
    } else {
      const int64_t n = grads[u][0].numel() / shards;
      std::vector<at::Tensor> parts;
      for (int q = 0; q < shards; ++q) {
        std::vector<at::Tensor> group_sums;  // per shard group: the sum of part q over its ranks
        std::vector<int> owners;
        for (int g = 0; g < groups; ++g) {
          at::Tensor sum;
          for (int i = 0; i < shards; ++i) {
            const int r = g * shards + i;
            const at::Tensor got =
                fb.send(grads[u][r].narrow(0, q * n, n), key(r, u, "scatter", q), block, starts, q * n);
            sum = i == 0 ? got.clone() : sum.add_(got);
          }
          group_sums.push_back(sum);
          owners.push_back(g * shards + q);
        }
        parts.push_back(groups > 1 ? reference_all_reduce(group_sums, owners, u, block, starts, q * n, fb)
                                   : group_sums[0]);
      }
      total = torch::cat(parts);
    }
    int64_t offset = 0;
    for (const auto& name : units[u].parameters) {
      params[name].mutable_grad() =
          total.narrow(0, offset, params[name].numel()).view(params[name].sizes()).mul(1.0 / world);
      offset += params[name].numel();
    }
  }
}

// args: strategy, what ("gather", "reduce" or "both"), "feedback" or "plain", and optionally "fp8".
// An MLP whose Linear layers are units, every unit's collectives quantized (int8 or fp8, block 16); SGD. The reference trains
// a local copy on the whole batch: each step computes with the quantized values of its parameters
// and steps the full-precision ones, with the gradients quantized as they travel (and, with
// feedback, the same residuals kept and added). A second reference without feedback shows the
// feedback mattered.
FSDP_WORKER(quantized_training_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0), what = ctx.args.at(1);
  const bool gathers = what != "reduce", reductions = what != "gather", with_feedback = ctx.args.at(2) == "feedback";
  const bool fp8 = ctx.args.size() > 3 && ctx.args.at(3) == "fp8";
  const int64_t block = 16;
  torch::manual_seed(11);
  MLP ref(6, 24, 5, 2);
  torch::manual_seed(11);
  MLP model(6, 24, 5, 2);
  torch::manual_seed(11);
  MLP plain(6, 24, 5, 2);  // trained without any quantization
  torch::manual_seed(11);
  MLP other(6, 24, 5, 2);  // the reference with the other feedback setting
  const auto every_unit = (fp8 ? fsdp::Quantization::float8(block) : fsdp::Quantization::int8(block))
                              .units([](const std::string&, const torch::nn::Module&) { return true; });
  auto options = fsdp::Options()
                     .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
                     .auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>());
  if (gathers) options.all_gather_quantization(every_unit);
  if (reductions) options.reduce_quantization(fsdp::Quantization(every_unit).error_feedback(with_feedback));
  const int factor = ctx.world % 2 ? ctx.world : 2;
  if (strategy == "HYBRID_SHARD") options.sharding_factor(factor);
  auto sharded = fsdp::fully_shard(model, pg, options);
  // Gathers quantize within a shard group of more than one rank (none under NO_SHARD); reductions
  // whenever gradients travel at all (NO_SHARD's all-reduce too).
  const int shards = strategy == "NO_SHARD" ? 1 : strategy == "HYBRID_SHARD" ? factor : ctx.world;
  const bool quantized_reductions = reductions && ctx.world > 1;
  const auto units = sharded->units();
  for (const auto& u : units)  // describe() and units() say where quantization applies
    WORKER_CHECK(u.numel == 0 ||
                     (u.quantized_gathers == (gathers && shards > 1) && u.quantized_reductions == quantized_reductions),
                 "unit '", u.name, "' reports quantized gathers ", u.quantized_gathers, " and reductions ",
                 u.quantized_reductions);
  ReferenceFeedback fb, other_fb;
  fb.on = with_feedback;
  other_fb.on = !with_feedback;
  fb.fp8 = other_fb.fp8 = fp8;
  torch::optim::SGD ref_opt(ref->parameters(), 0.2), opt(sharded->parameters(), 0.2),
      plain_opt(plain->parameters(), 0.2), other_opt(other->parameters(), 0.2);
  // One step of a reference (`r`, its optimizer, its feedback).
  auto reference_step = [&](MLP& r, torch::optim::SGD& r_opt, ReferenceFeedback& r_fb, const at::Tensor& x) {
    std::vector<at::Tensor> master;
    for (const auto& p : r->parameters()) master.push_back(p.detach().clone());
    if (shards > 1 && gathers) quantize_like_the_gather(*r, units, shards, block, fp8);
    r_opt.zero_grad();
    if (quantized_reductions)
      quantized_mean_gradient(r, units, x, ctx.world, shards, block, r_fb);
    else
      r->forward(x).pow(2).mean().backward();
    {
      torch::NoGradGuard no_grad;
      auto ps = r->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(master[i]);
    }
    r_opt.step();
  };
  for (int step = 0; step < 4; ++step) {
    const at::Tensor x = at::randn({2 * ctx.world, 6}, at::detail::createCPUGenerator(90 + step));
    reference_step(ref, ref_opt, fb, x);
    reference_step(other, other_opt, other_fb, x);
    plain_opt.zero_grad();
    plain->forward(x).pow(2).mean().backward();
    plain_opt.step();
    opt.zero_grad();
    model->forward(x.narrow(0, 2 * ctx.rank, 2)).pow(2).mean().backward();
    opt.step();
  }
  const auto full = sharded->full_state_dict();
  double to_ref = 0, to_plain = 0, to_other = 0;
  for (const auto& kv : ref->named_parameters()) to_ref = std::max(to_ref, rel_diff(full.at(kv.key()), kv.value()));
  for (const auto& kv : plain->named_parameters())
    to_plain = std::max(to_plain, rel_diff(full.at(kv.key()), kv.value()));
  for (const auto& kv : other->named_parameters())
    to_other = std::max(to_other, rel_diff(full.at(kv.key()), kv.value()));
  if (ctx.rank == 0)
    std::cout << strategy << " " << what << " " << ctx.args.at(2) << " world " << ctx.world << ": " << to_ref
              << " from the reference, " << to_plain << " from unquantized training, " << to_other
              << " from the reference with the other feedback setting" << std::endl;
  WORKER_CHECK(to_ref < 1e-6, "quantized training is ", to_ref, " from the quantizing reference");
  // The quantization did happen (and the reference's matters): unquantized training is far off.
  const bool quantized = (shards > 1 && gathers) || quantized_reductions;
  WORKER_CHECK(quantized ? to_plain > 20 * std::max(to_ref, 1e-7) : to_plain < 1e-6, "unquantized training is ",
               to_plain, " apart");
  // So did the feedback setting, where reductions are quantized.
  WORKER_CHECK(quantized_reductions ? to_other > 20 * std::max(to_ref, 1e-7) : to_other < 1e-6,
               "the reference with the other feedback setting is ", to_other, " apart");
}

TEST(QuantizedCommunication, QuantizedCollectivesTrainLikeTheLocalReference) {
  for (const std::string what : {"gather", "reduce", "both"})
    for (const std::string strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"})
      for (int world = 1; world <= 4; ++world) {
        auto r = launch("quantized_training_worker", world, {strategy, what, "plain"});
        ASSERT_TRUE(r.all_ok()) << strategy << " " << what << " world " << world << "\n" << r.report();
        std::cout << lines_starting_with(strategy, r.ranks[0].output);
      }
}

TEST(QuantizedCommunication, ErrorFeedbackTrainsLikeTheLocalReferenceWithFeedback) {
  for (const std::string strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"})
    for (int world = 1; world <= 4; ++world) {
      auto r = launch("quantized_training_worker", world, {strategy, "both", "feedback"});
      ASSERT_TRUE(r.all_ok()) << strategy << " world " << world << "\n" << r.report();
      std::cout << lines_starting_with(strategy, r.ranks[0].output);
    }
}

// fp8 (LibTorch 2.1 and later): the same training against the reference's own e4m3 rounding, whose
// values first equal LibTorch's float8 conversion over every binade, the subnormals and the ties.
TEST(QuantizedCommunication, Fp8CollectivesTrainLikeTheLocalReference) {
#if TORCH_VERSION_MAJOR >= 2 && TORCH_VERSION_MINOR >= 1 || TORCH_VERSION_MAJOR >= 3
  at::Tensor v = at::cat({at::linspace(-448, 448, 200001), at::linspace(-0.02, 0.02, 100001),
                          at::randn({100000}, at::detail::createCPUGenerator(5)) * 30});
  v = at::cat({v, (at::arange(0, 256).to(at::kFloat) + 0.5) * std::ldexp(1.0f, -9)});  // ties on the finest grid
  const at::Tensor theirs = v.to(at::kFloat8_e4m3fn).to(at::kFloat);
  at::Tensor ours = at::empty_like(v);
  const float* in = v.data_ptr<float>();
  float* out = ours.data_ptr<float>();
  for (int64_t i = 0; i < v.numel(); ++i) out[i] = reference_e4m3(in[i]);
  ASSERT_TRUE(torch::equal(ours, theirs)) << (ours - theirs).abs().max().item<float>();
#endif
  if (!fsdp::has_float8()) GTEST_SKIP() << "this LibTorch has no float8 type";
  for (const std::string strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"})
    for (int world = 1; world <= 4; ++world)
      for (const std::string feedback : {"plain", "feedback"}) {
        auto r = launch("quantized_training_worker", world, {strategy, "both", feedback, "fp8"});
        ASSERT_TRUE(r.all_ok()) << strategy << " " << feedback << " world " << world << "\n" << r.report();
        std::cout << lines_starting_with(strategy, r.ranks[0].output);
      }
}

// Combinations that cannot work are refused at fully_shard(), naming the options: error feedback
// on the all-gathers (they start from the full-precision shards every time), quantization with
// deterministic training (exact sums; values that do not depend on the world size).
FSDP_WORKER(refused_combinations_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const auto int8 = fsdp::Quantization::int8();
  const std::vector<std::pair<fsdp::Options, std::string>> cases = {
      {fsdp::Options().all_gather_quantization(fsdp::Quantization::int8().error_feedback(true)),
       "error_feedback applies to reduce_quantization only"},
      {fsdp::Options().reduce_quantization(int8).deterministic(true),
       "Options::reduce_quantization and deterministic(true) exclude each other"},
      {fsdp::Options().all_gather_quantization(int8).deterministic(true),
       "Options::all_gather_quantization and deterministic(true) exclude each other"},
      {fsdp::Options().reduce_quantization(
           fsdp::Quantization().units([](const std::string&, const torch::nn::Module&) { return true; })),
       "Options::reduce_quantization sets error_feedback, units or block_size but is not enabled"},
      {fsdp::Options().all_gather_quantization(fsdp::Quantization().block_size(64)), "start from Quantization::int8()"},
      {fsdp::Options().reduce_quantization(fsdp::Quantization::int8().error_feedback(pg->rank() == 0)),
       "passed different Options to fully_shard()"},
      {fsdp::Options().all_gather_quantization(fsdp::Quantization::int8(pg->rank() == 0 ? 64 : 128)),
       "has 'all_gather_quantization int8 block "},
  };
  for (const auto& [options, expected] : cases) {
    MLP model(6, 24, 5, 2);
    std::string message = "nothing was thrown";
    try {
      fsdp::fully_shard(model, pg, options);
    } catch (const fsdp::Error& e) {
      message = e.what();
    }
    WORKER_CHECK(message.find(expected) != std::string::npos, "expected \"", expected, "\", got: ", message);
  }
}

TEST(QuantizedCommunication, CombinationsThatCannotWorkAreRefused) {
  auto r = launch("refused_combinations_worker", 2, {});
  ASSERT_TRUE(r.all_ok()) << r.report();
}

// A load drops error feedback's residuals: after loading a sharded checkpoint, a full checkpoint or
// a full state dict into a model that already trained, the next steps equal those of a fresh model
// that loads the same, bit for bit.
FSDP_WORKER(feedback_after_load_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string& dir = ctx.args.at(0);
  auto make = [&] {
    torch::manual_seed(0);
    TinyTransformer model(50, 16, 2, 2, 8);
    auto sharded = fsdp::fully_shard(model.ptr(), pg,
                                     fsdp::Options()
                                         .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>())
                                         .reduce_quantization(fsdp::Quantization::int8(64).error_feedback(true)));
    return std::make_pair(model, sharded);
  };
  auto steps = [&](TinyTransformer& model, fsdp::FullyShardedModule& sharded, int first, int count) {
    torch::optim::SGD opt(sharded.parameters(), 0.1);
    std::vector<double> losses;
    for (int step = first; step < first + count; ++step) {
      torch::manual_seed(100 + step * pg->size() + pg->rank());
      const at::Tensor x = torch::randint(50, {2, 8});
      opt.zero_grad();
      const at::Tensor loss = loss_of(model, x);
      loss.backward();
      opt.step();
      losses.push_back(loss.item<double>());
    }
    return losses;
  };
  auto [trained, trained_sharded] = make();
  steps(trained, *trained_sharded, 0, 3);
  fsdp::checkpoint::save(dir + "/sharded", *trained_sharded, nullptr);
  fsdp::checkpoint::export_full(dir + "/full.safetensors", *trained_sharded);
  const auto state = trained_sharded->full_state_dict();
  const std::vector<std::pair<std::string, std::function<void(fsdp::FullyShardedModule&)>>> loads{
      {"checkpoint::load",
       [&](fsdp::FullyShardedModule& m) {
         fsdp::checkpoint::load(dir + "/sharded", m, nullptr);
       }},
      {"checkpoint::load_full",
       [&](fsdp::FullyShardedModule& m) {
         fsdp::checkpoint::load_full(dir + "/full.safetensors", m);
       }},
      {"load_full_state_dict", [&](fsdp::FullyShardedModule& m) {
         m.load_full_state_dict(state);
       }}};
  for (const auto& [what, load] : loads) {
    steps(trained, *trained_sharded, 3, 2);  // residuals from these steps are held when the load comes
    WORKER_CHECK(trained_sharded->memory_stats().feedback_bytes > 0, what, ": no residuals before the load");
    load(*trained_sharded);
    WORKER_CHECK(trained_sharded->memory_stats().feedback_bytes == 0, what, ": residuals kept through the load");
    auto [fresh, fresh_sharded] = make();
    load(*fresh_sharded);
    const std::vector<double> again = steps(trained, *trained_sharded, 3, 3),
                              expected = steps(fresh, *fresh_sharded, 3, 3);
    WORKER_CHECK(again == expected, what, ": the steps after loading into the trained model differ from a fresh one's");
  }
  std::cout << "feedback after load ok" << std::endl;
}

TEST(QuantizedCommunication, ALoadDropsErrorFeedbackResiduals) {
  TempDir tmp;
  auto r = launch("feedback_after_load_worker", 2, {tmp.path});
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "feedback after load ok")) << r.report();
}

}  // namespace
}  // namespace fsdp_test
