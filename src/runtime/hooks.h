#pragma once
// Hooks: every way FSDP sees the computation of an unmodified model, registered in one place and
// each calling the Scheduler or the GradientReducer, never one another:
//  * the operator hook (a global RecordFunction callback): an operator reads a parameter of a
//    sharded unit -> Scheduler::use (Note [Interception by storage]); where the parameters are the
//    shards, only between a backward and the optimizer's first step (the sentinel watch);
//  * AccumulateGrad pre/post hooks on every parameter -> GradientReducer, and
//    Scheduler::post_backward when a unit's gradients are complete;
//  * a callback queued on the autograd engine at the end of backward -> Scheduler::finalize_backward;
//  * fsdp::Sharded<M> (include/fsdp/sharded.h): entering, leaving and the backward of an explicit unit
//    (src/runtime/explicit_units.cpp).
#include <atomic>
#include <utility>
#include <vector>

#include "runtime/fsdp_state.h"

namespace fsdp {

class Hooks {
 public:
  // Registers every hook of `state` (which must outlive this object).
  explicit Hooks(FsdpState& state);
  // Removes them: a graph may keep an AccumulateGrad node alive longer than the model's state.
  ~Hooks();
  Hooks(const Hooks&) = delete;
  Hooks& operator=(const Hooks&) = delete;

  FsdpState& state() { return state_; }
  // The qualified name of a parameter of `module` that a live model's hooks already manage, or "".
  static std::string managed_parameter(torch::nn::Module& module);
  // The live model that made `module` a unit, and the unit; {nullptr, -1} if none.
  static std::pair<Hooks*, int> find_unit(const torch::nn::Module& module);

  // Called by the registered mechanisms.
  void on_operator(const at::RecordFunction& fn);
  void on_grad_pre(int flat_param, int slot);
  void on_grad_post(int flat_param, int slot);
  void on_backward_end();
  // A Checkpointed module of this model recomputes its forward in backward (detail::before_recompute).
  void on_recompute();
  void on_unit_enter(int unit);
  void on_unit_exit(int unit);
  void on_unit_backward(int unit);

 private:
  void intercept(const at::RecordFunction& fn);
  // Where the parameters are the shards: an embedding_renorm_ of a managed parameter, done for every
  // rank's rows (Note [Embedding max_norm]); false if `fn` is not one.
  bool renorm_unsharded(const at::RecordFunction& fn);
  // Where the parameters are the shards (no interception): from the end of a backward to the start
  // of the next, reads of the gradient placeholders are errors and in-place writes to a
  // FlatParameter's storage are counted (Note [Gradient sentinel]).
  void watch_sentinels(const at::RecordFunction& fn);
  void begin_sentinel_watch();
  void end_sentinel_watch();
  // The first watch saw an outermost operator read parameter `t` from FSDP's storage.
  void note_read_in_first_watch(const at::Tensor& t);
  int64_t shard_versions() const;
  // Keeps an error if `fn` reads (not zeroes) a parameter's gradient placeholder, its input number
  // `input` (Note [Gradient sentinel]): the gradient is in the shard pieces.
  void check_sentinel_read(const at::RecordFunction& fn, const at::Tensor& t, size_t input);
  // Keeps an error if `t`, outside every FlatParameter's storage, is a parameter FSDP manages: its
  // data was replaced (module->to(dtype or device), set_data). Note [Replaced parameter data].
  void check_replaced_param(const at::Tensor& t);
  // A parameter's AccumulateGrad node, which carries FSDP's gradient hooks, goes with its old data
  // when set_data changes its dtype or device: hooks every new one, so that the backward throws the
  // error before accumulating into any of them.
  void hook_replaced_params();
  // Keeps an error if `t` shows a parameter's storage from before fully_shard() (Note [Views kept
  // from before fully_shard]): it holds the initial values, not the trained ones.
  void check_retired_read(const at::RecordFunction& fn, const at::Tensor& t);
  void add_grad_hooks();
  void hook_slot(int flat_param, int slot);  // FSDP's pre and post hooks on its AccumulateGrad node
  void remove_grad_hooks();
  // Note [Unfreezing]: a parameter whose requires_grad changed since FSDP last looked gets FSDP's
  // gradient hooks (if it never had them) and its piece follows; a piece changed alone is an error.
  void sync_requires_grad(int flat_param, int slot);
  void sync_requires_grad();
  // Gradients that reached a parameter hooked too late in the backward that ends now, taken as its
  // hooks would have taken them.
  void take_late_grads();
  void watch_unfreezing(const at::RecordFunction& fn);
  bool any_hooked() const;
  // The first gradient hook (or recompute) of a backward: queue the end-of-backward callback on
  // the backward running now and begin the scheduler's and the reducer's backward.
  void begin_backward();
  // An operator of a backward read a unit before any gradient hook ran: at that backward's end,
  // if none ran, Scheduler::end_backward_without_gradients (Note [Backward without parameter
  // gradients]).
  void watch_backward_without_gradients();

  FsdpState& state_;
  std::vector<std::pair<int, int>> hooked_since_backward_;  // slots hooked since the last backward ended
  std::weak_ptr<void> gradless_watch_;  // lives while a watch_backward_without_gradients() callback is queued
  // The sentinel watch: whether it runs now, how many more backwards it may follow (none once an
  // optimizer step has changed the shards), and the shards' versions when it began. The first
  // watch runs from construction until the first backward, or until every parameter has been read
  // twice from FSDP's storage (a model only run forward; module->to() reads each once), and
  // counts for neither.
  std::atomic<bool> watching_{false};
  // The operator callback stays on after the watches for an embedding's max_norm (Note [Embedding
  // max_norm]): the model has one, or a renormalization was seen.
  std::atomic<bool> renorm_watch_{false};
  std::atomic<bool> first_watch_{false};
  // No parameter required grad at fully_shard() and nothing is intercepted: reads are watched for
  // one that does now, until one is hooked (Note [Unfreezing]).
  std::atomic<bool> unfreeze_watch_{false};
  std::atomic<bool> shard_norm_noted_{false};            // the note of shard_norm_note.h was printed
  std::vector<std::vector<char>> reads_in_first_watch_;  // per slot, up to 2; under the state's mutex
  size_t slots_to_read_ = 0;                             // slots read fewer than twice
  int watches_left_ = 0;
  int64_t versions_at_watch_ = 0;
};

namespace detail {
// Called by a Checkpointed backward before it recomputes: every live runtime that manages a
// parameter of `module` begins its backward now, so its end-of-backward callback is queued on the
// backward running the checkpoint, not on the nested one that the recompute's backward runs.
void before_recompute(const torch::nn::Module& module);
// On this thread: the mixed-precision dtype hint of the last operator that ended with an exception
// since clear_escaped_dtype_hint(), "" if none; taking it clears it.
std::string take_escaped_dtype_hint();
void clear_escaped_dtype_hint();
}  // namespace detail

}  // namespace fsdp
