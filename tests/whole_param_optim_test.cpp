// Optimizers whose step needs whole parameters (fsdp::Lamb, fsdp::Adafactor, fsdp::Muon) under
// FSDP: parameters after several steps equal single-process training with the same optimizer
// (tests/whole_param_reference.h), in float64 within rounding, for worlds 1-4 and every strategy,
// with accumulation, clipping and mixed precision; the reductions (ParamReduction) equal the whole
// parameters' and take one collective per reduction round.
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "fsdp/adafactor.h"
#include "fsdp/lamb.h"
#include "fsdp/muon.h"
#include "fsdp/param_reduction.h"
#include "harness.h"
#include "mixed_precision_reference.h"
#include "models.h"
#include "whole_param_reference.h"

namespace fsdp_test {
namespace {

using StepFn = std::function<void(const std::vector<at::Tensor>&)>;

// The sharded optimizer `kind` over `sharded`, and the same optimizer's single-process step.
std::pair<std::unique_ptr<fsdp::WholeParamOptimizer>, StepFn> optimizers(const std::string& kind,
                                                                         fsdp::FullyShardedModule& sharded) {
  if (kind == "lamb") {
    auto ref = std::make_shared<ReferenceLamb>(ReferenceLamb{2e-2, 0.9, 0.99, 1e-6, 0.01, {}});
    return {
        std::make_unique<fsdp::Lamb>(sharded, fsdp::LambOptions(2e-2).betas({0.9, 0.99}).eps(1e-6).weight_decay(0.01)),
        [ref](const std::vector<at::Tensor>& ps) {
          ref->step(ps);
        }};
  }
  if (kind == "adafactor") {
    auto ref = std::make_shared<ReferenceAdafactor>();
    ref->beta1 = 0.9;
    ref->weight_decay = 0.01;
    return {std::make_unique<fsdp::Adafactor>(sharded, fsdp::AdafactorOptions().beta1(0.9).weight_decay(0.01)),
            [ref](const std::vector<at::Tensor>& ps) {
              ref->step(ps);
            }};
  }
  // muon_bf16: Newton-Schulz in bfloat16 on both sides; muon_rs: exchanges by reduce-scatter and
  // all-gather (what transports without an all-to-all use).
  auto ref = std::make_shared<ReferenceMuon>(ReferenceMuon{2e-2, 0.95, 0.01, 1e-2, 0.9, 0.99, 1e-8, 0.01, {}, {}});
  ref->bfloat16 = kind == "muon_bf16";
  return {std::make_unique<fsdp::Muon>(
              sharded,
              fsdp::MuonOptions(2e-2)
                  .momentum(0.95)
                  .weight_decay(0.01)
                  .ns_bfloat16(ref->bfloat16)
                  .adamw(fsdp::MuonAdamW(1e-2).betas({0.9, 0.99}).eps(1e-8).weight_decay(0.01)),
              kind == "muon_rs" ? fsdp::MuonExchange::kReduceScatterAllGather : fsdp::MuonExchange::kAuto),
          [ref](const std::vector<at::Tensor>& ps) {
            if (ref->muon.empty())
              for (const auto& p : ps) ref->muon.push_back(p.dim() == 2);
            ref->step(ps);
          }};
}

// Every parameter of `module` that trains, once.
std::vector<at::Tensor> trainable(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& p : unique_parameters(module))
    if (p.requires_grad()) out.push_back(p);
  return out;
}

// Inside a worker: each parameter's sum of squares and largest |value|, reduced from the pieces,
// equal those of its whole value.
void check_reductions(fsdp::FullyShardedModule& sharded) {
  fsdp::ParamReduction reduction(sharded);
  std::vector<std::pair<int, int>> ids;
  for (const auto& p : reduction.params()) {
    at::Tensor sq = at::zeros({1}, at::kDouble), mx = at::zeros({1}, at::kDouble);
    if (p.piece.defined() && p.piece.numel() > 0) {
      sq = p.piece.detach().to(at::kDouble).square().sum().reshape({1});
      mx = p.piece.detach().to(at::kDouble).abs().max().reshape({1});
    }
    ids.emplace_back(reduction.add(sq, fsdp::Combine::kSum), reduction.add(mx, fsdp::Combine::kMax));
  }
  reduction.run();
  auto full = sharded.full_state_dict();
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto& p = reduction.params()[i];
    const at::Tensor whole = full.at(p.name).to(at::kDouble);
    const double sq = whole.square().sum().item<double>(), mx = whole.abs().max().item<double>();
    WORKER_CHECK(std::abs(reduction.result(ids[i].first).item<double>() - sq) <= 1e-12 * sq, p.name, " sum of squares");
    WORKER_CHECK(reduction.result(ids[i].second).item<double>() == mx, p.name, " max");
  }
}

