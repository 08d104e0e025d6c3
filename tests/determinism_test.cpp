// Options::deterministic: the same micro-batches give bit-identical parameters at every world size,
// sharding strategy and transport, with gradient accumulation, clipping and mixed precision.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "exact_sum.h"
#include "exact_wire.h"
#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

constexpr int kMicroBatches = 12;  // the global batch: a fixed list, split into contiguous ranges
constexpr int kRows = 2;           // rows per micro-batch

// args: strategy, output file, "fp32" or "bf16" (mixed precision), "deterministic" or "default",
// and optionally the optimizer (adamw, lamb, adafactor or muon; default adamw). Trains a float32
// TinyTransformer for 3 steps of kMicroBatches micro-batches (clipping below the norm); rank 0
// saves the full parameters in name order.
FSDP_WORKER(deterministic_worker) {
  at::set_num_threads(1);  // a micro-batch's forward and backward: the same bits on every rank
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0), out = ctx.args.at(1);
  const bool bf16 = ctx.args.at(2) == "bf16", deterministic = ctx.args.at(3) == "deterministic";
  torch::manual_seed(3);
  TinyTransformer model(32, 16, 2, 3, 8);
  auto options = block_unit_options(strategy).deterministic(deterministic);
  if (bf16) options.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kBFloat16));
  auto sharded = fsdp::fully_shard(model, pg, options);
  const std::string kind = ctx.args.size() > 4 ? ctx.args[4] : "adamw";
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (kind == "lamb")
    optimizer = std::make_unique<fsdp::Lamb>(*sharded, fsdp::LambOptions(1e-2));
  else if (kind == "adafactor")
    optimizer = std::make_unique<fsdp::Adafactor>(*sharded, fsdp::AdafactorOptions(1e-2));
  else if (kind == "muon")
    optimizer = std::make_unique<fsdp::Muon>(*sharded, fsdp::MuonOptions(1e-2));
  else
    optimizer = std::make_unique<torch::optim::AdamW>(sharded->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::Optimizer& opt = *optimizer;
  const int begin = kMicroBatches * ctx.rank / ctx.world, end = kMicroBatches * (ctx.rank + 1) / ctx.world;
  // Forwards are collective: a rank with a shorter range runs uncounted padding passes.
  const int passes = (kMicroBatches + ctx.world - 1) / ctx.world;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    for (int m = 0; m < passes; ++m) {
      const int i = begin + m;
      const bool real = i < end;
      const auto x = at::randint(0, 32, {kRows, 8}, at::detail::createCPUGenerator(1000 * step + (real ? i : 0)));
      sharded->set_requires_gradient_sync(m == passes - 1);  // accumulate locally, reduce once
      if (deterministic) sharded->set_backward_counted(real);
      at::Tensor loss = loss_of(model, x);
      // Deterministic mode averages over micro-batches itself; the default averages over ranks.
      if (!deterministic) loss = loss / (end - begin);
      loss.backward();
    }
    sharded->set_backward_counted(true);
    const double norm = sharded->clip_grad_norm_(0.05);
    WORKER_CHECK(norm > 0.05, "the test must clip: norm ", norm);
    opt.step();
  }
  const std::vector<at::Tensor> values = full_tensors_by_name(*sharded);
  if (ctx.rank != 0) return;
  torch::save(values, out);
  std::cout << "saved " << values.size() << " parameters" << std::endl;
}

std::vector<at::Tensor> train(const std::string& strategy, int world, const std::string& out,
                              const std::string& precision = "fp32", const std::string& mode = "deterministic",
                              const std::string& transport = "shm", const std::string& optimizer = "adamw") {
  auto r = launch("deterministic_worker", world, {strategy, out, precision, mode, optimizer}, 300,
                  {"FSDP_TRANSPORT=" + transport});
  EXPECT_TRUE(r.all_ok()) << strategy << " world " << world << "\n" << r.report();
  std::vector<at::Tensor> values;
  if (r.all_ok()) torch::load(values, out);
  return values;
}

