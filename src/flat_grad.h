#pragma once
// FlatGrad: the gradient side of one FlatParameter. During backward, AccumulateGrad gives a
// parameter its gradient as usual (stealing autograd's tensor, no copy); take() then moves it into
// the parameter's region of one flat gradient buffer (a copy the first time, an add for a later
// gradient) and leaves in the parameter's .grad a zero-stride zero (Note [Gradient sentinel]). The buffer's reduction (issued by flat_param_collectives.h) lands here
// and is averaged into the shard pieces' .grad. Kept unsharded (NO_SHARD), the buffer persists
// between iterations and the pieces' .grad alias it (Note [NO_SHARD flat gradient]). Hybrid
// reductions that skip the replicas keep their partial sums here (Note [Hybrid sharding]).
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "buffer_pool.h"
#include "cpu_offload.h"
#include "fsdp/comm.h"
#include "memory_tracker.h"
#include "param_slot.h"

namespace fsdp {

// What a FlatGrad needs to know of its FlatParameter.
struct FlatGradLayout {
  int64_t numel = 0, padded_numel = 0, shard_numel = 0;
  at::ScalarType dtype = at::kFloat;         // the shard's: the pieces' .grad
  at::ScalarType reduce_dtype = at::kFloat;  // the flat buffer's (mixed precision's reduce dtype)
  at::TensorOptions unsharded_options;       // the unsharded parameters' dtype and device
  // False when the shard is the unsharded storage (F == 1, no mixed precision, no offload).
  bool separate_shard = true;
  int world_size = 1;  // reductions average over it
  // Options::deterministic: the buffer's values of each backward go into exact sums
  // (exact_sum.h), which the reductions add; the pieces get their mean over backward passes.
  bool deterministic = false;
};

class FlatGrad {
 public:
  // `slots` are the FlatParameter's (it outlives this object).
  FlatGrad(std::vector<ParamSlot>& slots, const FlatGradLayout& layout, MemoryTracker* memory, BufferPool* buffers,
           CpuOffloader* offload);
  // Waits for a reduction still in flight: its buffers must outlive the communicator's use.
  ~FlatGrad();
  FlatGrad(const FlatGrad&) = delete;
  FlatGrad& operator=(const FlatGrad&) = delete;

  // Per slot, what its module parameter's .grad holds between backwards (a zero of the parameter's
  // shape, all strides 0: Note [Gradient sentinel]).
  const std::vector<at::Tensor>& sentinels() const { return sentinels_; }

  // The flat gradient buffer exists during backward (padded_numel elements, reduce dtype).
  bool has_buffer() const { return buffer_.defined(); }
  const at::Tensor& buffer() const { return buffer_; }
  // Returns true if it allocated storage that outlives this backward (NO_SHARD's store).
  bool ensure_buffer();
  // Moves slot's .grad into its region of the buffer (see the header comment).
  void take(int slot);
  // Gradient accumulation without communication: the buffer's gradients of this backward become
  // kept values that later backwards add to, until a reduction takes them.
  void keep_unreduced();

  // Deterministic mode (FlatGradLayout::deterministic).
  bool deterministic() const { return layout_.deterministic; }
  // How many counted backward passes this rank ran since its last reduction, this one included
  // when `counted`; an uncounted one's gradients are dropped, not added to the exact sums.
  void set_backward_count(int64_t n, bool counted) {
    backward_count_ = n;
    counted_ = counted;
  }
  // After begin_reduction(): the exact sums of every backward since the last reduction and, last
  // in each shard's part, the backward count; int64 [F, limbs * shard_numel + 1] in the wire form
  // for the world (exact::wire_for), the input of this reduction (kept alive until it completes).
  at::Tensor take_exact();