// Trains `kind` under `strategy` for 4 steps in `mode` (plain; accum: two micro-batches, the first
// under no_sync; clip: clip_grad_norm_ before each step) and checks the parameters against
// single-process training, the reductions' collectives, and Muon's owners and exchanges.
void expect_single_process_result(const WorkerContext& ctx, const fsdp::ProcessGroupPtr& pg, const std::string& kind,
                                  const std::string& strategy, const std::string& mode) {
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  auto [opt, ref_step] = optimizers(kind, *sharded);
  const std::vector<at::Tensor> ref_params = trainable(*ref);
  const int steps = 4;
  for (int step = 0; step < steps; ++step) {
    const at::Tensor x = token_batch(ctx.world, step);
    for (const auto& p : ref_params) p.mutable_grad().reset();
    loss_of(ref, x).backward();
    if (mode == "clip") torch::nn::utils::clip_grad_norm_(ref_params, 0.05);
    ref_step(ref_params);
    opt->zero_grad();
    const at::Tensor mine = x.narrow(0, ctx.rank * 2, 2);
    if (mode == "accum") {
      {
        auto guard = sharded->no_sync();
        (loss_of(model, mine.narrow(0, 0, 1)) * 0.5).backward();
      }
      (loss_of(model, mine.narrow(0, 1, 1)) * 0.5).backward();
    } else {
      loss_of(model, mine).backward();
    }
    if (mode == "clip") sharded->clip_grad_norm_(0.05);
    opt->step();
  }
  const std::string what = kind + " " + strategy + " " + mode + " world " + std::to_string(ctx.world);
  expect_same_parameters(*ref, *sharded, 1e-12, what);
  const bool peers = strategy != "NO_SHARD" && sharded->sharding_factor() > 1;
  const int64_t per_step = kind == "lamb" ? 1 : kind == "adafactor" ? 2 : 0;
  const int64_t at_construction = kind.rfind("muon", 0) == 0 && peers ? 1 : 0;
  WORKER_CHECK(opt->reduction().collectives() == (peers ? per_step * steps : 0) + at_construction, what,
               ": reduction collectives ", opt->reduction().collectives());
  if (mode == "plain") check_reductions(*sharded);
  if (auto* muon = dynamic_cast<fsdp::Muon*>(opt.get())) {  // the owners split the matrices
    const auto& st = muon->stats();
    const double owned = fsdp::mean_across_ranks(*pg, double(st.owned)) * ctx.world;
    const int replicas = peers ? ctx.world / sharded->sharding_factor() : ctx.world;
    WORKER_CHECK(owned == double(st.matrices * replicas), what, ": owned ", owned, " of ", st.matrices, " matrices");
    WORKER_CHECK(!peers || st.owned < st.matrices, what, ": rank ", ctx.rank, " owns all ", st.matrices, " matrices");
    // Matrices split across ranks: some pieces travel; by all-to-all, in fewer bytes than gathering
    // every matrix (a reduce-scatter's segments can exceed that: Note [Muon's owner ranks]).
    WORKER_CHECK(!peers || (st.moved_numel > 0 && (!st.all_to_all || st.bytes_sent < st.naive_bytes_sent)), what,
                 ": moved ", st.moved_numel, " elements, ", st.bytes_sent, " bytes against naive ",
                 st.naive_bytes_sent);
    WORKER_CHECK(st.all_to_all == (peers && kind != "muon_rs"), what, ": all_to_all ", st.all_to_all);
    const int64_t element = kind == "muon_bf16" ? 2 : 8;  // bfloat16 Newton-Schulz: the pieces travel in it
    WORKER_CHECK(!peers || st.bytes_sent == 2 * (sharded->sharding_factor() - 1) * st.exchange_numel * element, what,
                 ": ", st.bytes_sent, " bytes for ", st.exchange_numel, " elements per destination");
  }
  if (ctx.rank == 0) std::cout << what << " ok" << std::endl;
}

