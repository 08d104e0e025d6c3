// Reshard after forward: the per-unit policy (Options::reshard_after_forward) and resharding to a
// smaller group (Options::reshard_after_forward_size), checked against local training, FSDP's
// memory figures and the modeled network's bytes.
#include <gtest/gtest.h>

#include "harness.h"
#include "models.h"

namespace fsdp_test {
namespace {

// args: strategy, unit name, whether that unit reshards after forward. Training equals local
// training, and after forward exactly the root and the units kept by the policy are unsharded.
FSDP_WORKER(reshard_policy_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  const std::string strategy = ctx.args.at(0), chosen = ctx.args.at(1);
  const bool reshard = ctx.args.at(2) == "true";
  auto [ref, model] = twin_tiny_transformers();
  auto o =
      fsdp::Options()
          .sharding_strategy(fsdp::parse_sharding_strategy(strategy))
          .auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>())
          .forward_prefetch(false)
          .reshard_after_forward_policy([&](const std::string& name, const torch::nn::Module&) -> c10::optional<bool> {
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
    lm_step_side_by_side(ref, ref_opt, model, opt, ctx, step, [&] {
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
    lm_step_side_by_side(
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