  // A reduction of the buffer: begin_reduction() readies the buffer (regions no gradient reached,
  // and the padding, become zeros); the collective fills `output` (the buffer itself when F == 1,
  // else new_reduction_output()); complete_reduction() takes the sums, once `work` is done.
  void begin_reduction();
  at::Tensor new_reduction_output();
  // `defer_replicas`: hybrid, the shard group's sums wait for a later reduction across replicas.
  void set_reduction(at::Tensor output, WorkPtr work, bool defer_replicas, bool across_replicas);
  bool reduce_pending() const { return reduce_started_; }
  // The reduction in flight; null if it needed no communication (a world of one).
  const WorkPtr& reduce_work() const { return work_; }
  WorkPtr take_reduce_work();
  // The reduction's collective failed: it is no longer pending (the error goes to the caller).
  void abandon_reduction() { reduce_started_ = false; }
  // The last reduction issued an all-reduce across replicas.
  bool reduced_across_replicas() const { return across_replicas_; }
  // Averages the finished reduction into the pieces' .grad; true when they now hold it, false when
  // it is kept for the reduction across replicas, is on its way to the host (CPU offload), or
  // `defer_landing` left it for land() (Note [Step on its own thread]).
  bool complete_reduction(bool defer_landing);

  // Per slot: this rank holds a gradient of it that is not in the pieces' .grad yet (kept without
  // sync, folded into the exact sums, or shard-group sums awaiting the replicas).
  std::vector<uint8_t> held_slots() const;
  bool holds_any() const {
    const std::vector<uint8_t> held = held_slots();
    return std::find(held.begin(), held.end(), 1) != held.end();
  }
  // NO_SHARD without deterministic mode: the held sums are the store the pieces' .grad alias, so
  // the user's writes to those act on them directly (Note [Gradients held without sync]).
  bool holds_in_store() const { return !layout_.separate_shard && !layout_.deterministic; }
  // After a backward that held gradients: a piece with none gets a .grad, so the user's zero_grad()
  // (in place or set to none) is seen: its region of the store, or else zeros.
  void mark_held_pieces();
  // holds_in_store(): a piece's .grad the user dropped zeroes its region of the store, one they
  // replaced is copied into it (and aliases it again).
  void resync_store();
  // Otherwise: the user zeroed or dropped the gradients, so the held ones go too.
  void drop_held();
  // A backward failed: every gradient not reduced (in the buffer, the exact sums or the partial
  // sums) is dropped; NO_SHARD's store stays only as the pieces' .grad that alias it.
  void abandon_unreduced();
  // A reduction complete_reduction() left for land() is dropped instead (its host copy waited for;
  // NO_SHARD's store, reduced in place, zeroed).
  void discard_landing();

  // Hybrid: shard-group sums waiting for the replica all-reduce (reduce dtype).
  bool has_partial() const { return partial_.defined(); }
  // Adds them into `sums` (this reduction's shard-group sums) and lets them go.
  void add_partial_into(at::Tensor& sums);

  // Adds a reduction complete_reduction() left pending into the pieces' .grad, first waiting for
  // its copy to the host under CPU offload. Returns false (a no-op) without one pending.
  bool land();
  bool landing_pending() const { return landing_.values.defined(); }
  // CPU offload: frees the device copy of the reduced shard that is on its way to the host, in
  // stream order (CpuOffloader::release_source), so device memory does not hold every gradient
  // until the end of backward.
  void release_device_grad();

  // How many earlier backward passes' gradients this rank holds (in the pieces' .grad or kept
  // buffers) for the next reduction to add to (Note [Backward passes held]).
  void set_backwards_held(int64_t n) { backwards_held_ = n; }
  int64_t backwards_held() const { return backwards_held_; }
  // The sequence number of the next reduction of each purpose, for its fingerprint.
  int64_t count_reduction() { return reductions_issued_++; }
  int64_t count_replica_reduction() { return replica_reductions_issued_++; }
  // Bytes of the shard pieces' gradients that currently exist.
  int64_t sharded_bytes() const;
  // `g` is slot's sentinel (or a tensor over its storage).
  bool is_sentinel(int slot, const at::Tensor& g) const;

