#pragma once
// ShardingGroups: the communicators a sharding strategy needs (paper 3.2.2): the F ranks a
// FlatParameter is split over, the replicas that hold the same shard (hybrid), and the world.
#include "fsdp/comm.h"
#include "fsdp/options.h"
#include "fsdp/process_group.h"

namespace fsdp {

struct ShardingGroups {
  CommunicatorPtr
      shard_comm;  // the F ranks a FlatParameter is split over; null under NO_SHARD and hybrid F == 1, the world (of one) at world size 1
  CommunicatorPtr replicate_comm;  // hybrid: ranks holding the same shard; null otherwise
  CommunicatorPtr world_comm;      // all ranks (NO_SHARD's all-reduce, broadcasts)
  // Options::reshard_after_forward_size consecutive ranks of the shard group, over which
  // parameters stay sharded between forward and backward; null if that size is 0.
  CommunicatorPtr post_forward_comm;
  int world_size = 1;           // gradients are averaged over all ranks
  int sharding_factor = 1;      // F
  bool keep_unsharded = false;  // F == 1 (NO_SHARD, world of one): no separate shard copy
  bool deterministic = false;   // Options::deterministic: exact gradient sums

  // Validates the strategy's options against the world (local, no communication); returns F.
  static int check(const ProcessGroup& pg, const Options& options);
  // check(), then creates the strategy's sub-groups (collective).
  static ShardingGroups create(ProcessGroup& pg, const Options& options);
  // Creates post_forward_comm (collective over it), validated by create(). Separate, so that it
  // runs after the cross-rank model check, which names a size that differs between ranks.
  void create_post_forward_group(ProcessGroup& pg, const Options& options);
};

}  // namespace fsdp
