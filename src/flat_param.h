#pragma once
// FlatParam: the paper's FlatParameter. One unit's parameters of one (dtype, requires_grad) group,
// flattened and concatenated in module order, right-padded to a multiple of the sharding factor F
// and split into F equal shards. The module's parameters become views of one flat storage that is
// freed while sharded and refilled in place (Note [Unshard in place]), so autograd's saved views,
// the parameters' identities and their visible shapes survive every reshard. This class holds the
// storage, the views, this rank's shard and its pieces, and where the unsharded values are; the
// collectives that move them are in flat_param_collectives.h, the gradients in flat_grad.h. Under
// mixed precision the flat storage holds compute-dtype values (Note [Mixed precision]); under CPU
// offload the shard is a host tensor (Note [CPU offload]).
#include <torch/torch.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "block_quantization.h"
#include "buffer_pool.h"
#include "cpu_offload.h"
#include "flat_grad.h"
#include "fsdp/comm.h"
#include "fsdp/options.h"
#include "memory_tracker.h"
#include "param_slot.h"
#include "quantized_collectives.h"
#include "sharding_groups.h"

namespace fsdp {

class FlatParam {
 public:
  FlatParam(int id, int unit, std::vector<ParamSlot> slots, const ShardingGroups& group, const MixedPrecision& mp,
            MemoryTracker* memory, BufferPool* buffers, CpuOffloader* offload = nullptr);
  // Waits for a gather still in flight: its buffers outlive it in the module's parameters.
  ~FlatParam();
  FlatParam(const FlatParam&) = delete;
  FlatParam& operator=(const FlatParam&) = delete;

  int id() const { return id_; }
  int unit() const { return unit_; }
  // Some parameter of it has required grad since fully_shard() (Note [Unfreezing]).
  bool requires_grad() const { return requires_grad_; }
  void note_requires_grad() { requires_grad_ = true; }
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
  const ShardingGroups& groups() const { return group_; }
  // F > 1: the shard group has other members (at F == 1 a gather is a cast and a reduce-scatter
  // nothing, so neither goes through a communicator).
  bool sharded_over_peers() const { return group_.shard_comm && group_.shard_comm->size() > 1; }
  int shard_rank() const { return shard_rank_; }
  const at::Tensor& shard() const { return shard_; }  // this rank's shard (the unsharded storage if kept)
  MemoryTracker& memory() const { return *memory_; }
  BufferPool& buffers() const { return *buffers_; }
  CpuOffloader* offload() const { return offload_; }  // null unless the shard lives in host memory
  bool offloaded() const { return offload_ != nullptr; }
  FlatGrad& grad() { return *grad_; }
  const FlatGrad& grad() const { return *grad_; }

  // The unsharded flat storage: a 1-D tensor over it (the parameters' views share its storage).
  const at::Tensor& unsharded() const { return full_; }
  // A tensor of its own over the whole flat storage: writes through it move no version counter
  // that autograd checks for the parameters' saved views.
  at::Tensor unsharded_alias() const;
  bool is_unsharded() const { return unsharded_; }
  // True if the shard changed (optimizer step, load) since the unsharded copy was gathered.
  bool unsharded_is_stale() const;
  // An operator wrote into the shard through a tensor whose version counter is not the shard's
  // or a piece's (an optimizer writing through .data()): Note [Shard writes].
  void note_shard_written() { shard_writes_.fetch_add(1, std::memory_order_relaxed); }
  // Moves whenever the shard is written: its own, its pieces' and note_shard_written()'s counts.
  int64_t shard_version() const;
  // Moves with the optimizer's writes (through the pieces, or .data(): Note [Shard writes]), not
  // with writes through the parameters or the shard itself (max_norm in forward, loads).
  int64_t optimizer_writes() const;
  // Gives the flat storage memory again if it was freed (same StorageImpl, new memory) and
  // records the shard's version its values are to come from. Its contents are undefined until
  // a gather (flat_param_collectives.h) fills them.
  void alloc_unsharded();
  // The gather into the flat storage that is in flight: `input` (if defined, a buffer of this
  // FlatParameter's counted as parameter memory) lives until it lands.
  void set_pending_gather(WorkPtr work, at::Tensor input, bool over_post_forward_group);
  bool unshard_pending() const { return gather_work_ != nullptr; }
  const WorkPtr& gather_work() const { return gather_work_; }
  // Waits for the gather in flight, if any, and frees its input.
  void wait_unshard();
  void reshard();  // free the flat storage (after waiting for a gather in flight into it)
  // reshard(), keeping first this rank's part of the unsharded values over the post-forward group
  // (Options::reshard_after_forward_size), for the next gather to gather from inside that group
  // if the shard has not changed since. Plain reshard() without that group.
  void reshard_to_post_forward_shard();
  bool has_post_forward_shard() const { return post_forward_shard_.defined(); }
  // The kept post-forward part if it still matches the shard, handed over (its memory stays
  // counted until the gather that reads it lands); else it is dropped and the result undefined.
  at::Tensor take_post_forward_shard();
  void drop_post_forward_shard();
  // The communicator the all-gather and the reduction run on (for traces).
  std::string gather_track() const;
  std::string reduce_track() const;
  // The sequence number of this FlatParameter's next all-gather, for its fingerprint.
  int64_t count_gather() const { return gathers_issued_++; }
  // Backward passes finished so far, also in the all-gathers' fingerprints: a gather pairs only with
  // one of the same pass (Note [Collective fingerprints]).
  void note_backward_finished() { ++backwards_finished_; }
  int64_t backwards_finished() const { return backwards_finished_; }

  // All-gathers carry the shards quantized in `format` (Options::all_gather_quantization).
  void quantize_gathers(const BlockFormat& format) { gather_format_ = format; }
  const c10::optional<BlockFormat>& gather_format() const { return gather_format_; }
  // Gradient reductions carry codes in `format` (Options::reduce_quantization).
  void quantize_reductions(const BlockFormat& format) { reduce_format_ = format; }
  const c10::optional<BlockFormat>& reduce_format() const { return reduce_format_; }
  // Error feedback's residuals of the quantized reductions (enabled by Quantization::error_feedback).
  QuantizationResiduals& residuals() { return residuals_; }

  // Copies this rank's part of full padded flat values into the shard (load_full_state_dict).
  void copy_full_into_shard(const at::Tensor& full);
  // Multiplies the shard's part of flat elements [begin, end) by `scale`; an unsharded copy that
  // was current stays so (the caller made the same change there): Note [Embedding max_norm].
  void scale_shard_range(int64_t begin, int64_t end, double scale);

 private:
  int id_, unit_;
  std::vector<ParamSlot> slots_;
  ShardingGroups group_;
  MemoryTracker* memory_;
  BufferPool* buffers_;    // transient buffers (unsharded storage, gather inputs)
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
  std::atomic<int64_t> shard_writes_{0};  // note_shard_written() calls, part of shard_version()
  WorkPtr gather_work_;                   // all-gather in flight into full_
  at::Tensor gather_input_;               // what the gather in flight reads when not the shard, alive until it lands
  bool gathering_post_forward_ = false;   // the last gather ran over the post-forward group
  at::Tensor post_forward_shard_;         // compute dtype: 1/k of the unsharded values (reshard_to_post_forward_shard)
  int64_t post_forward_version_ = 0;      // the shard's version those values were gathered from
  mutable int64_t gathers_issued_ = 0;
  int64_t backwards_finished_ = 0;
  c10::optional<BlockFormat> gather_format_, reduce_format_;
  QuantizationResiduals residuals_;
  std::unique_ptr<FlatGrad> grad_;
};

}  // namespace fsdp
