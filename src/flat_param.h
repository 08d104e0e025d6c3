#pragma once
// FlatParameter: one unit's parameters of one (dtype, requires_grad) group, flattened and
// concatenated in module order, right-padded to a multiple of the sharding factor F and split
// into F equal shards. The module's parameters become views of one flat storage that is freed
// while sharded and refilled in place by an all-gather, so autograd's saved views, the
// parameters' identities and their visible shapes survive every reshard. Under mixed precision
// the flat storage holds compute-dtype values cast from the full-precision shard before the
// gather, and gradients are reduced in the reduce dtype (Note [Mixed precision]). Under CPU offload
// the shard and its gradients are host tensors, copied to and from the device around each gather
// and reduction (Note [CPU offload]).
#include <torch/csrc/autograd/function.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "cpu_offload.h"
#include "fsdp/comm.h"
#include "fsdp/options.h"
#include "memory_tracker.h"
#include "sharding_groups.h"

namespace fsdp {

struct ParamSlot {
  std::string name;                  // first qualified name in the module tree
  std::vector<std::string> aliases;  // further names of a shared (tied) parameter
  at::Tensor param;                  // the module's own parameter (identity kept)
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in the unsharded flat buffer
  int64_t numel = 0;
  // The part of this parameter inside this rank's shard: a 1-D leaf over the shard storage, handed
  // to the optimizer. Undefined if the parameter lies entirely in other ranks' shards.
  at::Tensor piece;
  int64_t piece_offset = 0;  // in the shard
  int64_t piece_numel = 0;
  std::shared_ptr<torch::autograd::Node> grad_accumulator;  // kept alive: autograd holds it weakly
  bool used = false;                                        // an op read it with grad mode on since the last backward
  bool got_grad = false;                                    // its AccumulateGrad ran in this backward
};

class FlatParam {
 public:
  FlatParam(int id, int unit, std::vector<ParamSlot> slots, const ShardingGroups& group, const MixedPrecision& mp,
            MemoryTracker* memory, BufferPool* buffers, CpuOffloader* offload = nullptr);
  // Waits for its collectives still in flight: their buffers outlive it in the module's parameters.
  ~FlatParam();
  FlatParam(const FlatParam&) = delete;
  FlatParam& operator=(const FlatParam&) = delete;

  int id() const { return id_; }
  int unit() const { return unit_; }
  bool requires_grad() const { return requires_grad_; }
  at::ScalarType dtype() const { return dtype_; }                  // the shard's (what the optimizer steps)
  at::ScalarType compute_dtype() const { return compute_dtype_; }  // the unsharded parameters'
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }    // the gradient reduction's
  int64_t numel() const { return numel_; }
  int64_t padded_numel() const { return padded_numel_; }
  int64_t shard_numel() const { return shard_numel_; }
  int64_t element_size() const { return element_size_; }  // of the shard
  int64_t compute_element_size() const { return compute_element_size_; }
  c10::StorageImpl* storage() const { return storage_; }
  std::vector<ParamSlot>& slots() { return slots_; }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  // The parameters are never freed: F == 1 and no mixed precision (the shard is the unsharded storage).
  bool keep_unsharded() const { return !separate_shard_; }

  bool is_unsharded() const { return unsharded_; }
  // True if the shard changed (optimizer step, load) since the unsharded copy was gathered.
  bool unsharded_is_stale() const;
  // Allocates the flat storage and issues the all-gather into it; returns the work, or null if
  // nothing is to gather (kept unsharded). The storage must not be read before wait_unshard().
  WorkPtr start_unshard();
  bool unshard_pending() const { return gather_work_ != nullptr; }
  const WorkPtr& gather_work() const { return gather_work_; }
  void wait_unshard();
  void unshard() {
    start_unshard();
    wait_unshard();
  }
  void reshard();  // free the flat storage (after waiting for a gather in flight into it)
  // reshard(), keeping first this rank's part of the unsharded values over the post-forward group
  // (Options::reshard_after_forward_size): the next start_unshard gathers from those parts, inside
  // that group, if the shard has not changed since. Plain reshard() without that group.
  void reshard_to_post_forward_shard();
  bool has_post_forward_shard() const { return post_forward_shard_.defined(); }
  void drop_post_forward_shard();
  // The communicator the all-gather and the reduction run on (for traces).
  std::string gather_track() const;
  std::string reduce_track() const;