TEST(Determinism, EveryWorldSizeAndStrategyGivesTheParametersOfOneRank) {
  TempDir dir;
  const auto reference = train("FULL_SHARD", 1, dir / "reference.pt");
  ASSERT_FALSE(reference.empty());
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"})
    for (int world : {2, 3, 4}) {
      const auto got = train(strategy, world, dir / "run.pt");
      EXPECT_TRUE(bit_identical(got, reference)) << strategy << " at world " << world << " differs from world 1";
    }
  EXPECT_TRUE(bit_identical(train("HYBRID_SHARD", 4, dir / "hybrid.pt"), reference)) << "HYBRID_SHARD at world 4";
}

TEST(Determinism, UnevenSplitsGiveTheParametersOfOneRank) {
  TempDir dir;
  const auto reference = train("FULL_SHARD", 1, dir / "reference.pt");
  ASSERT_FALSE(reference.empty());
  // 12 micro-batches: 2 or 3 per rank at world 5, 1 or 2 at world 8; the short ranks pad.
  EXPECT_TRUE(bit_identical(train("FULL_SHARD", 5, dir / "five.pt"), reference)) << "FULL_SHARD at world 5";
  EXPECT_TRUE(bit_identical(train("SHARD_GRAD_OP", 8, dir / "eight.pt"), reference)) << "SHARD_GRAD_OP at world 8";
}

// The optimizers that need whole parameters take norms and row sums over pieces that each world
// size cuts differently; in double precision (exact squares of float32 values) those sums do not
// depend on the cuts.
TEST(Determinism, WholeParameterOptimizersGiveTheParametersOfOneRank) {
  TempDir dir;
  for (const char* kind : {"lamb", "adafactor", "muon"}) {
    const auto reference = train("FULL_SHARD", 1, dir / "reference.pt", "fp32", "deterministic", "shm", kind);
    ASSERT_FALSE(reference.empty()) << kind;
    for (int world : {2, 3, 4}) {
      const auto got = train("FULL_SHARD", world, dir / "run.pt", "fp32", "deterministic", "shm", kind);
      EXPECT_TRUE(bit_identical(got, reference)) << kind << " at world " << world << " differs from world 1";
    }
  }
}

// Leaving a backward out of the mean needs exact sums: refused in the default mode.
FSDP_WORKER(backward_counted_refused_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  TinyTransformer model(32, 16, 2, 3, 8);
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options("FULL_SHARD"));
  sharded->set_backward_counted(true);
  try {
    sharded->set_backward_counted(false);
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(contains(e.what(), "needs Options::deterministic(true)"), e.what());
    return;
  }
  WORKER_CHECK(false, "set_backward_counted(false) was accepted without deterministic mode");
}

TEST(Determinism, BackwardCountedNeedsDeterministicMode) {
  auto r = launch("backward_counted_refused_worker", 1, {}, 60);
  EXPECT_TRUE(r.all_ok()) << r.report();
}

// A step whose every backward was left out on every rank has no gradient to average: refused on
// every rank, naming it, instead of dividing by a count of zero; a counted backward trains again.
FSDP_WORKER(nothing_counted_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  TinyTransformer model(32, 16, 2, 3, 8);
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options("FULL_SHARD").deterministic(true));
  const at::Tensor x = token_batch(ctx.world, 0).narrow(0, ctx.rank * 2, 2);
  sharded->set_backward_counted(false);
  expect_error([&] { loss_of(model, x).backward(); }, "every backward since the last reduction was left out",
               "no counted backward");
  if (ctx.rank == 0) std::cout << "refused" << std::endl;
}

TEST(Determinism, AStepWithNoCountedBackwardIsRefused) {
  auto r = launch("nothing_counted_worker", 2, {}, 60);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "refused")) << r.report();
}

