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
#include "whole_param_optimizers.h"

namespace fsdp_test {
namespace {

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

// Inside a worker, for Muon `kind` stepping `sharded`: the owners split the matrices (kAllGather:
// every rank orthogonalizes those it holds a piece of); pieces travel where matrices straddle
// ranks, in the bytes its stats count; kAuto's choice is the owners' way of the transport or the
// all-gather, whichever sends fewer bytes (the owners' way on a tie), and never more than the naive way.
void check_muon_plan(const WorkerContext& ctx, fsdp::ProcessGroup& pg, fsdp::FullyShardedModule& sharded,
                     const fsdp::Muon& muon, const std::string& kind, bool peers, const std::string& what) {
  using fsdp::MuonExchange;
  const auto& st = muon.stats();
  const int replicas = peers ? ctx.world / sharded.sharding_factor() : ctx.world;
  const double owned = fsdp::mean_across_ranks(pg, double(st.owned)) * ctx.world;
  if (st.exchange == MuonExchange::kAllGather) {
    int64_t held = 0;
    for (const auto& p : muon.reduction().params())
      held += p.trainable && p.shape.size() == 2 && p.piece.defined() && p.piece.numel() > 0;
    WORKER_CHECK(st.owned == held, what, ": orthogonalizes ", st.owned, " matrices, holds pieces of ", held);
  } else {
    WORKER_CHECK(owned == double(st.matrices * replicas), what, ": owned ", owned, " of ", st.matrices, " matrices");
  }
  WORKER_CHECK(!peers || st.owned < st.matrices, what, ": rank ", ctx.rank, " orthogonalizes all ", st.matrices,
               " matrices");
  const int64_t element = kind == "muon_bf16" ? 2 : 8;  // bfloat16 Newton-Schulz: the pieces travel in it
  const int64_t exchanges = st.exchange == MuonExchange::kAllGather ? 1 : 2;
  WORKER_CHECK(!peers || st.bytes_sent == exchanges * (sharded.sharding_factor() - 1) * st.exchange_numel * element,
               what, ": ", st.bytes_sent, " bytes for ", st.exchange_numel, " elements per destination");
  WORKER_CHECK(!peers || st.moved_numel > 0, what, ": moved ", st.moved_numel, " elements");
  const MuonExchange requested = muon_exchange(kind);
  if (!peers) {
    WORKER_CHECK(st.exchange == MuonExchange::kAuto && st.bytes_sent == 0, what, ": exchanges with whole matrices");
    return;
  }
  if (requested != MuonExchange::kAuto && requested != MuonExchange::kAutoWithoutAllToAll) {
    WORKER_CHECK(st.exchange == requested, what, ": runs another exchange than the one asked for");
    return;
  }
  // The candidates, planned alone over the same module.
  const MuonExchange owners =
      requested == MuonExchange::kAuto ? MuonExchange::kAllToAll : MuonExchange::kReduceScatterAllGather;
  const auto options = fsdp::MuonOptions().ns_bfloat16(kind == "muon_bf16");
  const int64_t by_owners = fsdp::Muon(sharded, options, owners).stats().bytes_sent;
  const int64_t by_all_gather = fsdp::Muon(sharded, options, MuonExchange::kAllGather).stats().bytes_sent;
  WORKER_CHECK(st.exchange == (by_owners <= by_all_gather ? owners : MuonExchange::kAllGather) &&
                   st.bytes_sent == std::min(by_owners, by_all_gather),
               what, ": picked ", int(st.exchange), " for ", st.bytes_sent, " bytes; the owners' way sends ", by_owners,
               ", the all-gather ", by_all_gather);
  WORKER_CHECK(st.bytes_sent <= st.naive_bytes_sent, what, ": ", st.bytes_sent, " bytes against naive ",
               st.naive_bytes_sent);
  if (requested == MuonExchange::kAuto)  // by all-to-all on the CPU transports: fewer bytes than naive
    WORKER_CHECK(st.bytes_sent < st.naive_bytes_sent, what, ": ", st.bytes_sent, " bytes against naive ",
                 st.naive_bytes_sent);
}

// Trains `kind` under `strategy` for 4 steps in `mode` (plain; accum: two micro-batches, the first
// under no_sync; clip: clip_grad_norm_ before each step; unfreeze: the first block frozen before
// fully_shard and the optimizer, unfrozen after the first step) and checks the parameters against
// single-process training, the reductions' collectives, and Muon's owners and exchanges.
void expect_single_process_result(const WorkerContext& ctx, const fsdp::ProcessGroupPtr& pg, const std::string& kind,
                                  const std::string& strategy, const std::string& mode) {
  auto [ref, model] = twin_tiny_transformers();
  auto first_block = [&](bool on) {
    for (auto* m : {&ref, &model})
      for (auto& p : (*m)->blocks[0]->parameters()) p.requires_grad_(on);
  };
  if (mode == "unfreeze") first_block(false);
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  auto [opt, ref_step] = optimizers(kind, *sharded);
  const int steps = 4;
  for (int step = 0; step < steps; ++step) {
    if (mode == "unfreeze" && step == 1) first_block(true);
    // Every parameter, in one order (the references keep state by position); frozen ones get no gradient.
    const std::vector<at::Tensor> ref_params = mode == "unfreeze" ? unique_parameters(*ref) : trainable(*ref);
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
  // Muon plans at construction, and again when a parameter is unfrozen.
  const int64_t at_construction = kind.rfind("muon", 0) == 0 && peers ? (mode == "unfreeze" ? 2 : 1) : 0;
  WORKER_CHECK(opt->reduction().collectives() == (peers ? per_step * steps : 0) + at_construction, what,
               ": reduction collectives ", opt->reduction().collectives());
  if (mode == "plain") check_reductions(*sharded);
  if (auto* muon = dynamic_cast<fsdp::Muon*>(opt.get())) check_muon_plan(ctx, *pg, *sharded, *muon, kind, peers, what);
  if (ctx.rank == 0) std::cout << what << " ok" << std::endl;
}

// args: optimizer, strategy, mode (see expect_single_process_result).
FSDP_WORKER(whole_param_worker) {
  expect_single_process_result(ctx, fsdp::ProcessGroup::from_env(), ctx.args.at(0), ctx.args.at(1), ctx.args.at(2));
}

// Every optimizer under every strategy this world allows (HYBRID_SHARD: two shard groups of two
// or more ranks), Muon with each exchange and kAuto's choice without an all-to-all under each, and
// Muon with Newton-Schulz in bfloat16 under FULL_SHARD, in one process per rank.
FSDP_WORKER(whole_param_strategies_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  std::vector<std::string> strategies{"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"};
  if (ctx.world % 2 == 0 && ctx.world >= 4) strategies.emplace_back("HYBRID_SHARD");
  for (const auto& strategy : strategies)
    for (const char* kind : {"lamb", "adafactor", "muon"})
      expect_single_process_result(ctx, pg, kind, strategy, "plain");
  expect_single_process_result(ctx, pg, "muon_bf16", "FULL_SHARD", "plain");
  for (const auto& strategy : strategies)
    for (const char* kind : {"muon_rs", "muon_ag", "muon_cuda"})
      expect_single_process_result(ctx, pg, kind, strategy, "plain");
}

// args: optimizer, strategy. bf16 compute, fp32 reduction and masters: equal to the local
// reference of mixed precision stepped by the same single-process optimizer, within 1e-5.
FSDP_WORKER(whole_param_mixed_precision_worker) {
  // bf16 matrix products through LibTorch's own BLAS path on every CPU: on AVX-512 CPUs LibTorch
  // hands them to oneDNN, which there rounds FSDP's and the reference's products differently
  // enough for Muon's Newton-Schulz iterations to carry the difference past the tolerance.
  at::globalContext().setUserEnabledMkldnn(false);
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
// checkpoint into a model at this world, then 2 more steps), dir, strategy, and the optimizer to
// build for load (default: the same; its options come from the checkpoint). After load, equal to
// 4 single-process steps of `optimizer` on the same batches.
FSDP_WORKER(whole_param_checkpoint_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string kind = ctx.args.at(0), phase = ctx.args.at(1), dir = ctx.args.at(2), strategy = ctx.args.at(3);
  const std::string built = phase == "load" && ctx.args.size() > 4 ? ctx.args.at(4) : kind;
  auto [ref, model] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options(strategy));
  auto [opt, ref_step] = optimizers(kind, *sharded);
  if (built != kind) opt = optimizers(built, *sharded).first;
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
  if (auto* muon = dynamic_cast<fsdp::Muon*>(opt.get())) {  // Newton-Schulz's dtype as saved, also in the exchange
    const bool bf16 = kind == "muon_bf16";
    for (const auto& g : muon->param_groups())
      WORKER_CHECK(static_cast<const fsdp::MuonOptions&>(g.options()).ns_bfloat16() == bf16, kind,
                   ": ns_bfloat16 not restored");
    const auto& st = muon->stats();
    const int64_t exchanges = st.exchange == fsdp::MuonExchange::kAllGather ? 1 : 2;
    WORKER_CHECK(st.bytes_sent == exchanges * (sharded->sharding_factor() - 1) * st.exchange_numel * (bf16 ? 2 : 8),
                 kind, ": ", st.bytes_sent, " bytes for ", st.exchange_numel, " elements per destination");
  }
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

// Groups the whole-parameter optimizers refuse, naming the problem: options of another optimizer,
// a tensor that is not one of the module's pieces, a piece in two groups.
FSDP_WORKER(whole_param_groups_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto [ref, model] = twin_tiny_transformers();
  auto [other_ref, other] = twin_tiny_transformers();
  auto sharded = fsdp::fully_shard(model, pg, block_unit_options("FULL_SHARD"));
  auto other_sharded = fsdp::fully_shard(other, pg, block_unit_options("FULL_SHARD"));
  using Groups = std::vector<torch::optim::OptimizerParamGroup>;
  auto pieces = [](fsdp::FullyShardedModule& m) {
    std::vector<at::Tensor> out;
    for (const auto& p : m.shard_pieces()) out.push_back(p.piece);
    return out;
  };
  auto with_options = [&](std::unique_ptr<torch::optim::OptimizerOptions> o) {
    return Groups{torch::optim::OptimizerParamGroup(pieces(*sharded), std::move(o))};
  };
  expect_error([&] { fsdp::Muon(*sharded, with_options(std::make_unique<fsdp::LambOptions>())); },
               "has options of type fsdp::LambOptions, not this optimizer's fsdp::MuonOptions", "Muon given Lamb's");
  expect_error([&] { fsdp::Lamb(*sharded, with_options(std::make_unique<torch::optim::AdamWOptions>())); },
               "not this optimizer's fsdp::LambOptions", "Lamb given AdamW's");
  expect_error([&] { fsdp::Lamb(*sharded, Groups{torch::optim::OptimizerParamGroup(pieces(*other_sharded))}); },
               "is not a shard piece of this module", "another module's pieces");
  expect_error(
      [&] {
        fsdp::Adafactor(*sharded, Groups{torch::optim::OptimizerParamGroup(pieces(*sharded)),
                                         torch::optim::OptimizerParamGroup({pieces(*sharded).front()})});
      },
      "is in parameter groups 0 and 1", "a piece in two groups");
  if (ctx.rank == 0) std::cout << "groups refused" << std::endl;
}

TEST(WholeParamOptim, RefusesGroupsOfAnotherOptimizerOrModuleOrAPieceTwice) {
  auto r = launch("whole_param_groups_worker", 2);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_TRUE(contains(r.ranks[0].output, "groups refused")) << r.report();
}

// Accumulation, clipping, unfreezing, mixed precision and the refused step in backward, for `kind`.
void run_modes(const std::string& kind) {
  for (const char* mode : {"accum", "clip", "unfreeze"}) {
    auto r = launch("whole_param_worker", 3, {kind, "FULL_SHARD", mode});
    ASSERT_TRUE(r.all_ok()) << kind << " " << mode << "\n" << r.report();
  }
  auto r = launch("whole_param_mixed_precision_worker", 3, {kind, "FULL_SHARD"});
  ASSERT_TRUE(r.all_ok()) << kind << " mixed precision\n" << r.report();
  r = launch("whole_param_step_in_backward_worker", 2, {kind});
  ASSERT_TRUE(r.all_ok()) << kind << " in backward\n" << r.report();
}

// Saved at world 4 by `kind`, loaded into `built` (default: the same) at worlds 3, 2 and 1.
void run_resharded_checkpoint(const std::string& kind, const std::string& built = "") {
  TempDir tmp;
  auto r = launch("whole_param_checkpoint_worker", 4, {kind, "save", tmp / "ckpt", "FULL_SHARD"});
  ASSERT_TRUE(r.all_ok()) << kind << " save\n" << r.report();
  for (auto [world, strategy] :
       {std::pair<int, const char*>{3, "FULL_SHARD"}, {2, "SHARD_GRAD_OP"}, {1, "FULL_SHARD"}}) {
    r = launch("whole_param_checkpoint_worker", world,
               {kind, "load", tmp / "ckpt", strategy, built.empty() ? kind : built});
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
TEST(WholeParamOptim, MuonBfloat16NewtonSchulzIsRestoredIntoAnOptimizerBuiltWithoutIt) {
  run_resharded_checkpoint("muon_bf16", "muon");
}
TEST(WholeParamOptim, AdafactorStateSavedAtWorld4ResumesExactlyAtWorlds3And2And1) {
  run_resharded_checkpoint("adafactor");
}

}  // namespace
}  // namespace fsdp_test