// args: optimizer, strategy, mode (see expect_single_process_result).
FSDP_WORKER(whole_param_worker) {
  expect_single_process_result(ctx, fsdp::ProcessGroup::from_env(), ctx.args.at(0), ctx.args.at(1), ctx.args.at(2));
}

// Every optimizer under every strategy this world allows (HYBRID_SHARD: two shard groups of two
// or more ranks), Muon with reduce-scatter exchanges under each, and Muon with Newton-Schulz in
// bfloat16 under FULL_SHARD, in one process per rank.
FSDP_WORKER(whole_param_strategies_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  std::vector<std::string> strategies{"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"};
  if (ctx.world % 2 == 0 && ctx.world >= 4) strategies.emplace_back("HYBRID_SHARD");
  for (const auto& strategy : strategies)
    for (const char* kind : {"lamb", "adafactor", "muon"})
      expect_single_process_result(ctx, pg, kind, strategy, "plain");
  expect_single_process_result(ctx, pg, "muon_bf16", "FULL_SHARD", "plain");
  for (const auto& strategy : strategies) expect_single_process_result(ctx, pg, "muon_rs", strategy, "plain");
}

// args: optimizer, strategy. bf16 compute, fp32 reduction and masters: equal to the local
// reference of mixed precision stepped by the same single-process optimizer, within 1e-5.
FSDP_WORKER(whole_param_mixed_precision_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string kind = ctx.args.at(0), strategy = ctx.args.at(1);
  MixedPrecisionTriplet models;
  LocalMixedPrecision<TinyTransformer> local(models.master, models.compute, at::kBFloat16, at::kFloat);
  auto options = block_unit_options(strategy);
  options.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  auto sharded = fsdp::fully_shard(models.model, pg, options);
  auto [opt, ref_step] = optimizers(kind, *sharded);
  std::vector<at::Tensor> ref_params;
  for (const auto& p : local.parameters())
    if (p.requires_grad()) ref_params.push_back(p);
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = token_batch(ctx.world, step);
    local.backward(x, ctx.world, 2, 1.0, cast_lm_loss);
    ref_step(ref_params);
    opt->zero_grad();
    cast_lm_loss(models.model, x.narrow(0, ctx.rank * 2, 2)).backward();
    opt->step();
  }
  expect_same_parameters(*models.master, *sharded, 1e-5, kind + " " + strategy + " mixed precision");
  if (ctx.rank == 0) std::cout << kind << " " << strategy << " mixed precision ok" << std::endl;
}

// args: optimizer, phase (save: 2 steps at this world, then a checkpoint into dir; load: the
// checkpoint into a model at this world, then 2 more steps), dir, strategy. After load, equal to
// 4 single-process steps on the same batches.
FSDP_WORKER(whole_param_checkpoint_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string kind = ctx.args.at(0), phase = ctx.args.at(1), dir = ctx.args.at(2), strategy = ctx.args.at(3);
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  auto [opt, ref_step] = optimizers(kind, *sharded);
  const int saved_world = 4;
  auto train = [&](int step) {
    const at::Tensor x = token_batch(ctx.world, step);
    opt->zero_grad();
    loss_of(model, x.narrow(0, ctx.rank * 2, 2)).backward();
    opt->step();
  };
  if (phase == "save") {
    for (int step = 0; step < 2; ++step) train(step);
    fsdp::checkpoint::save(dir, *sharded, *opt);
    return;
  }
  fsdp::checkpoint::load(dir, *sharded, *opt);
  for (int step = 2; step < 4; ++step) train(step);
  const std::vector<at::Tensor> ref_params = trainable(*ref);
  for (int step = 0; step < 4; ++step) {
    for (const auto& p : ref_params) p.mutable_grad().reset();
    loss_of(ref, token_batch(step < 2 ? saved_world : ctx.world, step)).backward();
    ref_step(ref_params);
  }
  expect_same_parameters(*ref, *sharded, 1e-12, kind + " resumed at world " + std::to_string(ctx.world));
  if (ctx.rank == 0) std::cout << kind << " resumed at world " << ctx.world << " ok" << std::endl;
}

