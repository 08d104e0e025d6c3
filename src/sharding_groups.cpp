#include "sharding_groups.h"

#include "fsdp/check.h"

namespace fsdp {

int ShardingGroups::check(const ProcessGroup& pg, const Options& options) {
  const int W = pg.size();
  const auto strategy = options.sharding_strategy();
  int F = 1;
  switch (strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      FSDP_CHECK(options.sharding_factor() == 0 || options.sharding_factor() == W, to_string(strategy),
                 " shards over the whole world (", W, " ranks), so sharding_factor must be 0 or ", W, ", got ",
                 options.sharding_factor(), "; use HYBRID_SHARD to shard over fewer ranks");
      F = W;
      break;
    case ShardingStrategy::kNoShard:
      FSDP_CHECK(options.sharding_factor() == 0 || options.sharding_factor() == 1,
                 "NO_SHARD replicates parameters, so sharding_factor must be 0 or 1, got ", options.sharding_factor());
      break;
    case ShardingStrategy::kHybridShard:
      F = options.sharding_factor() ? options.sharding_factor() : pg.env().local_world_size;
      FSDP_CHECK(F >= 1 && F <= W, "HYBRID_SHARD sharding_factor ", F, " must be between 1 and the world size ", W);
      FSDP_CHECK(W % F == 0, "HYBRID_SHARD: world size ", W, " is not divisible by the sharding factor ", F,
                 "; choose a sharding_factor that divides ", W, " (shard groups are F consecutive ranks)");
      break;
  }
  if (const int k = options.reshard_after_forward_size()) {
    FSDP_CHECK(F > 1, "reshard_after_forward_size ", k, " needs sharded parameters, but ", to_string(strategy),
               " at world size ", W, " does not shard them; leave reshard_after_forward_size at 0");
    FSDP_CHECK(k > 1 && k < F && F % k == 0, "reshard_after_forward_size must divide the shard group's size ", F,
               " and lie strictly between 1 and ", F, ", got ", k,
               "; use 0 to free parameters completely after forward, or a reshard_after_forward policy "
               "returning false to keep them whole");
  }
  return F;
}

ShardingGroups ShardingGroups::create(ProcessGroup& pg, const Options& options) {
  const int W = pg.size(), F = check(pg, options);
  ShardingGroups g;
  g.world_size = W;
  g.world_comm = pg.world();
  g.sharding_factor = F;
  g.deterministic = options.deterministic();
  if (F > 1 && F < W) {
    const int r = pg.rank();
    std::vector<int> shard_ranks, replica_ranks;
    for (int i = 0; i < F; ++i) shard_ranks.push_back(r / F * F + i);
    for (int i = r % F; i < W; i += F) replica_ranks.push_back(i);
    g.shard_comm = pg.new_group(shard_ranks, "shard");
    g.replicate_comm = pg.new_group(replica_ranks, "replicate");
  } else if (F == W && options.sharding_strategy() != ShardingStrategy::kNoShard) {
    g.shard_comm = pg.world();
  }
  g.keep_unsharded = F == 1;
  return g;
}

void ShardingGroups::create_post_forward_group(ProcessGroup& pg, const Options& options) {
  const int k = options.reshard_after_forward_size();
  if (k == 0 || post_forward_comm) return;
  std::vector<int> ranks;
  for (int i = 0; i < k; ++i) ranks.push_back(pg.rank() / k * k + i);  // inside the shard group: k divides F
  post_forward_comm = pg.new_group(ranks, "post_forward");
}

}  // namespace fsdp
