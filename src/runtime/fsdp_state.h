#pragma once
// FsdpState: the runtime of one sharded model. It is built by fully_shard() (strategy ->
// communicators, unit plan, cross-rank model check, FlatParameters built unit by unit, deferred
// modules materialized on the way) and owns the units, the Scheduler and the GradientReducer that
// the hooks (runtime/hooks.cpp) drive.
#include <torch/torch.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "buffer_pool.h"
#include "flat_param.h"
#include "fsdp/memory.h"
#include "fsdp/options.h"
#include "fsdp/process_group.h"
#include "internal_op_guard.h"
#include "memory_tracker.h"
#include "runtime/gradient_reducer.h"
#include "runtime/scheduler.h"
#include "runtime/tracer.h"
#include "runtime/unit.h"
#include "sharding_groups.h"
#include "unit_plan.h"

namespace fsdp {

namespace checkpoint::detail {
struct SaveJob;
}

class FsdpState {
 public:
  FsdpState(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr pg, Options options);
  FsdpState(const FsdpState&) = delete;
  // An error found inside an operator and never rethrown (no FSDP call came after it) is printed,
  // and the process exits with status 1: the forward that met it computed on invalid values.
  ~FsdpState();
  FsdpState& operator=(const FsdpState&) = delete;

  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  ProcessGroup& process_group() const { return *pg_; }
  const Options& options() const { return options_; }
  const ShardingGroups& groups() const { return groups_; }
  std::vector<Unit>& units() { return units_; }
  const std::vector<Unit>& units() const { return units_; }
  std::vector<std::unique_ptr<FlatParam>>& flat_params() { return flat_params_; }
  const std::vector<std::unique_ptr<FlatParam>>& flat_params() const { return flat_params_; }
  // The managed buffers (broadcast by broadcast_buffers), not those of ignored modules.
  const std::vector<std::pair<std::string, at::Tensor>>& buffers() const { return buffers_; }
  // What checkpoints and state dicts hold whole (rank 0's values): the managed buffers, then what
  // Options::ignored_modules / ignored_parameters leave alone.
  struct WholeTensor {
    std::string name;
    std::vector<std::string> aliases;  // further names of a tied ignored parameter
    at::Tensor tensor;
    const char* kind;  // "buffer" or "ignored parameter"
  };
  const std::vector<WholeTensor>& whole_tensors() const { return whole_tensors_; }
  // The ignored parameters (Options::ignored_modules / ignored_parameters), under their first names.
  std::vector<std::pair<std::string, at::Tensor>> ignored_parameters() const;
  Scheduler& scheduler() { return *scheduler_; }
  GradientReducer& reducer() { return *reducer_; }
  // False if nothing is ever sharded (NO_SHARD, world of one): no operator interception
  // (Note [NO_SHARD without interception]).
  // Some FlatParameter is freed after use, so operators must be watched to gather it in time.
  bool intercepting() const { return intercepting_; }

  // Lookups, read-only after construction (the operator hook reads them from any thread).
  // -1 / nullptr when absent.
  int flat_param_of_storage(const c10::StorageImpl* storage) const;
  // The flat param whose separate shard (Note [Shard writes]) has this storage.
  int flat_param_of_shard_storage(const c10::StorageImpl* storage) const;
  const std::pair<int, int>* slot_of_param(const c10::TensorImpl* param) const;  // {flat param, slot}
  int unit_of_module(const torch::nn::Module* module) const;
  // The {flat param, slot} whose gradient placeholder (Note [Gradient sentinel]) has this storage.
  const std::pair<int, int>* sentinel_of_storage(const c10::StorageImpl* storage) const;
  // The parameter whose storage from before fully_shard() `storage` is, while something still shows
  // it (a view or .data() kept from then): Note [Views kept from before fully_shard]. Null if none.
  const std::string* retired_parameter(const c10::StorageImpl* storage) const;

  // Held by every hook and API call that touches the runtime.
  std::recursive_mutex& mutex() { return mu_; }
  // Errors met where they cannot be thrown (the operator hook) are kept, first one wins, and
  // thrown by the next hook or API call; `print_now` also writes the first one to stderr at once.
  void set_pending_error(const std::string& message, bool print_now = false);
  bool has_pending_error() const { return !pending_error_.empty(); }
  void rethrow_pending_error();

