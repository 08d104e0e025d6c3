#pragma once
// Unit: one FSDP unit (paper 3.2.1), the FlatParameters of one wrapped module, and where it is in
// the iteration (TrainingState). Its methods are its communication phases; *when* they run is
// the Scheduler's decision.
#include <string>
#include <vector>

#include "flat_param.h"
#include "runtime/tracer.h"

namespace fsdp {

// Where a unit is in the current iteration. Reset to kIdle at the end of every backward.
enum class TrainingState {
  kIdle,                // not used in this iteration's forward (with grad) yet
  kForwardPrefetched,   // gathered ahead of its forward and not used since
  kForward,             // took part in this iteration's forward
  kBackwardPrefetched,  // took part in forward; gathered ahead of its backward and not used since
  kBackward,            // took part in forward and its backward is running
  kBackwardDone,        // all its gradients arrived in this backward
};
const char* to_string(TrainingState s);

class Unit {
 public:
  Unit(int index, std::string name, int parent, std::vector<int> ancestors, std::vector<FlatParam*> flat_params,
       bool reshard_after_forward, Tracer* tracer);

  int index() const { return index_; }
  const std::string& name() const { return name_; }
  int parent() const { return parent_; }  // -1 for the root
  bool is_root() const { return parent_ < 0; }
  // Frees its parameters after its forward (never for the root: Options::reshard_after_forward_policy).
  bool reshard_after_forward() const { return reshard_after_forward_; }
  const std::vector<int>& ancestors() const { return ancestors_; }  // nearest first
  const std::vector<FlatParam*>& flat_params() const { return flat_params_; }
  // Some FlatParameter that is freed after use holds frozen parameters (no gradient counts their
  // last use in backward).
  bool has_frozen_params() const;
  // Every FlatParameter freed after use holds frozen parameters: no gradient ever ends its backward.
  bool all_frozen() const;

  TrainingState state() const { return state_; }
  bool prefetched() const;
  bool forward_seen() const;
  bool backward_done() const { return state_ == TrainingState::kBackwardDone; }
  // Took part in this iteration's forward with grad and its backward has not begun.
  bool awaits_backward() const {
    return state_ == TrainingState::kForward || state_ == TrainingState::kBackwardPrefetched;
  }
  // Lifecycle transitions (see TrainingState).
  void mark_used(bool in_backward, bool grad_enabled);
  void mark_prefetched();
  void mark_backward_done() { state_ = TrainingState::kBackwardDone; }
  void reset() { state_ = TrainingState::kIdle; }

  // Some sharded FlatParameter of the unit holds (or is gathering) its unsharded storage.
  bool is_unsharded() const;
  // Some sharded FlatParameter must be gathered before use (absent, or older than its shard).
  bool needs_unshard() const;
  // Issues the all-gathers that needs_unshard() asks for; true if any was issued. `cast_on_host`:
  // offloaded shards are cast to the compute dtype on the host (Note [Cast on the host]).
  bool unshard(bool cast_on_host);
  // Waits for the unit's all-gathers in flight (the time waited is exposed communication).
  void wait_for_unshard(const char* what = "all-gather");
  // Frees the unsharded storage (after any gather into it landed); true if something was freed.
  // `to_post_forward_shards`: keep each FlatParameter's post-forward shard first (hpZ).
  bool reshard(bool to_post_forward_shards = false);
  // Frees the post-forward shards a backward did not use.
  void drop_post_forward_shards();

  // A gradient arrived (call before marking its slot used). The first one of a backward counts
  // those expected: parameters read with grad mode on, or all if `every_param_expected`; a
  // `newly_used` slot adds one. True when all expected gradients are in.
  bool note_grad(bool every_param_expected, bool newly_used);
  void reset_grad_count() { expected_grads_ = -1, ready_grads_ = 0; }

 private:
  int index_;
  std::string name_;
  int parent_;
  std::vector<int> ancestors_;
  std::vector<FlatParam*> flat_params_;
  bool reshard_after_forward_;
  Tracer* tracer_;
  TrainingState state_ = TrainingState::kIdle;
  int expected_grads_ = -1;  // -1: not counted yet in this backward
  int ready_grads_ = 0;
};

}  // namespace fsdp
