#pragma once
// GradientReducer: gradients from autograd into each FlatParameter's flat gradient buffer, counted
// per unit, then reduce-scattered (all-reduced under NO_SHARD, plus the replica all-reduce under
// HYBRID_SHARD) as soon as a unit's gradients are complete (paper 3.3), with a bound on the
// reductions in flight; at the end of backward, every reduction finished into the shard pieces'
// .grad and the buffers made equal across ranks.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flat_param.h"
#include "fsdp/options.h"
#include "memory_tracker.h"
#include "runtime/backward_stepper.h"
#include "runtime/tracer.h"
#include "runtime/unit.h"

namespace fsdp {

class GradientReducer {
 public:
  // `every_param_expected`: no operator interception sees which parameters were read (NO_SHARD,
  // world of one), so every parameter that requires grad is expected to get a gradient.
  GradientReducer(std::vector<Unit>& units, std::vector<std::unique_ptr<FlatParam>>& flat_params,
                  const Options& options, bool every_param_expected, CommunicatorPtr world, Tracer& tracer,
                  MemoryTracker& memory);

  // The first gradient hook of a backward: the user may have dropped the pieces' gradients.
  void begin_backward();
  // Before AccumulateGrad of slot `s` of FlatParameter `f`: finish a reduction of f already issued
  // in this backward (a parameter used again), make sure its gradient buffer exists, and clear the
  // parameter's .grad so AccumulateGrad hands it autograd's tensor (Note [Gradient stealing]).
  void prepare_grad(int f, int s);
  // After AccumulateGrad: moves the gradient into the buffer and counts it; true when all of the
  // unit's expected gradients are in.
  bool take_grad(int f, int s);
  // Issues unit u's reductions, first finishing the oldest ones until fewer than
  // Options::reductions_in_flight remain (Note [Reductions in flight]).
  void reduce(int u);
  // Unit u has a gradient buffer whose reduction was not issued (its gradients did not all arrive).
  bool has_unreduced(int u) const;
  // Between backward passes: gradients of a backward without sync are held, not yet reduced
  // (Note [Gradients held without sync]); the pieces' .grad do not hold them.
  bool holds_unreduced() const;
  // The message for an operation over reduced gradients (`what`, e.g. "clip_grad_norm_") asked for
  // while holds_unreduced().
  static std::string unreduced_error(const std::string& what);
  // Waits for every reduction and averages it into the shard pieces' .grad.
  // Every reduction finished, and (CPU offload) landed in host memory.
  void finish_all();
  // Broadcasts rank 0's module buffers (Options::broadcast_buffers).
  void broadcast_buffers(const std::vector<std::pair<std::string, at::Tensor>>& buffers);
  // Clears the per-backward gradient counts and flags; without sync, keeps the gradients for the
  // next backward to add to. Counts this backward as held (Note [Backward passes held]).
  void end_backward();
  // Scheduler::abandon_backward: reductions issued complete without landing, and every gradient
  // not reduced (this backward's, and those held without sync) is dropped; then end_backward().
  void abandon_backward();
  // Whether backward reduces gradients (FullyShardedModule::set_requires_gradient_sync).
  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }
  // HYBRID_SHARD: whether reductions include the all-reduce across replicas
  // (FullyShardedModule::set_requires_all_reduce).
  void set_all_reduce(bool on) { all_reduce_ = on; }
  bool all_reduce() const { return all_reduce_; }
  // Deterministic mode: whether backward's gradients join the exact sums and its pass the count
  // (FullyShardedModule::set_backward_counted).
  void set_counted(bool counted) { counted_ = counted; }
  void update_sharded_grad_bytes();
  // FullyShardedModule::set_step_in_backward.
  BackwardStepper& stepper() { return stepper_; }

 private:
  // Finishes f's reduction; under the step in backward, steps f once its pieces' gradients are in.
  void finish_reduction(int f);
  void finish_reductions(size_t keep_in_flight);
  // begin_backward(): gradients held from backward passes without sync follow what the user did
  // to the pieces' .grad since (Note [Gradients held without sync]).
  void drop_or_resync_held(bool observable);
  // A shard piece of FlatParameter f whose .grad is gone, replaced or written since end_backward
  // recorded it (Note [Backward passes held]).
  bool piece_grads_changed(size_t f) const;
  void step(FlatParam& fp);

  std::vector<Unit>& units_;
  std::vector<std::unique_ptr<FlatParam>>& flat_params_;
  const Options& options_;
  bool every_param_expected_;
  CommunicatorPtr world_;
  Tracer& tracer_;
  MemoryTracker& memory_;
  bool sync_ = true;
  bool all_reduce_ = true;
  bool counted_ = true;
  BackwardStepper stepper_;
  std::vector<int> reduce_order_;  // FlatParameters with a reduction in flight, in issue order
  // CPU offload: FlatParameters whose reduced shard is on its way to the host and still holds
  // device memory, oldest first; released by count, like reductions in flight.
  std::vector<int> to_host_order_;
  // Note [Backward passes held]: backward passes since the user last zeroed or dropped a gradient,
  // and each shard piece's .grad (identity, version) as the last backward left it.
  struct HeldGrad {
    const c10::TensorImpl* impl = nullptr;
    uint32_t version = 0;
    // The module parameter's own .grad (the sentinel, or undefined) and its version: Note [Module
    // zero_grad].
    at::Tensor param_grad;
    uint32_t param_grad_version = 0;
  };
  // Zeroes or drops the pieces' gradients of the parameters whose own .grad the user zeroed or
  // dropped since the last backward (Module::zero_grad()).
  void apply_module_zero_grad();
  int64_t backwards_held_ = 0;
  int64_t backwards_since_sync_ = 0;         // deterministic mode's divisor: this rank's part of it
  std::vector<std::vector<HeldGrad>> held_;  // [flat param][slot]
  // While gradients are held without sync: each FlatParameter's optimizer_writes() then.
  std::vector<int64_t> held_shard_versions_;
};

}  // namespace fsdp