// Refused with the fix: a step in backward, which steps one unit at a time.
FSDP_WORKER(whole_param_step_in_backward_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options("FULL_SHARD"));
  auto [opt, ref_step] = optimizers(ctx.args.at(0), *sharded);
  sharded->set_step_in_backward(opt.get());
  expect_error([&] { loss_of(model, token_batch(ctx.world, 0).narrow(0, ctx.rank * 2, 2)).backward(); },
               "set_step_in_backward(nullptr)", ctx.args.at(0) + " in backward");
}

// Accumulation, clipping, mixed precision and the refused step in backward, for `kind`.
void run_modes(const std::string& kind) {
  for (const char* mode : {"accum", "clip"}) {
    auto r = launch("whole_param_worker", 3, {kind, "FULL_SHARD", mode});
    ASSERT_TRUE(r.all_ok()) << kind << " " << mode << "\n" << r.report();
  }
  auto r = launch("whole_param_mixed_precision_worker", 3, {kind, "FULL_SHARD"});
  ASSERT_TRUE(r.all_ok()) << kind << " mixed precision\n" << r.report();
  r = launch("whole_param_step_in_backward_worker", 2, {kind});
  ASSERT_TRUE(r.all_ok()) << kind << " in backward\n" << r.report();
}

void run_resharded_checkpoint(const std::string& kind) {
  TempDir tmp;
  auto r = launch("whole_param_checkpoint_worker", 4, {kind, "save", tmp / "ckpt", "FULL_SHARD"});
  ASSERT_TRUE(r.all_ok()) << kind << " save\n" << r.report();
  for (auto [world, strategy] :
       {std::pair<int, const char*>{3, "FULL_SHARD"}, {2, "SHARD_GRAD_OP"}, {1, "FULL_SHARD"}}) {
    r = launch("whole_param_checkpoint_worker", world, {kind, "load", tmp / "ckpt", strategy});
    ASSERT_TRUE(r.all_ok()) << kind << " load at world " << world << "\n" << r.report();
  }
}

TEST(WholeParamOptim, LambAdafactorMuonEqualSingleProcessUnderEveryStrategyAtWorlds1To4) {
  for (int world : {1, 2, 3, 4}) {
    auto r = launch("whole_param_strategies_worker", world);
    ASSERT_TRUE(r.all_ok()) << "world " << world << "\n" << r.report();
  }
}
TEST(WholeParamOptim, LambEqualsSingleProcessLambWithAccumulationClippingAndMixedPrecision) { run_modes("lamb"); }
TEST(WholeParamOptim, AdafactorEqualsSingleProcessAdafactorWithAccumulationClippingAndMixedPrecision) {
  run_modes("adafactor");
}
TEST(WholeParamOptim, MuonEqualsSingleProcessMuonWithAccumulationClippingAndMixedPrecision) { run_modes("muon"); }
TEST(WholeParamOptim, LambStateSavedAtWorld4ResumesExactlyAtWorlds3And2And1) { run_resharded_checkpoint("lamb"); }
TEST(WholeParamOptim, MuonStateSavedAtWorld4ResumesExactlyAtWorlds3And2And1) { run_resharded_checkpoint("muon"); }
TEST(WholeParamOptim, AdafactorStateSavedAtWorld4ResumesExactlyAtWorlds3And2And1) {
  run_resharded_checkpoint("adafactor");
}

}  // namespace
}  // namespace fsdp_test