  // The flat gradient buffer exists during backward. AccumulateGrad gives a parameter its
  // gradient as usual (stealing autograd's tensor, no copy); take_grad() then moves it into the
  // parameter's region of the buffer (a copy the first time, an add for a later gradient) and
  // clears the parameter's .grad: with a separate shard, to a zero-stride zero (Note [Gradient
  // sentinel]). A region no gradient reached is zeroed before the reduction.
  // Kept unsharded (NO_SHARD): the buffer persists between iterations and the pieces' .grad are
  // aliases of it, so a reduction writes the gradients in place and accumulation across backward
  // passes needs no copy. Returns true if it allocated storage that outlives this backward.
  bool has_grad_buffer() const { return full_grad_.defined(); }
  bool ensure_grad_buffer();
  void take_grad(int slot);
  // Issue the reduction of the flat gradient (asynchronous), then finish it: average over ranks and
  // add into the shard pieces' .grad (only pieces of parameters that got a gradient). Hybrid with
  // `across_replicas` false: only the shard group's reduce-scatter runs, and its result is kept
  // (partial) until a reduction across replicas includes it.
  void start_reduce(bool across_replicas = true);
  // Hybrid: a reduce-scattered sum is waiting for the replica all-reduce.
  bool has_partial() const { return partial_.defined(); }
  // The last start_reduce issued an all-reduce across replicas.
  bool reduced_across_replicas() const { return replica_reduce_issued_; }
  bool reduce_pending() const { return reduce_started_; }
  // The reduction in flight; null if it needed no communication (a world of one).
  const WorkPtr& reduce_work() const { return pending_work_; }
  // True when the pieces' .grad now hold the reduction; false when it is kept for the reduction
  // across replicas, is on its way to the host (CPU offload), or `defer_landing` left it for
  // land_grads() (the step's own thread lands it; Note [Step on its own thread]).
  bool finish_reduce(bool defer_landing = false);
  // Adds a reduction finish_reduce() left pending into the pieces' .grad, first waiting for its
  // copy to the host under CPU offload. Returns false (a no-op) without one pending.
  bool land_grads();
  bool landing_pending() const { return landing_.values.defined(); }
  // CPU offload: frees the device copy of the reduced shard that is on its way to the host, in
  // stream order (CpuOffloader::release_source), so device memory does not hold every gradient
  // until the end of backward.
  void release_device_grad();
  bool offloaded() const { return offload_ != nullptr; }
  // Gradient accumulation without communication: the buffer's gradients of this backward become
  // kept values that later backwards add to, until a reduction takes them.
  void keep_grads_unreduced();

  // Copies this rank's part of full padded flat values into the shard (load_full_state_dict).
  void copy_full_into_shard(const at::Tensor& full);
  // Collective over the shard group: the full padded flat values in the shard's dtype (a gather
  // of the shards into a new tensor; the unsharded storage itself when kept unsharded).
  at::Tensor full_values() const;
  // How many earlier backward passes' gradients this rank holds (in the pieces' .grad or kept
  // buffers) for the next reduction to add to; part of the reductions' labels (Note [Backward
  // passes held]).
  void set_backwards_held(int64_t n) { backwards_held_ = n; }
  // Bytes of the shard pieces' gradients that currently exist.
  int64_t sharded_grad_bytes() const;

