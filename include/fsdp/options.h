#pragma once
// User options for fully_shard(), in the LibTorch TORCH_ARG idiom: chained setters, defaults,
// validated when FSDP is applied.
#include <torch/arg.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/deferred_init.h"
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

// When to all-gather the next unit during backward (paper 3.3.2). "Next" is the unit whose backward
// comes next: the reverse of the order in which units finished their forward, recorded afresh in
// every iteration (so models whose graph changes between iterations still prefetch correctly).
enum class BackwardPrefetch {
  kBackwardPre,   // when the current unit's backward starts: the next all-gather is issued before
                  // the current reduce-scatter and overlaps the current gradient computation
  kBackwardPost,  // when the current unit's gradients are complete, just before its reduce-scatter
  kNone,          // gather each unit when backward reaches it
};
std::string to_string(BackwardPrefetch p);
// Accepts BACKWARD_PRE, BACKWARD_POST, NONE (any case, '-' or '_').
BackwardPrefetch parse_backward_prefetch(const std::string& name);

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
  // For a model built under fsdp::DeferredInit (meta parameters): initializes each module's own
  // parameters and buffers once fully_shard has given them CPU storage, one unit at a time (see
  // deferred_init.h). Null: fsdp::reset_parameters (the standard LibTorch modules).
  TORCH_ARG(ParamInitFn, param_init_fn) = nullptr;

  // Overlap of communication with computation (paper 3.3, 3.4).
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
  // All-gather the next unit (in the previous iteration's forward order) before computing the
  // current one, so forward's gathers overlap computation as backward's do. With the rate limiter
  // at 2 it holds the same pair of units in forward that BACKWARD_PRE holds in backward, so the
  // parameter peak does not grow. (PyTorch FSDP defaults to off; measured here it cut the step
  // time of the peer benchmark's compute-bound GPT at world 2 by about 10%.)
  TORCH_ARG(bool, forward_prefetch) = true;
  // Rate limiter: a prefetch is held back while `all_gather_limit` units other than the root are
  // already unsharded or being gathered, and issued once a reshard makes room. Bounds the
  // memory prefetching can take. Gathers a computation needs now are never held back.
  TORCH_ARG(bool, limit_all_gathers) = true;
  TORCH_ARG(int, all_gather_limit) = 2;
  // Reductions (reduce-scatter, or all-reduce for NO_SHARD) left in flight while backward goes on.
  // Before a unit's reduction is issued, the runtime waits for the oldest ones until fewer than
  // this many remain (a communicator runs its collectives in order, so waiting then costs no
  // overlap), and it frees a reduction's buffers only then, never earlier, so gradient memory is
  // the same in every run: the current unit's unsharded gradient plus this many reductions'
  // (unsharded gradient and output). 2 lets a reduction that finishes late overlap the next two
  // units' backward; 1 saves one unsharded gradient buffer and exposes more communication when
  // communication takes as long as computation; 0 waits for each reduction when it is issued.
  // NO_SHARD reduces in place in the persistent flat gradient the pieces' .grad alias, so there the
  // setting bounds the overlap only, not memory.
  TORCH_ARG(int, reductions_in_flight) = 2;
  // Keep released unsharded parameter and gradient buffers and reuse them for the next unit or
  // iteration of the same size, instead of returning them to the system and mapping fresh,
  // zero-filled pages every time (MemoryStats::cached_bytes). Off: every buffer is freed when
  // released, so idle memory is returned at once, at the cost of page faults on every gather.
  TORCH_ARG(bool, reuse_buffers) = true;
  // Record an event trace of every iteration (FullyShardedModule::last_trace()).
  TORCH_ARG(bool, trace) = false;
};

}  // namespace fsdp
