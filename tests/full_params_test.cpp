// Explicit unshard / reshard, summon_full_params (read and write back), and the per-unit
// reshard-after-forward policy: each checked against local training and FSDP's memory figures.
#include <gtest/gtest.h>

#include <functional>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

at::Tensor batch(int world, int step) {
  return at::randint(0, 32, {2 * world, 8}, at::detail::createCPUGenerator(40 + step));
}

// One step of local training on the global batch and sharded training on this rank's rows;
// after_forward / after_backward run between the sharded model's phases.
void train_step(TinyTransformer& ref, torch::optim::Optimizer& ref_opt, TinyTransformer& model,
                torch::optim::Optimizer& opt, const WorkerContext& ctx, int step,
                const std::function<void()>& after_forward = nullptr,
                const std::function<void()>& after_backward = nullptr) {
  const auto x = batch(ctx.world, step);
  ref_opt.zero_grad();
  loss_of(ref, x).backward();
  ref_opt.step();
  opt.zero_grad();
  auto loss = loss_of(model, x.narrow(0, ctx.rank * 2, 2));
  if (after_forward) after_forward();
  loss.backward();
  if (after_backward) after_backward();
  opt.step();
}

int64_t shard_bytes(fsdp::FullyShardedModule& s) {
  int64_t b = 0;
  for (const auto& u : s.units()) b += u.shard_bytes;
  return b;
}

// args: mixed ("mp" for bf16 compute, else none). summon_full_params shows the whole parameters in
// full precision, a forward inside it equals the local model's, writes are dropped without
// writeback and land in the shards with it; explicit unshard gathers everything and training goes on.
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
  train_step(ref, ref_opt, model, opt, ctx, 0);
  train_step(ref, ref_opt, model, opt, ctx, 1);

  const auto x = batch(ctx.world, 9);
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
  train_step(ref, ref_opt, model, opt, ctx, 2);
  expect_same_parameters(*ref, *sharded, tol, "after explicit unshard");
  if (ctx.rank == 0) std::cout << "full params ok" << std::endl;
}

TEST(FullParams, SummonAndExplicitUnshardEqualLocalTraining) {
  for (const char* mode : {"none", "mp"}) {
    auto r = launch("full_params_worker", 3, {mode});
    ASSERT_TRUE(r.all_ok()) << mode << "\n" << r.report();
  }
}

// args: strategy, unit name, whether that unit reshards after forward. Training equals local
// training, and after forward exactly the root and the units kept by the policy are unsharded.
FSDP_WORKER(reshard_policy_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0), chosen = ctx.args.at(1);
  const bool reshard = ctx.args.at(2) == "true";
  auto [ref, model] = twin_tiny_transformers();
  auto o = fsdp::Options()
               .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
               .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>())
               .forward_prefetch(false)
               .reshard_after_forward([&](const std::string& name, const torch::nn::Module&) -> c10::optional<bool> {
                 if (name == chosen) return reshard;
                 return c10::nullopt;
               });
  if (strategy == "HYBRID_SHARD") o.sharding_factor(2);
  auto sharded = fsdp::fully_shard(model, pg, o);
  torch::optim::AdamW ref_opt(unique_parameters(*ref), torch::optim::AdamWOptions(0.01)),
      opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
  const bool full_shard = strategy != "SHARD_GRAD_OP";
  int64_t expected = shard_bytes(*sharded);
  for (const auto& u : sharded->units()) {
    const bool kept = u.parent < 0 || (u.name == chosen ? !reshard : !full_shard);
    if (kept) expected += u.padded_bytes;
  }
  for (int step = 0; step < 3; ++step)
    train_step(ref, ref_opt, model, opt, ctx, step, [&] {
      const int64_t after_forward = sharded->memory_stats().param_bytes;
      WORKER_CHECK(after_forward == expected, "step ", step, ": ", after_forward,
                   " bytes of parameters after forward; expected ", expected, " (the root and units kept unsharded)");
    });
  expect_same_parameters(*ref, *sharded, 1e-12, "reshard policy");
  if (ctx.rank == 0) std::cout << strategy << " " << chosen << " reshard " << reshard << " ok" << std::endl;
}

