// Explicit unshard / reshard and summon_full_params (read and write back): checked against local
// training and FSDP's memory figures.
#include <gtest/gtest.h>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: mixed ("mp" for bf16 compute, else none). summon_full_params shows the whole parameters in
// full precision, a forward (also on rank 0 alone) and torch::save inside it see the local model's, writes are dropped without
// writeback and land in the shards with it (torch::load's too); explicit unshard gathers everything and training goes on.
FSDP_WORKER(full_params_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const bool mixed = ctx.args.at(0) == "mp";
  auto [ref, model] = twin_tiny_transformers();
  auto o = fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>());
  if (mixed) o.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kFloat).reduce_dtype(at::kFloat));
  auto sharded = fsdp::fully_shard(model, pg, o);
  // SGD: float32 compute against a float64 reference stays within rounding (Adam would magnify it
  // where a gradient is near zero).
  torch::optim::SGD ref_opt(unique_parameters(*ref), 0.1), opt(sharded->parameters(), 0.1);
  const double tol = mixed ? 1e-5 : 1e-12;
  lm_step_side_by_side(ref, ref_opt, model, opt, ctx, 0);
  lm_step_side_by_side(ref, ref_opt, model, opt, ctx, 1);

  // with_grads: each parameter's .grad is its whole reduced gradient, the local model's after the
  // same step; the placeholders are back afterwards and training goes on (checked below).
  {
    auto full = sharded->summon_full_params(fsdp::FullParamsOptions().with_grads(true));
    auto ref_params = ref->named_parameters();
    for (const auto& kv : model->named_parameters()) {
      const at::Tensor g = kv.value().grad(), want = ref_params[kv.key()].grad();
      // The frozen table and the unused parameter have none, as in local training.
      WORKER_CHECK(g.defined() == want.defined(), "summoned gradient of ", kv.key(), " defined: ", g.defined(),
                   ", in local training: ", want.defined());
      if (!want.defined()) continue;
      WORKER_CHECK(g.sizes() == want.sizes(), "summoned gradient of ", kv.key(), " has shape ", g.sizes());
      WORKER_CHECK(rel_diff(g, want) <= 10 * tol, "summoned gradient of ", kv.key(), " differs by ", rel_diff(g, want));
    }
  }
  for (const auto& kv : model->named_parameters())
    WORKER_CHECK(!kv.value().requires_grad() || kv.value().grad().stride(0) == 0, "after with_grads, ", kv.key(),
                 "'s .grad is not the placeholder");
  {
    auto no_sync = sharded->no_sync();
    loss_of(model, token_batch(ctx.world, 5).narrow(0, ctx.rank * 2, 2)).backward();
    expect_error([&] { auto full = sharded->summon_full_params(fsdp::FullParamsOptions().with_grads(true)); },
                 "gradients are not reduced yet", "with_grads after a backward without sync");
  }
  opt.zero_grad();
  ref_opt.zero_grad();

  const auto x = token_batch(ctx.world, 9);
  {
    auto full = sharded->summon_full_params();
    auto ref_params = ref->named_parameters();
    for (const auto& kv : model->named_parameters()) {
      WORKER_CHECK(kv.value().scalar_type() == at::kDouble, "summoned ", kv.key(), " is ", kv.value().scalar_type());
      WORKER_CHECK(kv.value().sizes() == ref_params[kv.key()].sizes(), "summoned ", kv.key(), " has shape ",
                   kv.value().sizes());
      WORKER_CHECK(rel_diff(kv.value(), ref_params[kv.key()]) <= tol, "summoned ", kv.key(), " differs by ",
                   rel_diff(kv.value(), ref_params[kv.key()]));
    }
    torch::NoGradGuard no_grad;
    const auto mine = model->forward(x), theirs = ref->forward(x);
    WORKER_CHECK(rel_diff(mine, theirs) <= tol, "forward inside summon_full_params differs by ",
                 rel_diff(mine, theirs));
    // Evaluation on one rank: a forward inside summon_full_params issues no collective.
    for (int i = 0; ctx.rank == 0 && i < 3; ++i)
      WORKER_CHECK(torch::equal(model->forward(x), mine), "a forward on rank 0 alone differs");
    // LibTorch's own serialization of the module sees the whole parameters here (and only here).
    TempDir dir;
    torch::save(model, dir / "model.pt");
    TinyTransformer loaded(32, 16, 2, 3, 8);
    loaded->to(at::kDouble);
    torch::load(loaded, dir / "model.pt");
    for (const auto& kv : loaded->named_parameters())
      WORKER_CHECK(rel_diff(kv.value(), ref_params[kv.key()]) <= tol,
                   "torch::save inside summon_full_params: ", kv.key(), " differs by ",
                   rel_diff(kv.value(), ref_params[kv.key()]));
    for (auto& p : model->parameters()) p.mul_(0.5);  // dropped: no writeback
  }
  expect_same_parameters(*ref, *sharded, tol, "after summon without writeback");
  {
    auto full = sharded->summon_full_params(/*writeback=*/true);
    torch::NoGradGuard no_grad;
    for (auto& p : unique_parameters(*model)) p.mul_(0.5);
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& p : unique_parameters(*ref)) p.mul_(0.5);
  }
  expect_same_parameters(*ref, *sharded, tol, "after summon with writeback");

  // torch::load of a LibTorch module file (another model's weights) inside the guard replaces the
  // parameters' data; writeback keeps the loaded values.
  {
    TempDir dir;
    torch::manual_seed(11);
    TinyTransformer other(32, 16, 2, 3, 8);
    other->to(at::kDouble);
    torch::save(other, dir / "other.pt");
    torch::load(ref, dir / "other.pt");
    {
      auto full = sharded->summon_full_params(/*writeback=*/true);
      torch::load(model, dir / "other.pt");
    }
    expect_same_parameters(*ref, *sharded, tol, "after torch::load inside summon with writeback");
    // A file of another shape: an error naming the parameter, and that parameter keeps its values.
    TinyTransformer wider(32, 24, 2, 3, 8);
    wider->to(at::kDouble);
    torch::save(wider, dir / "wider.pt");
    {
      auto full = sharded->summon_full_params(/*writeback=*/true);
      torch::load(model, dir / "wider.pt");
    }
    std::string error;
    try {
      (void)sharded->full_state_dict();
    } catch (const std::exception& e) {
      error = e.what();
    }
    WORKER_CHECK(contains(error, "was replaced inside the guard by a tensor of shape") &&
                     contains(error, "nothing of it was written back"),
                 "torch::load of another shape inside summon: ", error.empty() ? "no error" : error);
    expect_same_parameters(*ref, *sharded, tol, "after a refused torch::load of another shape");
  }

  // Explicit unshard: every unit gathered; the next step trains as usual; reshard frees them.
  auto handle = sharded->unshard();
  handle.wait();
  int64_t all = shard_bytes(*sharded);
  for (const auto& u : sharded->units()) all += u.padded_bytes;
  WORKER_CHECK(sharded->memory_stats().param_bytes == all, "after unshard: ", sharded->memory_stats().param_bytes,
               " bytes of parameters, expected every shard and every unit unsharded: ", all);
  sharded->reshard();
  WORKER_CHECK(sharded->memory_stats().param_bytes == shard_bytes(*sharded),
               "after reshard: ", sharded->memory_stats().param_bytes,
               " expected the shards only: ", shard_bytes(*sharded));
  (void)sharded->unshard();  // abandoned handle: its gathers still land
  lm_step_side_by_side(ref, ref_opt, model, opt, ctx, 2);
  expect_same_parameters(*ref, *sharded, tol, "after explicit unshard");
  if (ctx.rank == 0) std::cout << "full params ok" << std::endl;
}

TEST(FullParams, SummonAndExplicitUnshardEqualLocalTraining) {
  for (const char* mode : {"none", "mp"}) {
    auto r = launch("full_params_worker", 3, {mode});
    ASSERT_TRUE(r.all_ok()) << mode << "\n" << r.report();
  }
}

}  // namespace
}  // namespace fsdp_test