 private:
  int64_t shard_version() const;
  // F > 1: the shard group has other members (at F == 1 a gather is a cast and a reduce-scatter
  // nothing, so neither goes through a communicator).
  bool sharded_over_peers() const { return group_.shard_comm && group_.shard_comm->size() > 1; }
  int id_, unit_;
  std::vector<ParamSlot> slots_;
  ShardingGroups group_;
  MemoryTracker* memory_;
  BufferPool* buffers_;    // transient buffers (unsharded storage, flat gradient, reduction output)
  CpuOffloader* offload_;  // null unless the shard lives in host memory
  bool requires_grad_ = false;
  at::ScalarType dtype_, compute_dtype_, reduce_dtype_;
  // The shard is its own tensor (F > 1, or mixed precision): the unsharded storage is gathered
  // (or, at F == 1, cast) from it and freed after use.
  bool separate_shard_ = true;
  int shard_rank_ = 0;
  int64_t numel_ = 0, padded_numel_ = 0, shard_numel_ = 0, element_size_ = 0, compute_element_size_ = 0;
  c10::StorageImpl* storage_ = nullptr;
  at::Tensor full_;   // 1-D over the unsharded storage
  at::Tensor shard_;  // this rank's shard (== full_ if keep_unsharded)
  bool unsharded_ = true;
  int64_t gathered_version_ = 0;
  at::Tensor full_grad_;
  // Per slot, for the current buffer: its region holds a gradient of this backward / a gradient
  // kept from earlier ones (NO_SHARD accumulation), which later gradients add to.
  std::vector<uint8_t> written_, kept_;
  std::vector<at::Tensor> make_grad_sentinels() const;
  std::vector<at::Tensor> grad_sentinels_;  // per slot: the module parameter's .grad between backwards
  // NO_SHARD: the storage the pieces' gradients alias (alive while any of them is).
  c10::weak_intrusive_ptr<c10::StorageImpl> grad_store_{c10::intrusive_ptr<c10::StorageImpl>()};
  // NO_SHARD: a piece's .grad over its region of the store, and whether `g` is one.
  at::Tensor grad_alias(const ParamSlot& s, const at::Tensor& store) const;
  bool is_grad_alias(const ParamSlot& s, const at::Tensor& g, const at::Tensor& store) const;
  at::Tensor reduced_;  // the reduction's output
  // Moves the averaged reduction (`reduced`, this shard's sums) into the pieces' .grad of the
  // slots in `slots`; `in_place`: `reduced` may be scaled and aliased (a host copy of its own).
  void add_into_piece_grads(const at::Tensor& reduced, const std::vector<uint8_t>& slots, bool in_place);
  // A finished reduction not yet in the pieces' .grad (land_grads(), on backward's thread or the
  // step's own).
  struct Landing {
    at::Tensor values;           // this shard's sums (NO_SHARD: the averaged store); undefined: none
    WorkPtr copy;                // CPU offload: values' copy to the host
    std::vector<uint8_t> slots;  // the slots it holds gradients of
    bool in_place = false;       // values may be scaled and aliased (a host copy of its own)
    bool alias_store = false;    // NO_SHARD: the pieces' .grad alias values, already averaged
  };
  Landing landing_;
  WorkPtr device_grad_copy_;     // CPU offload: landing_.copy, for release_device_grad() on backward's thread
  bool reduce_started_ = false;  // start_reduce() ran and finish_reduce() did not yet
  bool defer_replicas_ = false;  // this reduction skips the replica all-reduce: finish keeps it
  bool replica_reduce_issued_ = false;
  at::Tensor partial_;                   // hybrid: shard-group sums awaiting the replica all-reduce (reduce dtype)
  std::vector<uint8_t> partial_slots_;   // per slot: a gradient of it is in partial_
  at::Tensor gather_input_;              // what the gather in flight reads when not the shard, alive until it lands
  at::Tensor post_forward_shard_;        // compute dtype: 1/k of the unsharded values (reshard_to_post_forward_shard)
  int64_t post_forward_version_ = 0;     // the shard's version those values were gathered from
  bool gathering_post_forward_ = false;  // the last gather ran over the post-forward group
  WorkPtr pending_work_;                 // reduce-scatter (or all-reduce) in flight
  WorkPtr gather_work_;                  // all-gather in flight into full_
  // What each collective is for, as its members compare it (Note [Collective fingerprints]): the
  // flat parameter, the purpose, and how many collectives of that purpose it issued before.
  CollectiveOptions label(const char* purpose, int64_t& count) const;
  CollectiveOptions reduction_label(const char* purpose, int64_t& count) const;  // label() + backwards held
  int64_t backwards_held_ = 0;
  mutable int64_t gathers_ = 0, reductions_ = 0, replica_reductions_ = 0;
};

}  // namespace fsdp
