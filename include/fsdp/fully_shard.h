#pragma once
// Applying FSDP to an unmodified module tree, and the handle the user keeps.
//
//   auto pg = fsdp::ProcessGroup::from_env();
//   auto sharded = fsdp::fully_shard(model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<BlockImpl>()));
//   torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(1e-3));
//   for (...) { opt.zero_grad(); auto loss = model->forward(x).mean(); loss.backward(); opt.step(); }
//
// The model keeps its parameters (names, shapes, identities); their storage is FSDP's: freed
// while sharded and gathered just in time when an operation reads them (forward, backward, or
// any other op). Rules that come with sharding:
//  * SPMD: every rank runs the same operations on parameters (a read gathers, a collective).
//  * Build the optimizer over sharded->parameters(), the local shard pieces; after backward the
//    original parameters' .grad is undefined and the gradients live on those pieces.
//  * Modify parameters through the shards (optimizer) or load_full_state_dict(), never in place
//    on the module's parameters: FSDP refuses that with an error (it would be lost).
//  * NO_SHARD (and any strategy on a world of one) has nothing to gather: like DDP it works through
//    autograd hooks alone, without the operator interception, and expects every parameter that
//    requires grad to get a gradient; a unit whose gradients do not all arrive is reduced at the
//    end of backward instead of during it.
#include <torch/torch.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "fsdp/memory.h"
#include "fsdp/options.h"
#include "fsdp/process_group.h"
#include "fsdp/trace.h"

namespace fsdp {

class Runtime;

// One unit as FSDP built it (for printing, tests and memory estimates).
struct UnitInfo {
  std::string name;  // qualified module name; "" for the root
  int parent = -1;   // index of the enclosing unit; -1 for the root
  std::vector<std::string> parameters;
  int64_t numel = 0;          // sum over its FlatParameters of unpadded elements
  int64_t padded_numel = 0;   // after right-padding each FlatParameter to a multiple of F
  int64_t padded_bytes = 0;   // unsharded size in bytes
  int64_t shard_bytes = 0;    // this rank's shard in bytes
};

class FullyShardedModule {
 public:
  explicit FullyShardedModule(std::shared_ptr<Runtime> runtime);
  ~FullyShardedModule();

  // The local shard pieces, one leaf tensor per original parameter that overlaps this rank's
  // shard (1-D), for the optimizer. Frozen parameters' pieces are included with requires_grad
  // false (optimizers skip them: they never get gradients).
  std::vector<at::Tensor> parameters() const;
  // The same pieces under the original parameters' names.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  // Throws if `params` (e.g. an optimizer's parameters) contains an original parameter of the
  // sharded module instead of a shard piece.
  void check_optimizer_parameters(const std::vector<at::Tensor>& params) const;
  void check_optimizer(const torch::optim::Optimizer& optimizer) const;

  // Collective: every rank gets every parameter (unsharded, cloned) and buffer by name.
  std::unordered_map<std::string, at::Tensor> full_state_dict();
  // Collective: loads full tensors by name into the shards (and buffers); names must match.
  void load_full_state_dict(const std::unordered_map<std::string, at::Tensor>& state);

  MemoryStats memory_stats() const;
  void reset_peak_memory_stats();
  // Frees the idle buffers kept for reuse (MemoryStats::cached_bytes), e.g. before evaluation
  // with another model. Not collective.
  void release_cached_memory();

  const std::vector<UnitInfo>& units() const;
  ShardingStrategy sharding_strategy() const;
  int sharding_factor() const;  // ranks a FlatParameter is split over (1 for kNoShard)
  int world_size() const;
  std::shared_ptr<torch::nn::Module> module() const;
  // A table of units, sizes and the strategy, then the communicators and their transports, for logs.
  std::string describe() const;

  // Event trace (also Options::trace): when on, every backward completes an iteration's trace,
  // available from last_trace() until the next one completes.
  void set_trace(bool on);
  IterationTrace last_trace() const;

 private:
  std::shared_ptr<Runtime> runtime_;
};

// Applies FSDP to `module` in place. Collective over `pg`: every rank must call it with a model
// of the same structure (checked: a mismatch names the first differing parameter).
std::shared_ptr<FullyShardedModule> fully_shard(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr pg,
                                                Options options = {});
template <typename ModuleImpl>
std::shared_ptr<FullyShardedModule> fully_shard(torch::nn::ModuleHolder<ModuleImpl>& module, ProcessGroupPtr pg,
                                                Options options = {}) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(module.ptr()), std::move(pg), std::move(options));
}

}  // namespace fsdp
