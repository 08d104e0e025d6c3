#pragma once
// User options for fully_shard(), in the LibTorch TORCH_ARG idiom: chained setters, defaults,
// validated when FSDP is applied.
#include <torch/arg.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/wrap_policy.h"

namespace fsdp {

enum class ShardingStrategy {
  kFullShard,    // shard parameters, gradients, optimizer state; reshard after forward
  kShardGradOp,  // like kFullShard, but parameters stay unsharded from forward until backward
  kNoShard,      // replicate (DDP): all-reduce gradients
  kHybridShard,  // shard within groups of F consecutive ranks, replicate across groups
};
std::string to_string(ShardingStrategy s);
// Accepts FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD (any case, '-' or '_').
ShardingStrategy parse_sharding_strategy(const std::string& name);

// What to do with a parameter that several units' modules share (e.g. tied embeddings).
enum class SharedParameterPolicy {
  kLowestCommonAncestor,  // place it in the lowest unit that contains every module using it
  kError,                 // refuse, naming the parameter
};

struct Options {
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  // kHybridShard only: ranks per shard group (consecutive ranks). 0 = LOCAL_WORLD_SIZE.
  // Other strategies shard over the whole world (or not at all, for kNoShard).
  TORCH_ARG(int, sharding_factor) = 0;
  // Which submodules become units, decided bottom-up (see wrap_policy.h). Empty: none.
  TORCH_ARG(WrapPolicy, auto_wrap_policy) = nullptr;
  // Manual annotation: these submodules become units (in addition to the policy's).
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, wrap_modules) = {};
  TORCH_ARG(SharedParameterPolicy, shared_parameters) = SharedParameterPolicy::kLowestCommonAncestor;
  // Broadcast rank 0's parameters and buffers when FSDP is applied, so ranks that initialized
  // differently start from the same model.
  TORCH_ARG(bool, sync_module_states) = true;
  // Broadcast rank 0's buffers (e.g. BatchNorm running stats) at the end of every backward, so
  // buffers stay replicated (DistributedDataParallel's broadcast_buffers).
  TORCH_ARG(bool, broadcast_buffers) = true;
};

}  // namespace fsdp