// The float deposit's vectorized loop (where the CPU has one) gives the parts of split(), the
// double loop's, for every kind of float: signed zeros, subnormals, the grid's edges, values out of
// range, infinities and NaN.
TEST(Determinism, VectorizedDepositGivesTheScalarParts) {
  const int64_t n = 4099;  // not a multiple of the vector width: the tail takes the scalar loop
  at::Tensor x = at::randn({n}, at::dtype(at::kFloat)) * at::pow(2.0, at::randint(-100, 30, {n}).to(at::kFloat));
  float* p = x.data_ptr<float>();
  const float specials[] = {0.0f,
                            -0.0f,
                            1e-40f,
                            -1e-45f,
                            std::ldexp(1.0f, -64),
                            -std::ldexp(1.5f, -65),
                            std::ldexp(1.0f, -65),
                            16777215.0f,
                            -16777215.0f,
                            16777216.0f,
                            -16777216.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::min()};
  for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); ++i) p[37 * i] = specials[i];
  for (const int scale_exp : {fsdp::exact::kGradScaleExp, 0, 120, 300}) {
    at::Tensor got = at::zeros({fsdp::exact::kLimbs, n}, at::kLong), want = at::zeros_like(got);
    at::Tensor got_parts[fsdp::exact::kLimbs], want_parts[fsdp::exact::kLimbs];
    for (int j = 0; j < fsdp::exact::kLimbs; ++j) {
      got_parts[j] = got.select(0, j);
      want_parts[j] = want.select(0, j);
    }
    for (int round = 0; round < 2; ++round) {
      fsdp::exact::deposit(x, got_parts, scale_exp);
      fsdp::exact::deposit(x.to(at::kDouble), want_parts, scale_exp);
    }
    EXPECT_TRUE(torch::equal(got, want)) << "scale_exp " << scale_exp;
  }
}

// to_double of `strided` (rows of limbs) as contiguous limbs equals its tensor operations on the
// strided limbs, bit for bit (NaN where they give NaN); returns the contiguous result.
at::Tensor expect_contiguous_conversion_as_strided(const at::Tensor& strided, int scale_exp, double divisor) {
  at::Tensor views[fsdp::exact::kLimbs], rows[fsdp::exact::kLimbs];
  for (int j = 0; j < fsdp::exact::kLimbs; ++j) {
    views[j] = strided.select(1, j);
    rows[j] = views[j].contiguous();
  }
  const at::Tensor want = fsdp::exact::to_double(views, scale_exp, divisor);
  const at::Tensor got = fsdp::exact::to_double(rows, scale_exp, divisor);
  EXPECT_TRUE(torch::equal(got.isnan(), want.isnan())) << scale_exp << " " << divisor;
  EXPECT_TRUE(torch::equal(got.nan_to_num(0), want.nan_to_num(0))) << scale_exp << " " << divisor;
  return got;
}

// to_double's one pass over contiguous host limbs gives the bits of its tensor operations (which
// strided limbs take): carries, negative sums, overflow flags, several scaling steps, a divisor.
TEST(Determinism, OnePassConversionGivesTheTensorOperationsBits) {
  const int64_t n = 1000;
  at::Tensor strided = at::empty({n, fsdp::exact::kLimbs}, at::kLong);
  strided.select(1, 0).copy_(at::randint(-(int64_t(1) << 40), int64_t(1) << 40, {n}, at::kLong));
  strided.select(1, 1).copy_(at::randint(-(int64_t(1) << 40), int64_t(1) << 40, {n}, at::kLong));
  strided.select(1, 2).copy_(at::randint(-(int64_t(1) << 30), int64_t(1) << 30, {n}, at::kLong));
  strided[7][2] = fsdp::exact::kOverflowFlag + 5;
  strided[8][2] = 2 * fsdp::exact::kOverflowFlag - 1;
  for (const int scale_exp : {fsdp::exact::kGradScaleExp, -30, 700})
    for (const double divisor : {1.0, 3.0, 12.0}) {
      const at::Tensor got = expect_contiguous_conversion_as_strided(strided, scale_exp, divisor);
      EXPECT_TRUE(got[7].isnan().item<bool>() && got[8].isnan().item<bool>());
    }
}

