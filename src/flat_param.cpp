#include "flat_param.h"

#include <array>

#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

namespace {

// A contiguous tensor of `shape` over `storage` from element `offset`, with like's dtype and
// dispatch keys: what narrow/view or set_ give, built without a dispatcher call (these run per
// parameter per iteration; see Note [Per-unit overhead]). Not an autograd view.
at::Tensor alias(const c10::Storage& storage, int64_t offset, at::IntArrayRef shape, const at::Tensor& like) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), like.key_set(), like.dtype());
  impl->set_storage_offset(offset);
  impl->set_sizes_contiguous(shape);
  return at::Tensor(std::move(impl));
}

// The elements [offset, offset + numel) of the 1-D contiguous `flat`, shaped `shape`.
at::Tensor region(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape) {
  return alias(flat.storage(), flat.storage_offset() + offset, shape, flat);
}

}  // namespace

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
  separate_shard_ = offload_ || !group_.keep_unsharded || compute_dtype_ != dtype_ || reduce_dtype_ != dtype_;
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
  gathered_version_ = shard_version();
}

CollectiveOptions FlatParam::label(const char* purpose, int64_t& count) const {
  CollectiveOptions o;
  o.label = detail::compose("unit ", unit_, " flat parameter ", id_, ": ", purpose, " #", count++);
  return o;
}

CollectiveOptions FlatParam::reduction_label(const char* purpose, int64_t& count) const {
  CollectiveOptions o = label(purpose, count);
  if (backwards_held_ > 0)
    o.label = detail::compose(o.label, " (gradients of ", backwards_held_, " earlier backward",
                              backwards_held_ > 1 ? "s" : "", " held)");
  return o;
}

int64_t FlatParam::shard_version() const {
  int64_t v = shard_._version();
  for (const auto& s : slots_)
    if (s.piece.defined()) v += s.piece._version();
  return v;
}

bool FlatParam::unsharded_is_stale() const {
  return separate_shard_ && unsharded_ && shard_version() != gathered_version_;
}

WorkPtr FlatParam::start_unshard() {
  if (!separate_shard_) return nullptr;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  if (gather_work_) wait_unshard();  // a gather of older shard values: let it land first
  if (!unsharded_) {
    // Same StorageImpl (the parameters' views and autograd's saved views point at it), new memory.
    const size_t bytes = static_cast<size_t>(padded_numel_ * compute_element_size_);
    storage_->set_data_ptr_noswap(buffers_->allocate(bytes, full_.device()));
    storage_->set_nbytes(bytes);
    memory_->add_param(padded_numel_ * compute_element_size_);
    unsharded_ = true;
  }
  gathered_version_ = shard_version();
  if (!sharded_over_peers() && offload_) {
    // F == 1 offloaded: the "gather" is the shard's copy to the device (cast on the way).
    gather_work_ = offload_->to_device(alias(full_.storage(), 0, {padded_numel_}, full_), shard_);
    return gather_work_;
  }
  if (!sharded_over_peers()) {
    // F == 1 under mixed precision: the "gather" is a cast of the whole shard. Written through a
    // tensor of its own, so no version counter that autograd checks moves.
    alias(full_.storage(), 0, {padded_numel_}, full_).copy_(shard_);
    return nullptr;
  }
  gathering_post_forward_ = false;
  if (post_forward_shard_.defined()) {
    if (post_forward_version_ == gathered_version_) {
      // hpZ: the parts kept after forward, gathered within their group; freed when the gather lands.
      gather_input_ = std::move(post_forward_shard_);
      post_forward_shard_ = at::Tensor();
      gathering_post_forward_ = true;
      gather_work_ =
          group_.post_forward_comm->all_gather_into(full_, gather_input_, label("parameter all-gather", gathers_));
      return gather_work_;
    }
    drop_post_forward_shard();  // the shard changed since forward (an optimizer step, a load)
  }
  at::Tensor input = shard_;
  if (offload_) {
    // The host shard to the device (cast there) on the copy stream; the gather, issued from that
    // stream, follows it, so compute goes on meanwhile.
    input = buffers_->empty(shard_numel_, full_.options());
    offload_->to_device(input, shard_);
    memory_->add_param(shard_numel_ * compute_element_size_);
    gather_input_ = input;
    offload_->on_copy_stream([&] {
      gather_work_ = group_.shard_comm->all_gather_into(full_, input, label("parameter all-gather", gathers_));
    });
    return gather_work_;
  }
  if (compute_dtype_ != dtype_) {
    // Cast before the gather, so the gather moves compute-dtype bytes.
    input = buffers_->empty(shard_numel_, full_.options());
    input.copy_(shard_);
    memory_->add_param(shard_numel_ * compute_element_size_);
    gather_input_ = input;
  }
  // Gloo writes through the raw pointer: no tensor op, so the parameters' version counters (which
  // autograd checks for saved tensors) do not move.
  gather_work_ = group_.shard_comm->all_gather_into(full_, input, label("parameter all-gather", gathers_));
  return gather_work_;
}