TEST(ReshardAfterForward, PerUnitPolicyKeepsOrFreesThatUnitOnly) {
  const std::vector<std::vector<std::string>> cases = {{"FULL_SHARD", "blocks.2", "false"},
                                                       {"SHARD_GRAD_OP", "blocks.0", "true"},
                                                       {"HYBRID_SHARD", "blocks.1", "false"}};
  for (const auto& args : cases) {
    auto r = launch("reshard_policy_worker", args[0] == "HYBRID_SHARD" ? 4 : 3, args);
    ASSERT_TRUE(r.all_ok()) << args[0] << "\n" << r.report();
  }
}

// args: k (Options::reshard_after_forward_size, 0: off), "mp" or "none". FULL_SHARD at world 4
// with two modeled hosts of 2 ranks. Training equals local training; after forward each block
// holds 1/k of its unsharded parameters; the second iteration's modeled wire bytes are printed for
// the world (spans hosts) and the post-forward group (inside a host) with the backward gathers'
// expected share of each.
FSDP_WORKER(post_forward_group_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const int k = std::stoi(ctx.args.at(0));
  const bool mixed = ctx.args.at(1) == "mp";
  auto [ref, model] = twin_tiny_transformers();
  auto o = fsdp::Options()
               .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>())
               .forward_prefetch(false)
               .reshard_after_forward_size(k);
  if (mixed) o.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kFloat).reduce_dtype(at::kFloat));
  auto sharded = fsdp::fully_shard(model, pg, o);
  torch::optim::SGD ref_opt(unique_parameters(*ref), 0.1), opt(sharded->parameters(), 0.1);
  int64_t expected_after_forward = shard_bytes(*sharded);
  // The last block, which backward needs first, stays whole from the second step on (Note [Kept
  // for backward]): it adds the rest of its size after forward and has no backward gather.
  const auto& last = sharded->units().back();
  WORKER_CHECK(last.parent >= 0, "expected the last unit to be a block");
  const int64_t kept_extra = last.padded_bytes - (k ? last.padded_bytes / k : 0);
  double backward_gathers_world = 0, backward_gathers_group = 0;  // expected modeled bytes
  for (const auto& u : sharded->units()) {
    if (u.parent < 0) {
      expected_after_forward += u.padded_bytes;  // the root keeps its parameters
      continue;
    }
    expected_after_forward += k ? u.padded_bytes / k : 0;
    if (&u == &last) continue;
    backward_gathers_world += fsdp::modeled_wire_bytes(fsdp::Collective::kAllGather, u.padded_bytes, ctx.world);
    if (k) backward_gathers_group += fsdp::modeled_wire_bytes(fsdp::Collective::kAllGather, u.padded_bytes, k);
  }
  // The group FSDP made (ProcessGroup::new_group hands out the communicator of the same key and ranks).
  fsdp::CommunicatorPtr group;
  if (k) {
    std::vector<int> ranks;
    for (int i = 0; i < k; ++i) ranks.push_back(ctx.rank / k * k + i);
    group = pg->new_group(ranks, "post_forward");
  }
  int64_t world_before = 0, group_before = 0;
  for (int step = 0; step < 3; ++step) {
    if (step == 2) {
      world_before = fsdp::modeled_link_stats(*pg->world())->wire_bytes;
      group_before = group ? fsdp::modeled_link_stats(*group)->wire_bytes : 0;
    }
    train_step(
        ref, ref_opt, model, opt, ctx, step,
        [&] {
          const int64_t after_forward = sharded->memory_stats().param_bytes;
          const int64_t expected = expected_after_forward + (step > 0 ? kept_extra : 0);
          WORKER_CHECK(after_forward == expected, "step ", step, ": ", after_forward,
                       " bytes of parameters after forward; expected ", expected,
                       " (shards, the root, 1/k of each block", step > 0 ? ", the last block whole)" : ")");
        },
        [&] {
          WORKER_CHECK(sharded->memory_stats().param_bytes == shard_bytes(*sharded), "step ", step,
                       ": post-forward shards outlive backward: ", sharded->memory_stats().param_bytes);
        });
  }
  expect_same_parameters(*ref, *sharded, mixed ? 1e-5 : 1e-12, "reshard to " + std::to_string(k) + " ranks");
  const int64_t world_bytes = fsdp::modeled_link_stats(*pg->world())->wire_bytes - world_before;
  const int64_t group_bytes = group ? fsdp::modeled_link_stats(*group)->wire_bytes - group_before : 0;
  WORKER_CHECK(!group || fsdp::modeled_link_stats(*group)->link == "intra", "the post-forward group spans hosts");
  std::cout << "wire world " << world_bytes << " group " << group_bytes << " backward_gathers_world "
            << static_cast<int64_t>(backward_gathers_world) << " backward_gathers_group "
            << static_cast<int64_t>(backward_gathers_group) << std::endl;
}

