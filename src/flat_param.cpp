#include "flat_param.h"

#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "tensor_alias.h"

namespace fsdp {

FlatParam::FlatParam(int id, int unit, std::vector<ParamSlot> slots, const ShardingGroups& group,
                     const MixedPrecision& mp, MemoryTracker* memory, BufferPool* buffers, CpuOffloader* offload)
    : id_(id),
      unit_(unit),
      slots_(std::move(slots)),
      group_(group),
      memory_(memory),
      buffers_(buffers),
      offload_(offload) {
  FSDP_CHECK(!slots_.empty(), "internal: empty FlatParameter");
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  dtype_ = slots_[0].param.scalar_type();
  requires_grad_ = slots_[0].param.requires_grad();
  const bool floating = at::isFloatingType(dtype_);
  compute_dtype_ = floating && mp.param_dtype() ? *mp.param_dtype() : dtype_;
  reduce_dtype_ = floating && mp.reduce_dtype() ? *mp.reduce_dtype() : compute_dtype_;
  // Deterministic mode reduces exact sums, never the store the pieces' gradients alias.
  separate_shard_ =
      offload_ || !group_.keep_unsharded || compute_dtype_ != dtype_ || reduce_dtype_ != dtype_ || group_.deterministic;
  const int F = group_.shard_comm ? group_.shard_comm->size() : 1;
  FSDP_CHECK(F > 1 || group_.keep_unsharded, "internal: sharded without a shard group");
  shard_rank_ = group_.shard_comm ? group_.shard_comm->rank() : 0;
  const int shard_rank = shard_rank_;
  for (auto& s : slots_) {
    s.shape = s.param.sizes().vec();
    s.numel = s.param.numel();
    s.offset = numel_;
    numel_ += s.numel;
  }
  // Right-pad to a multiple of F: at most F - 1 elements.
  padded_numel_ = (numel_ + F - 1) / F * F;
  shard_numel_ = padded_numel_ / F;
  at::Tensor values = at::zeros({padded_numel_}, slots_[0].param.options().requires_grad(false));
  element_size_ = values.element_size();
  for (auto& s : slots_) values.narrow(0, s.offset, s.numel).view(s.shape).copy_(s.param.detach());
  // Mixed precision: the unsharded storage holds compute-dtype values, never full-precision ones.
  full_ = compute_dtype_ == dtype_ ? values : values.to(compute_dtype_);
  compute_element_size_ = full_.element_size();
  storage_ = full_.storage().unsafeGetStorageImpl();
  for (auto& s : slots_) {
    // The parameter keeps its TensorImpl (identity, name, requires_grad) and now points into the
    // flat storage (in compute dtype under mixed precision).
    s.param.set_data(full_.narrow(0, s.offset, s.numel).view(s.shape));
  }
  memory_->add_param(padded_numel_ * compute_element_size_);
  if (!separate_shard_) {
    shard_ = full_;
  } else if (offload_) {
    // In host memory, outside the device figures MemoryTracker keeps.
    shard_ = offload_->host_empty(shard_numel_, dtype_);
    shard_.copy_(values.narrow(0, int64_t(shard_rank) * shard_numel_, shard_numel_));
  } else {
    shard_ = F == 1 && !full_.is_same(values)
                 ? values
                 : values.narrow(0, int64_t(shard_rank) * shard_numel_, shard_numel_).clone();
    memory_->add_param(shard_numel_ * element_size_);
  }
  values = at::Tensor();
  // One leaf per parameter over the part of the shard it overlaps.
  const int64_t lo = int64_t(shard_rank) * shard_numel_;
  const int64_t hi = lo + shard_numel_;
  for (auto& s : slots_) {
    const int64_t b = std::max(lo, s.offset), e = std::min(hi, s.offset + s.numel);
    if (b >= e) continue;
    s.piece_offset = b - lo;
    s.piece_numel = e - b;
    s.piece = at::empty({0}, shard_.options())
                  .set_(shard_.storage(), shard_.storage_offset() + s.piece_offset, {s.piece_numel}, {1});
    s.piece.set_requires_grad(requires_grad_);
  }
  for (auto& s : slots_) s.requires_grad_seen = s.param.requires_grad();
  gathered_version_ = shard_version();
  FlatGradLayout layout;
  layout.numel = numel_;
  layout.padded_numel = padded_numel_;
  layout.shard_numel = shard_numel_;
  layout.dtype = floating && mp.keep_low_precision_grads() ? reduce_dtype_ : dtype_;
  layout.reduce_dtype = reduce_dtype_;
  layout.unsharded_options = full_.options();
  layout.separate_shard = separate_shard_;
  layout.world_size = group_.world_size;
  layout.deterministic = group_.deterministic;
  grad_ = std::make_unique<FlatGrad>(slots_, layout, memory_, buffers_, offload_);
}

FlatParam::~FlatParam() {
  // A gather nobody waited for (e.g. a prefetch the computation never reached) still writes into
  // memory the parameters keep alive.
  if (!gather_work_) return;
  try {
    gather_work_->wait();
  } catch (const std::exception&) {
    // The communicator failed; the error was, or will be, reported where the step waits.
  }
}

int64_t FlatParam::shard_version() const {
  int64_t v = shard_._version() + shard_writes_.load(std::memory_order_relaxed);
  for (const auto& s : slots_)
    if (s.piece.defined()) v += s.piece._version();
  return v;
}

int64_t FlatParam::optimizer_writes() const {
  int64_t v = shard_writes_.load(std::memory_order_relaxed);
  for (const auto& s : slots_)
    if (s.piece.defined()) v += s.piece._version();
  return v;
}

bool FlatParam::unsharded_is_stale() const {
  return separate_shard_ && unsharded_ && shard_version() != gathered_version_;
}

at::Tensor FlatParam::unsharded_alias() const { return alias(full_.storage(), 0, {padded_numel_}, full_); }

void FlatParam::alloc_unsharded() {
  if (!unsharded_) {
    // Same StorageImpl (the parameters' views and autograd's saved views point at it), new memory.
    const size_t bytes = static_cast<size_t>(padded_numel_ * compute_element_size_);
    storage_->set_data_ptr_noswap(buffers_->allocate(bytes, full_.device()));
    storage_->set_nbytes(bytes);
    memory_->add_param(padded_numel_ * compute_element_size_);
    unsharded_ = true;
  }
  gathered_version_ = shard_version();
}

void FlatParam::set_pending_gather(WorkPtr work, at::Tensor input, bool over_post_forward_group) {
  gather_work_ = std::move(work);
  gather_input_ = std::move(input);
  gathering_post_forward_ = over_post_forward_group;
}

void FlatParam::wait_unshard() {
  if (!gather_work_) return;
  WorkPtr work = std::move(gather_work_);
  gather_work_ = nullptr;
  work->wait();
  if (gather_input_.defined()) {
    memory_->add_param(-gather_input_.numel() * compute_element_size_);
    gather_input_ = at::Tensor();
  }
}

void FlatParam::reshard() {
  if (!separate_shard_ || !unsharded_) return;
  wait_unshard();  // never free memory a communicator is writing into
  storage_->set_data_ptr_noswap(at::DataPtr(nullptr, full_.device()));  // back to the pool
  storage_->set_nbytes(0);
  memory_->add_param(-padded_numel_ * compute_element_size_);
  unsharded_ = false;
}

void FlatParam::reshard_to_post_forward_shard() {
  if (group_.post_forward_comm && separate_shard_ && unsharded_) {
    wait_unshard();
    drop_post_forward_shard();
    if (shard_version() == gathered_version_) {  // the unsharded values are the shard's current ones
      InternalOpGuard internal;
      at::NoGradGuard no_grad;
      const int64_t n = padded_numel_ / group_.post_forward_comm->size();
      post_forward_shard_ = buffers_->empty(n, full_.options());
      post_forward_shard_.copy_(full_.narrow(0, int64_t(group_.post_forward_comm->rank()) * n, n));
      memory_->add_param(n * compute_element_size_);
      post_forward_version_ = gathered_version_;
    }
  }
  reshard();
}

at::Tensor FlatParam::take_post_forward_shard() {
  if (!post_forward_shard_.defined()) return at::Tensor();
  if (post_forward_version_ != gathered_version_) {
    drop_post_forward_shard();  // the shard changed since forward (an optimizer step, a load)
    return at::Tensor();
  }
  at::Tensor kept = std::move(post_forward_shard_);
  post_forward_shard_ = at::Tensor();
  return kept;
}

void FlatParam::drop_post_forward_shard() {
  if (!post_forward_shard_.defined()) return;
  memory_->add_param(-post_forward_shard_.numel() * compute_element_size_);
  post_forward_shard_ = at::Tensor();
}

std::string FlatParam::gather_track() const {
  if (gathering_post_forward_) return group_.post_forward_comm->name();
  return group_.shard_comm ? group_.shard_comm->name() : std::string("none");
}

std::string FlatParam::reduce_track() const {
  return group_.shard_comm ? group_.shard_comm->name() : group_.world_comm->name();
}

void FlatParam::copy_full_into_shard(const at::Tensor& full) {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  FSDP_CHECK(full.numel() == padded_numel_, "internal: full flat size mismatch");
  shard_.copy_(full.narrow(0, int64_t(shard_rank_) * shard_numel_, shard_numel_));
}

void FlatParam::scale_shard_range(int64_t begin, int64_t end, double scale) {
  const int64_t lo = int64_t(shard_rank_) * shard_numel_;
  const int64_t b = std::max(begin, lo), e = std::min(end, lo + shard_numel_);
  if (b >= e) return;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  const bool current = shard_version() == gathered_version_;
  shard_.narrow(0, b - lo, e - b).mul_(scale);
  if (current) gathered_version_ = shard_version();
}

}  // namespace fsdp