// A deposit that overwrites the limbs (FlatGrad's first after a reduction, into uninitialized
// memory) gives what one adding to zeros gives: the float loop, the double loop and the tensor
// operations (limbs of a non-unit stride).
TEST(Determinism, OverwritingDepositGivesTheAddedParts) {
  const int64_t n = 1031;
  at::Tensor x = at::randn({n}, at::dtype(at::kFloat)) * at::pow(2.0, at::randint(-90, 26, {n}).to(at::kFloat));
  x[5] = std::numeric_limits<float>::infinity();
  x[9] = std::numeric_limits<float>::quiet_NaN();
  for (const at::Tensor& values : {x, x.to(at::kDouble)})
    for (const bool strided : {false, true}) {
      at::Tensor got = at::randint(-1000000, 1000000, {fsdp::exact::kLimbs, n * 2}, at::kLong);
      at::Tensor want = at::zeros_like(got);
      at::Tensor got_parts[fsdp::exact::kLimbs], want_parts[fsdp::exact::kLimbs];
      for (int j = 0; j < fsdp::exact::kLimbs; ++j) {
        got_parts[j] = strided ? got.select(0, j).view({n, 2}).select(1, 0) : got.select(0, j).narrow(0, 0, n);
        want_parts[j] = strided ? want.select(0, j).view({n, 2}).select(1, 0) : want.select(0, j).narrow(0, 0, n);
      }
      fsdp::exact::deposit(values, got_parts, fsdp::exact::kGradScaleExp, true);
      fsdp::exact::deposit(values, want_parts, fsdp::exact::kGradScaleExp);
      for (int j = 0; j < fsdp::exact::kLimbs; ++j)
        EXPECT_TRUE(torch::equal(got_parts[j], want_parts[j])) << values.scalar_type() << " " << strided << " " << j;
    }
}

// sum()'s vectorized loop over doubles gives the parts of the double deposit's split(): signs,
// zeros, subnormals, values below the grid and just inside the range, a tail of fewer than four.
TEST(Determinism, VectorizedSumGivesTheScalarParts) {
  const int64_t n = 4103;
  for (const int scale_exp : {fsdp::exact::kGradScaleExp, 0, -30, 300, 1000}) {
    const double top = std::ldexp(1.0, 88 - scale_exp);  // the range's end
    at::Tensor x =
        at::randn({n}, at::dtype(at::kDouble)) * at::pow(2.0, at::randint(-140, 84, {n}).to(at::kDouble) - scale_exp);
    double* p = x.data_ptr<double>();
    const double specials[] = {0.0,
                               -0.0,
                               4.9e-324,
                               -2.2e-308,
                               std::nextafter(top, 0.0),
                               -std::nextafter(top, 0.0),
                               top / 2,
                               -top / 3,
                               std::ldexp(top, -40),
                               -std::ldexp(top, -89)};
    for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); ++i) p[41 * i] = specials[i];
    p[n - 1] = -std::nextafter(top, 0.0);
    at::Tensor limbs = at::zeros({fsdp::exact::kLimbs, n}, at::kLong);
    at::Tensor parts[fsdp::exact::kLimbs];
    for (int j = 0; j < fsdp::exact::kLimbs; ++j) parts[j] = limbs.select(0, j);
    fsdp::exact::deposit(x, parts, scale_exp);
    const at::Tensor want = limbs.sum(1);
    const std::array<int64_t, fsdp::exact::kLimbs> got = fsdp::exact::sum(x, scale_exp);
    for (int j = 0; j < fsdp::exact::kLimbs; ++j)
      EXPECT_EQ(got[j], want[j].item<int64_t>()) << "scale_exp " << scale_exp << " limb " << j;
  }
}

// to_double's vectorized loop gives the tensor operations' bits where its conversions from int64
// need the scalar loop too: a top limb beyond 2^51 either way, flags, a tail of fewer than four.
TEST(Determinism, VectorizedConversionGivesTheTensorOperationsBits) {
  const int64_t n = 1003;
  at::Tensor strided = at::empty({n, fsdp::exact::kLimbs}, at::kLong);
  strided.select(1, 0).copy_(at::randint(-(int64_t(1) << 62), int64_t(1) << 62, {n}, at::kLong));
  strided.select(1, 1).copy_(at::randint(-(int64_t(1) << 62), int64_t(1) << 62, {n}, at::kLong));
  strided.select(1, 2).copy_(at::where(at::rand({n}) < 0.5,
                                       at::randint(-(int64_t(1) << 53), int64_t(1) << 53, {n}, at::kLong),
                                       at::randint(-(int64_t(1) << 30), int64_t(1) << 30, {n}, at::kLong)));
  strided[3][2] = -(int64_t(1) << 51);
  strided[4][2] = -(int64_t(1) << 51) - 1;
  strided[n - 1][2] = -(int64_t(1) << 52);
  for (const int scale_exp : {fsdp::exact::kGradScaleExp, -30, 700})
    for (const double divisor : {1.0, 3.0}) {
      expect_contiguous_conversion_as_strided(strided, scale_exp, divisor);
    }
}

