#pragma once
// The FSDP runtime of one sharded model: its units, the interception that unshards a unit when
// an operation reads its parameters, and the autograd hooks that reshard and reduce gradients.
#include <torch/torch.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "flat_param.h"
#include "fsdp/fully_shard.h"
#include "fsdp/memory.h"
#include "fsdp/options.h"
#include "fsdp/process_group.h"
#include "fsdp/trace.h"
#include "runtime/tracer.h"

namespace at {
class RecordFunction;
}

namespace fsdp {

struct Unit {
  std::string name;
  int parent = -1;
  std::vector<int> ancestors;  // enclosing units, nearest first
  std::vector<int> flat_params;
  int expected_grads = 0;  // used parameters that require grad, counted when backward reaches the unit
  int ready_grads = 0;
  bool counted = false;    // expected_grads computed for this backward
  bool prefetched = false;   // gathered ahead of use and not used since: the touch rule keeps it
  bool forward_seen = false; // took part in this iteration's forward
  bool backward_done = false; // its gradients are complete in this iteration's backward
};

class Runtime {
 public:
  Runtime(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr pg, Options options);
  ~Runtime();

  // Interception entry point, for every operation while the runtime lives.
  void on_op(const at::RecordFunction& fn);
  // Throws the first error the interception met since the last call, if any.
  void rethrow_pending_error();
  // Autograd hooks.
  void on_grad_pre(int flat_param, int slot);
  void on_grad_post(int flat_param, int slot);
  void on_backward_end();

  // For the public handle.
  std::vector<std::pair<std::string, at::Tensor>> named_shard_pieces() const;
  bool is_original_parameter(const at::Tensor& t) const;
  std::unordered_map<std::string, at::Tensor> full_state_dict();
  void load_full_state_dict(const std::unordered_map<std::string, at::Tensor>& state);
  MemoryStats memory_stats() const;
  // One line per distinct communicator: its role, name and transport.
  std::string describe_communicators() const;
  void reset_peak_memory_stats();
  void release_cached_memory();
  const std::vector<UnitInfo>& unit_infos() const { return unit_infos_; }
  const Options& options() const { return options_; }
  int sharding_factor() const { return sharding_factor_; }
  int world_size() const { return pg_->size(); }
  std::shared_ptr<torch::nn::Module> module() const { return module_; }
  // The explicit form (fsdp::Sharded): -1 if `module` is not one of this runtime's units.
  int unit_of_module(const torch::nn::Module* module) const;
  void enter_unit(int unit);
  void exit_unit(int unit);
  void pre_backward(int unit);
  void enable_trace(bool on);
  IterationTrace last_trace() const;

 private:
  void intercept(const at::RecordFunction& fn);
  void build_units();
  void build_flat_params();
  void check_same_model_on_all_ranks();
  void register_hooks();
  void remove_hooks();
  bool unit_unsharded(int unit) const;
  bool unit_needs_gather(int unit) const;
  int unsharded_unit_count() const;  // what the rate limiter counts
  bool in_backward() const;
  void begin_backward();
  void touch(int unit);
  void issue_unshard(int unit, const char* why);
  void wait_unshard(int unit);
  void unshard(int unit) { issue_unshard(unit, "on demand"); wait_unshard(unit); }
  void prefetch(int unit, const char* why);
  void reshard(int unit);
  static int next_in(const std::vector<int>& order, int unit);
  // The first unit after `unit` in this backward's order whose backward has not finished. A unit
  // touched again after later units finished (the root, between blocks) must not re-gather them.
  int next_pending_in_backward(int unit) const;
  void post_backward(int unit);
  void finish_reduction(int flat_param);
  void finish_reductions(size_t keep_in_flight);
  void reshard_all();
  void broadcast_buffers();
  void update_sharded_grad_bytes();

  std::shared_ptr<torch::nn::Module> module_;
  ProcessGroupPtr pg_;
  Options options_;
  int sharding_factor_ = 1;
  bool reshard_after_forward_ = true;
  FlatParamGroup group_;
  MemoryTracker memory_;
  BufferPool pool_;

  // Assignment of the module's parameters to units, before the FlatParameters exist.
  struct PlannedParam {
    std::string name;
    std::vector<std::string> aliases;
    at::Tensor param;
    int unit;
  };
  std::vector<PlannedParam> planned_;
  std::vector<Unit> units_;
  std::vector<std::unique_ptr<FlatParam>> flat_params_;
  std::vector<UnitInfo> unit_infos_;
  std::vector<std::pair<std::string, at::Tensor>> buffers_;

  // Read-only after construction, so the interception can read them from any thread.
  std::unordered_map<const c10::StorageImpl*, int> flat_param_of_storage_;
  std::unordered_map<const c10::TensorImpl*, std::pair<int, int>> slot_of_param_;
  std::unordered_map<const torch::nn::Module*, int> unit_of_module_;

  // False if nothing is ever sharded (NO_SHARD, world of one): no operator interception; every
  // parameter that requires grad is then expected to get a gradient in backward.
  bool intercepting_ = true;
  std::recursive_mutex mu_;
  int last_touched_ = -1;
  bool final_callback_queued_ = false;
  std::vector<int> reduce_order_;  // flat params with a reduction in flight, in issue order
  std::string pending_error_;

  // Execution order, for prefetching: forward_first_order_ lists units in the order this
  // iteration's forward first used them (forward prefetch uses the previous iteration's list);
  // forward_post_order_ in the order they were last used, whose reverse is the backward order.
  std::vector<int> forward_first_order_, previous_forward_order_, forward_post_order_, backward_order_;
  bool backward_started_ = false;
  int deferred_prefetch_ = -1;  // held back by the rate limiter until a reshard makes room
  const char* deferred_why_ = "";
  Tracer tracer_;
  IterationTrace last_trace_;
};

}  // namespace fsdp