// args: strategy, k. fully_shard refuses the size on every rank, naming it and the fix.
FSDP_WORKER(reshard_size_error_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  auto [ref, model] = twin_tiny_transformers();
  try {
    fsdp::fully_shard(model, pg,
                      fsdp::Options()
                          .sharding_strategy(fsdp::parse_sharding_strategy(ctx.args.at(0)))
                          .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>())
                          .reshard_after_forward_size(std::stoi(ctx.args.at(1))));
  } catch (const fsdp::Error& e) {
    WORKER_CHECK(contains(e.what(), "reshard_after_forward_size"), "unclear error: ", e.what());
    return;
  }
  WORKER_CHECK(false, "reshard_after_forward_size ", ctx.args.at(1), " was accepted under ", ctx.args.at(0));
}

int64_t field_of(const LaunchResult& r, const std::string& key) {
  const std::string& out = r.ranks.at(0).output;
  const auto at = out.find(" " + key + " ");
  return at == std::string::npos ? -1 : std::stoll(out.substr(at + key.size() + 2));
}

TEST(ReshardAfterForward, ToSmallerGroupKeepsBackwardGathersInsideIt) {
  const std::vector<std::string> env = {"FSDP_NETWORK_MODEL=intra_gbps=1000,inter_gbps=1000,ranks_per_host=2"};
  for (const char* mode : {"none", "mp"}) {
    auto off = launch("post_forward_group_worker", 4, {"0", mode}, 300, env);
    auto on = launch("post_forward_group_worker", 4, {"2", mode}, 300, env);
    ASSERT_TRUE(off.all_ok() && on.all_ok()) << mode << "\n" << off.report() << on.report();
    const int64_t world_off = field_of(off, "world"), world_on = field_of(on, "world");
    const int64_t group_on = field_of(on, "group");
    const int64_t bwd_world = field_of(on, "backward_gathers_world"),
                  bwd_group = field_of(on, "backward_gathers_group");
    std::cout << mode << ": wire bytes per iteration across hosts " << world_off << " -> " << world_on
              << ", inside a host 0 -> " << group_on << std::endl;
    ASSERT_GT(bwd_world, 0);
    // Backward's gathers leave the link between hosts (up to a byte of rounding per collective)...
    EXPECT_NEAR(world_off - world_on, bwd_world, 8);
    // ... and run inside the host instead.
    EXPECT_NEAR(group_on, bwd_group, 8);
  }
}

TEST(ReshardAfterForward, SmallerGroupSizeIsValidated) {
  for (const auto& [strategy, k] :
       std::vector<std::pair<std::string, std::string>>{{"FULL_SHARD", "3"}, {"FULL_SHARD", "4"}, {"NO_SHARD", "2"}}) {
    auto r = launch("reshard_size_error_worker", 4, {strategy, k});
    ASSERT_TRUE(r.all_ok()) << strategy << " " << k << "\n" << r.report();
  }
}

}  // namespace
}  // namespace fsdp_test