namespace wire {

namespace exact = fsdp::exact;

// Rows [F, 3 S + 1] of limbs: `deposits` random float tensors deposited, the tail set to `tail`.
at::Tensor deposited_rows(int64_t F, int64_t S, int deposits, int64_t tail) {
  at::Tensor rows = at::zeros({F, exact::kLimbs * S + 1}, at::kLong);
  at::Tensor parts[exact::kLimbs];
  for (int j = 0; j < exact::kLimbs; ++j) parts[j] = rows.narrow(1, j * S, S);
  for (int d = 0; d < deposits; ++d) {
    at::Tensor x = at::randn({F, S}) * at::pow(2.0, at::randint(-90, 24, {F, S}).to(at::kFloat));
    x[0][3] = std::nextafter(std::ldexp(1.0f, 24), 0.0f);  // the largest in range, either sign
    x[0][4] = -std::nextafter(std::ldexp(1.0f, 24), 0.0f);
    if (d == 0) x[F - 1][S - 1] = std::numeric_limits<float>::infinity();
    exact::deposit(x, parts, exact::kGradScaleExp);
  }
  rows.narrow(1, exact::kLimbs * S, 1).fill_(tail);
  return rows;
}

// to_double() of row r's limbs (the first 3 S of `limbs`).
at::Tensor converted(const at::Tensor& limbs, int64_t S, double divisor) {
  const at::Tensor l = limbs.view({-1}).narrow(0, 0, exact::kLimbs * S).view({exact::kLimbs, S}).contiguous();
  at::Tensor parts[exact::kLimbs];
  for (int j = 0; j < exact::kLimbs; ++j) parts[j] = l.select(0, j);
  return exact::to_double(parts, exact::kGradScaleExp, divisor);
}

void expect_same_bits(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  EXPECT_TRUE(torch::equal(got.isnan(), want.isnan())) << what;
  EXPECT_TRUE(torch::equal(got.nan_to_num(0), want.nan_to_num(0))) << what;
}

}  // namespace wire