 private:
  std::vector<at::Tensor> make_sentinels() const;
  // NO_SHARD: a piece's .grad over its region of the store, and whether `g` is one.
  at::Tensor grad_alias(const ParamSlot& s, const at::Tensor& store) const;
  bool is_grad_alias(const ParamSlot& s, const at::Tensor& g, const at::Tensor& store) const;
  // Adds to `slots` those this rank's backward gave no gradient whose sums in `values` are not
  // zero: another rank used them (Note [Parameters used on some ranks]).
  void mark_used_elsewhere(const at::Tensor& values, std::vector<uint8_t>& slots) const;
  // Moves the averaged reduction (`reduced`, this shard's sums) into the pieces' .grad of the
  // slots in `slots`; `in_place`: `reduced` may be scaled and aliased (a host copy of its own).
  void add_into_piece_grads(const at::Tensor& reduced, const std::vector<uint8_t>& slots, bool in_place, double scale);
  // Regions no gradient reached, and the padding, become zeros.
  void zero_unwritten();
  // Deterministic mode: adds the buffer into the exact sums; its regions then take the next
  // backward's gradients as new values.
  void fold();
  // Deterministic mode's complete_reduction(): the exact sums become the pieces' mean gradients.
  bool complete_exact_reduction(bool defer_landing);
  // Hands the reduced shard (`values`, the pieces' sums or means) to the pieces, through the host
  // under CPU offload.
  bool land_reduced(at::Tensor values, std::vector<uint8_t> got, double scale, bool defer_landing);

  std::vector<ParamSlot>& slots_;
  FlatGradLayout layout_;
  MemoryTracker* memory_;
  BufferPool* buffers_;
  CpuOffloader* offload_;  // null unless the shard lives in host memory
  at::Tensor like_;        // empty, with the unsharded options: the dtype and keys of the store's aliases
  at::Tensor buffer_;
  // Per slot, for the current buffer: its region holds a gradient of this backward / a gradient
  // kept from earlier ones (NO_SHARD accumulation), which later gradients add to.
  std::vector<uint8_t> written_, kept_;
  std::vector<uint8_t> folded_;  // deterministic mode: per slot, a gradient of it is in exact_
  at::Tensor exact_;             // deterministic mode: the exact sums (take_exact())
  bool exact_blank_ = false;     // exact_ is uninitialized: no counted backward was folded into it
  at::Tensor exact_sent_;        // the exact sums a reduction in flight reads
  int64_t backward_count_ = 1;
  bool counted_ = true;                // this backward's gradients join the exact sums
  std::vector<at::Tensor> sentinels_;  // per slot: the module parameter's .grad between backwards
  // NO_SHARD: the storage the pieces' gradients alias (alive while any of them is).
  c10::weak_intrusive_ptr<c10::StorageImpl> store_{c10::intrusive_ptr<c10::StorageImpl>()};

  // The reduction in flight.
  at::Tensor output_;
  WorkPtr work_;
  bool reduce_started_ = false;  // begin_reduction() ran and complete_reduction() did not yet
  bool defer_replicas_ = false;  // this reduction skips the replica all-reduce: completion keeps it
  bool across_replicas_ = false;
  at::Tensor partial_;                  // hybrid: shard-group sums awaiting the replica all-reduce
  std::vector<uint8_t> partial_slots_;  // per slot: a gradient of it is in partial_

  // A finished reduction not yet in the pieces' .grad (land(), on backward's thread or the step's own).
  struct Landing {
    at::Tensor values;           // this shard's sums (NO_SHARD: the averaged store); undefined: none
    WorkPtr copy;                // CPU offload: values' copy to the host
    std::vector<uint8_t> slots;  // the slots it holds gradients of
    bool in_place = false;       // values may be scaled and aliased (a host copy of its own)
    bool alias_store = false;    // NO_SHARD: the pieces' .grad alias values, already averaged
    double scale = 1.0;          // values times scale is the pieces' gradient
  };
  Landing landing_;
  WorkPtr device_grad_copy_;  // CPU offload: landing_.copy, for release_device_grad() on backward's thread
  int64_t backwards_held_ = 0;
  int64_t reductions_issued_ = 0, replica_reductions_issued_ = 0;
};

}  // namespace fsdp