  MemoryStats memory_stats();
  // Drops error feedback's residuals: loaded values start without them, as a new run does.
  void drop_feedback_residuals();
  void reset_peak_memory_stats();
  void release_cached_memory() { pool_.release_cached(); }
  // One line per distinct communicator: its role, name and transport.
  std::string describe_communicators() const;
  // Throws if the module's parameters are no longer those fully_shard() found (added, removed or
  // replaced since).
  void check_parameters_unchanged() const;
  // While summon_full_params() guards are alive, the parameters show storage FSDP does not watch.
  void enter_full_params() { ++full_params_guards_; }
  void exit_full_params() { --full_params_guards_; }
  bool full_params_summoned() const { return full_params_guards_.load() > 0; }
  // Note [Failed backward]: a backward began (its end-of-backward callback queued with `token`,
  // which lives as long as that backward's graph task) / ended through that callback.
  void begin_backward_pass(std::weak_ptr<void> token) {
    backward_token_ = std::move(token);
    backward_begun_ = true;
  }
  void end_backward_pass() { backward_begun_ = false; }
  // The backward that began is still running (its graph task lives).
  bool backward_running() const { return backward_begun_ && !backward_token_.expired(); }
  // If the last backward ended without its callback (an exception inside it): what it had not
  // landed in the pieces' .grad is dropped and the next iteration starts clean.
  void settle_failed_backward();
  // The model's checkpoint save still finishing in the background, if any (checkpoint::async_save).
  std::weak_ptr<checkpoint::detail::SaveJob>& in_flight_save() { return in_flight_save_; }

 private:
  static void check_mixed_precision(const MixedPrecision& mp);
  // Refuses offload where it means nothing (a CPU process group) or is not built yet.
  static void check_offload(const CpuOffload& offload, const at::Device& device);
  static void check_quantization(const Options& options);
  void check_same_model_on_all_ranks(const UnitPlan& plan) const;
  void check_same_options_on_all_ranks() const;
  void build_flat_params(UnitPlan& plan);

  std::shared_ptr<torch::nn::Module> module_;
  ProcessGroupPtr pg_;
  Options options_;
  ShardingGroups groups_;
  bool intercepting_ = false;
  std::atomic<int> full_params_guards_{0};  // read by the operator hook on any thread
  bool backward_begun_ = false;
  std::weak_ptr<void> backward_token_;
  std::vector<bool> reshard_after_forward_;  // per unit, from the strategy and Options::reshard_after_forward_policy
  MemoryTracker memory_;
  BufferPool pool_;
  std::unique_ptr<CpuOffloader> offloader_;  // CPU offload only; outlives the FlatParameters below
  Tracer tracer_;
  std::vector<std::unique_ptr<FlatParam>> flat_params_;
  std::vector<Unit> units_;
  std::vector<std::pair<std::string, at::Tensor>> buffers_;
  std::vector<WholeTensor> whole_tensors_;
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<Scheduler> scheduler_;

  std::unordered_map<const c10::StorageImpl*, int> flat_param_of_storage_;
  std::unordered_map<const c10::StorageImpl*, int> flat_param_of_shard_storage_;
  std::unordered_map<const c10::TensorImpl*, std::pair<int, int>> slot_of_param_;
  std::unordered_map<const torch::nn::Module*, int> unit_of_module_;
  std::unordered_map<const c10::StorageImpl*, std::pair<int, int>> sentinel_of_storage_;
  struct RetiredStorage {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    std::string name;
  };
  std::vector<RetiredStorage> retiring_;  // every parameter's storage before it moved into its FlatParameter
  std::unordered_map<const c10::StorageImpl*, RetiredStorage> retired_storage_;  // those still shown after

  std::recursive_mutex mu_;
  std::string pending_error_;
  std::weak_ptr<checkpoint::detail::SaveJob> in_flight_save_;
  std::vector<const c10::TensorImpl*> parameters_at_shard_;  // module_->parameters() at the end of fully_shard()
};

// An API call's hold on the runtime for its duration: the runtime's lock, an error kept from the
// operator hook rethrown, and the call's tensor operations FSDP's own (InternalOpGuard), without grad.
class RuntimeCall {
 public:
  explicit RuntimeCall(FsdpState& state) : lock_(state.mutex()) {
    state.rethrow_pending_error();
    state.settle_failed_backward();
  }
  RuntimeCall(const RuntimeCall&) = delete;
  RuntimeCall& operator=(const RuntimeCall&) = delete;

 private:
  std::lock_guard<std::recursive_mutex> lock_;
  InternalOpGuard internal_;
  at::NoGradGuard no_grad_;
};

}  // namespace fsdp