FlatParam::~FlatParam() {
  // A gather nobody waited for (e.g. a prefetch the computation never reached) or a reduction of
  // an interrupted backward still writes into, or reads, memory the parameters keep alive.
  for (WorkPtr* work : {&gather_work_, &pending_work_}) {
    if (!*work) continue;
    try {
      (*work)->wait();
    } catch (const std::exception&) {
      // The communicator failed; the error was, or will be, reported where the step waits.
    }
  }
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

bool FlatParam::is_grad_alias(const ParamSlot& s, const at::Tensor& g, const at::Tensor& store) const {
  return store.defined() && g.defined() &&
         g.storage().unsafeGetStorageImpl() == store.storage().unsafeGetStorageImpl() &&
         g.storage_offset() == s.piece_offset && g.dim() == 1 && g.numel() == s.piece_numel && g.is_contiguous();
}

at::Tensor FlatParam::grad_alias(const ParamSlot& s, const at::Tensor& store) const {
  // set_, not narrow: not an autograd view, so optimizers' zero_grad() may detach_() it.
  return alias(store.storage(), s.piece_offset, {s.piece_numel}, store);
}

bool FlatParam::ensure_grad_buffer() {
  if (full_grad_.defined()) return false;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  written_.assign(slots_.size(), 0);
  kept_.assign(slots_.size(), 0);
  if (separate_shard_) {
    // Uninitialized: take_grad() writes every region a gradient reaches, start_reduce() the rest.
    full_grad_ = buffers_->empty(padded_numel_, full_.options().dtype(reduce_dtype_));
    memory_->add_grad(padded_numel_ * full_grad_.element_size());
    return false;
  }
  auto store = grad_store_.lock();
  const bool fresh = !store;
  if (fresh) {
    full_grad_ = buffers_->empty(padded_numel_, full_.options());
    grad_store_ = full_grad_.storage().getWeakStorageImpl();
  } else {
    full_grad_ = alias(c10::Storage(std::move(store)), 0, {padded_numel_}, full_);
  }
  // A piece gradient that aliases the store keeps its values (accumulation; after LibTorch 1.13's
  // zero_grad(), which zeroes in place, they are zeros, and adding to them costs what a copy
  // would). One the user replaced by their own tensor is copied in and aliased again.
  for (size_t i = 0; i < slots_.size(); ++i) {
    ParamSlot& s = slots_[i];
    if (!s.piece.defined()) continue;
    at::Tensor& g = s.piece.mutable_grad();
    if (!g.defined()) continue;
    if (!is_grad_alias(s, g, full_grad_)) {
      full_grad_.narrow(0, s.piece_offset, s.piece_numel).copy_(g);
      g = grad_alias(s, full_grad_);
    }
    kept_[i] = 1;
  }
  return fresh;
}

std::vector<at::Tensor> FlatParam::make_grad_sentinels() const {
  // All strides 0 over one zero element; not views (zero_grad() detach_()es them). On the CPU the
  // element lives outside LibTorch's allocator, so model-state accounting does not see it.
  const auto options = full_.options().dtype(slots_.front().param.scalar_type());
  std::vector<at::Tensor> out;
  auto zero = std::make_shared<std::array<uint64_t, 2>>();  // zero bits: 0 in every floating dtype
  for (const auto& t : slots_) {
    const std::vector<int64_t> strides(t.shape.size(), 0);
    if (options.device().is_cpu())
      out.push_back(at::from_blob(
          zero->data(), t.shape, strides, [zero](void*) {}, options));
    else
      out.push_back(at::empty_strided(t.shape, strides, options).zero_());
  }
  return out;
}

void FlatParam::take_grad(int slot) {
  ParamSlot& s = slots_[slot];
  at::Tensor& g = s.param.mutable_grad();
  if (!g.defined()) return;
  if (!grad_sentinels_.empty() && g.is_same(grad_sentinels_[slot])) return;
  FSDP_CHECK(full_grad_.defined(), "internal: gradient of '", s.name, "' arrived without a gradient buffer");
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  at::Tensor region = fsdp::region(full_grad_, s.offset, s.shape);
  if (written_[slot] || kept_[slot]) {
    region.add_(g);
  } else if (g.is_sparse()) {  // e.g. Embedding(sparse): copy_ takes no sparse source
    region.zero_();
    region.add_(g);
  } else {
    region.copy_(g);
  }
  written_[slot] = 1;
  g.reset();
  if (separate_shard_) {
    if (grad_sentinels_.empty()) grad_sentinels_ = make_grad_sentinels();
    g = grad_sentinels_[slot];
  }
}

void FlatParam::start_reduce(bool across_replicas) {
  FSDP_CHECK(full_grad_.defined() && !reduce_started_, "internal: start_reduce without a gradient buffer");
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  // Regions no gradient reached, and the padding, enter the reduction as zeros.
  for (size_t i = 0; i < slots_.size(); ++i) {
    ParamSlot& s = slots_[i];
    if (s.param.grad().defined()) take_grad(static_cast<int>(i));  // not through the post-hook (defensive)
    if (!written_[i] && !kept_[i]) region(full_grad_, s.offset, {s.numel}).zero_();
  }
  if (padded_numel_ > numel_) region(full_grad_, numel_, {padded_numel_ - numel_}).zero_();
  reduce_started_ = true;
  replica_reduce_issued_ = defer_replicas_ = false;
  if (!sharded_over_peers()) {
    // F == 1: the whole buffer is the shard (NO_SHARD, a world of one).
    reduced_ = full_grad_;
    pending_work_ = group_.world_size > 1
                        ? group_.world_comm->all_reduce(full_grad_, reduction_label("gradient all-reduce", reductions_))
                        : nullptr;
  } else {
    reduced_ = buffers_->empty(shard_numel_, full_grad_.options());
    memory_->add_grad(shard_numel_ * reduced_.element_size());
    pending_work_ = group_.shard_comm->reduce_scatter(reduced_, full_grad_,
                                                      reduction_label("gradient reduce-scatter", reductions_));
    const bool replicas = group_.replicate_comm && group_.replicate_comm->size() > 1;
    if (replicas && !across_replicas) {
      defer_replicas_ = true;  // finish_reduce adds the shard group's sum into partial_
    } else if (replicas && partial_.defined()) {
      // The earlier micro-batches' shard-group sums join this one before the replica all-reduce.
      pending_work_->wait();
      reduced_.add_(partial_);
      memory_->add_grad(-partial_.nbytes());
      partial_ = at::Tensor();
      pending_work_ = group_.replicate_comm->all_reduce(
          reduced_, reduction_label("replica gradient all-reduce", replica_reductions_));
      replica_reduce_issued_ = true;
    } else if (replicas) {
      // Hybrid: the shard's sum across replicas, chained after the reduce-scatter on the replica
      // group's thread, so both overlap the rest of backward.
      CollectiveOptions after_scatter = reduction_label("replica gradient all-reduce", replica_reductions_);
      after_scatter.after = pending_work_;
      pending_work_ = group_.replicate_comm->all_reduce(reduced_, after_scatter);
      replica_reduce_issued_ = true;
    }
  }
}

bool FlatParam::finish_reduce(bool defer_landing) {
  if (!reduce_started_) return false;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  WorkPtr work = std::move(pending_work_);
  pending_work_ = nullptr;
  reduce_started_ = false;
  if (work) work->wait();
  if (!separate_shard_) {
    const double scale = 1.0 / group_.world_size;
    // The sum is in the store: average in place (a kept gradient, the same on every rank, comes
    // back as world * g / world), then give the pieces that got a gradient their alias.
    if (group_.world_size > 1) full_grad_.mul_(scale);
    Landing landing;
    landing.values = std::move(full_grad_);  // the pieces' gradients keep the store alive
    landing.alias_store = true;
    landing.slots.assign(slots_.size(), 0);
    for (size_t i = 0; i < slots_.size(); ++i)  // unused: no gradient, as in local training
      landing.slots[i] = slots_[i].got_grad || kept_[i];
    full_grad_ = at::Tensor();
    reduced_ = at::Tensor();
    landing_ = std::move(landing);
    return defer_landing ? false : land_grads();
  }
  const bool reduced_in_place = reduced_.is_same(full_grad_);
  memory_->add_grad(-full_grad_.nbytes());
  full_grad_ = at::Tensor();
  if (defer_replicas_) {
    // Kept, in the reduce dtype, for the reduction across replicas (its memory stays counted).
    partial_slots_.resize(slots_.size(), 0);
    for (size_t i = 0; i < slots_.size(); ++i) partial_slots_[i] |= slots_[i].got_grad || kept_[i];
    if (partial_.defined()) {
      partial_.add_(reduced_);
      memory_->add_grad(-reduced_.nbytes());
    } else {
      partial_ = reduced_;
    }
    reduced_ = at::Tensor();
    defer_replicas_ = false;
    return false;
  }
  // Slots that got a gradient; unused ones get none, as in local training.
  std::vector<uint8_t> got(slots_.size(), 0);
  for (size_t i = 0; i < slots_.size(); ++i)
    got[i] = slots_[i].got_grad || kept_[i] || (i < partial_slots_.size() && partial_slots_[i]);
  partial_slots_.clear();
  if (!reduced_in_place) memory_->add_grad(-reduced_.nbytes());
  if (offload_) {
    // Copied to the host while backward goes on; land_grads() averages it into the pieces.
    land_grads();  // an earlier reduction of this backward (a unit run twice)
    Landing landing;
    landing.values = offload_->host_empty(shard_numel_, reduced_.scalar_type());
    landing.copy = offload_->to_host(landing.values, reduced_);
    landing.slots = std::move(got);
    landing.in_place = true;  // a host copy of its own
    device_grad_copy_ = landing.copy;
    landing_ = std::move(landing);
    reduced_ = at::Tensor();
    return false;
  }
  Landing landing;
  landing.values = std::move(reduced_);
  landing.slots = std::move(got);
  landing_ = std::move(landing);
  reduced_ = at::Tensor();
  return defer_landing ? false : land_grads();
}

void FlatParam::add_into_piece_grads(const at::Tensor& reduced, const std::vector<uint8_t>& slots, bool in_place) {
  // Averaging is fused into the one pass that moves the sum into the pieces' gradients (cast to
  // the shard's dtype under mixed precision).
  const double scale = 1.0 / group_.world_size;
  for (size_t i = 0; i < slots_.size(); ++i) {
    ParamSlot& s = slots_[i];
    if (!s.piece.defined() || !slots[i]) continue;
    at::Tensor part = region(reduced, s.piece_offset, {s.piece_numel});
    at::Tensor& g = s.piece.mutable_grad();
    // Each piece owns its gradient (not a view): optimizers' zero_grad() detaches it in place.
    if (g.defined()) {
      g.add_(part.to(dtype_), scale);  // accumulate, as AccumulateGrad does when .grad was not cleared
    } else if (in_place && part.scalar_type() == dtype_) {
      if (group_.world_size > 1) part.mul_(scale);
      g = part;  // an alias of `reduced`, not an autograd view
    } else if (part.scalar_type() == dtype_ && group_.world_size > 1) {
      g = part.mul(scale);
    } else {
      g = part.to(dtype_, /*non_blocking=*/false, /*copy=*/true).mul_(scale);
    }
  }
}

void FlatParam::release_device_grad() {
  if (device_grad_copy_) offload_->release_source(device_grad_copy_);
  device_grad_copy_ = nullptr;
}

bool FlatParam::land_grads() {
  if (!landing_.values.defined()) return false;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  Landing landing = std::move(landing_);
  landing_ = Landing();
  if (landing.copy) landing.copy->wait();
  if (landing.alias_store) {
    for (size_t i = 0; i < slots_.size(); ++i) {
      ParamSlot& s = slots_[i];
      if (!s.piece.defined() || !landing.slots[i]) continue;
      at::Tensor& g = s.piece.mutable_grad();
      if (!is_grad_alias(s, g, landing.values)) g = grad_alias(s, landing.values);
    }
  } else {
    add_into_piece_grads(landing.values, landing.slots, landing.in_place);
  }
  return true;
}

void FlatParam::keep_grads_unreduced() {
  if (!full_grad_.defined()) return;
  for (size_t i = 0; i < slots_.size(); ++i) {
    kept_[i] = kept_[i] || written_[i];
    written_[i] = 0;
  }
}

int64_t FlatParam::sharded_grad_bytes() const {
  if (offload_) return 0;  // host memory, outside the device figures
  if (!separate_shard_) {  // the store, while any piece's gradient (or a backward) holds it
    const auto store = grad_store_.lock();
    return store ? padded_numel_ * element_size_ : 0;
  }
  int64_t bytes = 0;
  for (const auto& s : slots_)
    if (s.piece.defined() && s.piece.grad().defined()) bytes += s.piece.grad().nbytes();
  return bytes;
}

void FlatParam::copy_full_into_shard(const at::Tensor& full) {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  FSDP_CHECK(full.numel() == padded_numel_, "internal: full flat size mismatch");
  shard_.copy_(full.narrow(0, int64_t(shard_rank_) * shard_numel_, shard_numel_));
}

at::Tensor FlatParam::full_values() const {
  if (!separate_shard_) return full_;
  InternalOpGuard internal;
  // Offloaded: on the device, as without offload (the collectives move device tensors).
  const at::Tensor shard = offload_ ? shard_.to(full_.device()) : shard_;
  if (!sharded_over_peers()) return shard;
  at::Tensor out = at::empty({padded_numel_}, shard.options().requires_grad(false));
  group_.shard_comm->all_gather_into(out, shard, label("full-values all-gather", gathers_))->wait();
  return out;
}

}  // namespace fsdp