// The two-limb wire form of exact sums: sums of `terms` ranks' parts (a reduce-scatter's, and a
// hybrid chain's with its partial sums made one part again) convert to the bits of the same sums
// added as three limbs, through the loops and the tensor operations alike; a sum beyond the
// wire's range, and a flagged element, become NaN.
TEST(Determinism, TwoLimbWireGivesTheThreeLimbSumsBits) {
  namespace exact = fsdp::exact;
  torch::manual_seed(5);
  EXPECT_EQ(exact::wire_for(exact::kMaxWireTerms).limbs, 2);
  EXPECT_EQ(exact::wire_for(exact::kMaxWireTerms + 1).limbs, exact::kLimbs);
  const int64_t F = 3, S = 1001;
  for (const int64_t terms : {1, 2, 3, 4, 6, 8, 256}) {
    const exact::Wire w = exact::wire_for(terms);
    ASSERT_EQ(w.limbs, 2);
    at::Tensor want = at::zeros({F, exact::kLimbs * S + 1}, at::kLong), got = at::zeros({F, 2 * S + 1}, at::kLong);
    at::Tensor first_half;  // hybrid: the first half of the ranks' sums, made one part again
    const int64_t ranks = std::min<int64_t>(terms, 8);  // 256 terms: 8 ranks, the wire of 256
    for (int64_t r = 0; r < ranks; ++r) {
      at::Tensor rows = wire::deposited_rows(F, S, 1 + r % 3, 1 + r % 3);
      want.add_(rows);
      const at::Tensor by_ops = exact::tensor_ops::to_wire(rows.clone(), w).clone();
      const at::Tensor part = exact::to_wire(rows, w);
      EXPECT_EQ(part.data_ptr(), rows.data_ptr());  // packed over the limbs
      EXPECT_TRUE(torch::equal(part, by_ops)) << "terms " << terms << " rank " << r;
      got.add_(part);
      if (r == ranks / 2 - 1) first_half = got.clone();
    }
    for (int64_t r = 0; r < F; ++r) {
      at::Tensor in_place = at::empty({exact::kLimbs * S + 1}, at::kLong);
      in_place.narrow(0, 0, 2 * S + 1).copy_(got[r]);
      EXPECT_EQ(got[r][2 * S].item<int64_t>(), want[r][exact::kLimbs * S].item<int64_t>());
      exact::from_wire(in_place.narrow(0, 0, 2 * S), S, in_place, w);
      at::Tensor by_ops = at::empty({exact::kLimbs * S}, at::kLong);
      exact::tensor_ops::from_wire(got[r].contiguous(), S, by_ops, w);
      EXPECT_TRUE(torch::equal(in_place.narrow(0, 0, exact::kLimbs * S), by_ops)) << "terms " << terms;
      const double divisor = 7.0;
      const at::Tensor values = wire::converted(in_place, S, divisor), reference = wire::converted(want[r], S, divisor);
      wire::expect_same_bits(values, reference, "terms " + std::to_string(terms) + " row " + std::to_string(r));
      EXPECT_TRUE(values[S - 1].isnan().item<bool>() || r != F - 1);
      if (r == 0) {  // the largest value in range, summed (elsewhere random values may leave it)
        EXPECT_FALSE(values[3].isnan().item<bool>());
      }
    }
    if (ranks >= 2) {  // a partial sum made one part again, plus the other ranks' parts
      at::Tensor partial = first_half.clone(), by_ops = first_half.clone();
      exact::renormalize(partial, S, w);
      exact::tensor_ops::renormalize(by_ops, S, w);
      EXPECT_TRUE(torch::equal(partial, by_ops)) << "terms " << terms;
      at::Tensor chained = got - first_half + partial;
      at::Tensor limbs = at::empty({F, exact::kLimbs * S}, at::kLong);
      for (int64_t r = 0; r < F; ++r) {
        exact::from_wire(chained[r].contiguous(), S, limbs[r], w);
        wire::expect_same_bits(wire::converted(limbs[r], S, 1.0), wire::converted(want[r], S, 1.0), "renormalized");
      }
    }
  }
  // A rank's sum beyond the wire's range (2^(58 - 3 h) at 2^h terms) becomes a flag: 2^40 fits the
  // wire of 4 terms, not the one of 256.
  at::Tensor rows = at::zeros({1, exact::kLimbs * 4 + 1}, at::kLong);
  rows[0][2 * 4 + 1] = int64_t(1) << 40;  // element 1's top limb: 2^40 * 2^64 on the grid
  rows[0][2 * 4 + 2] = -(int64_t(1) << 40);
  for (const int64_t terms : {4, 256}) {
    const exact::Wire w = exact::wire_for(terms);
    at::Tensor part = exact::to_wire(rows.clone(), w).clone().view({-1});
    at::Tensor limbs = at::empty({exact::kLimbs * 4}, at::kLong);
    exact::from_wire(part, 4, limbs, w);
    const at::Tensor v = wire::converted(limbs, 4, 1.0);
    EXPECT_EQ(v[1].isnan().item<bool>(), terms == 256) << terms;
    EXPECT_EQ(v[2].isnan().item<bool>(), terms == 256) << terms;
    if (terms == 4) {
      EXPECT_EQ(v[1].item<double>(), std::ldexp(1.0, 40));
    }
    EXPECT_EQ(v[0].item<double>(), 0.0);
  }
}

TEST(Determinism, GlooAndMixedPrecisionGiveTheParametersOfOneRank) {
  TempDir dir;
  const auto reference = train("FULL_SHARD", 1, dir / "reference.pt");
  EXPECT_TRUE(bit_identical(train("FULL_SHARD", 3, dir / "tcp.pt", "fp32", "deterministic", "tcp"), reference))
      << "FULL_SHARD over TCP at world 3";
  const auto bf16 = train("FULL_SHARD", 1, dir / "bf16.pt", "bf16");
  ASSERT_FALSE(bf16.empty());
  for (int world : {2, 4})
    EXPECT_TRUE(bit_identical(train("SHARD_GRAD_OP", world, dir / "bf16_run.pt", "bf16"), bf16))
        << "bf16 SHARD_GRAD_OP at world " << world;
}

}  // namespace
}  // namespace fsdp_test
