#include "flat_grad.h"

#include <algorithm>
#include <array>
#include <memory>

#include "exact_wire.h"
#include "fsdp/check.h"
#include "internal_op_guard.h"
#include "tensor_alias.h"

namespace fsdp {

FlatGrad::FlatGrad(std::vector<ParamSlot>& slots, const FlatGradLayout& layout, MemoryTracker* memory,
                   BufferPool* buffers, CpuOffloader* offload)
    : slots_(slots),
      layout_(layout),
      memory_(memory),
      buffers_(buffers),
      offload_(offload),
      like_(at::empty({0}, layout.unsharded_options)),
      sentinels_(make_sentinels()) {}

FlatGrad::~FlatGrad() {
  // A reduction of an interrupted backward still reads memory that this object keeps alive.
  if (!work_) return;
  try {
    work_->wait();
  } catch (const std::exception&) {
    // The communicator failed; the error was, or will be, reported where the step waits.
  }
}

bool FlatGrad::is_grad_alias(const ParamSlot& s, const at::Tensor& g, const at::Tensor& store) const {
  return store.defined() && g.defined() &&
         g.storage().unsafeGetStorageImpl() == store.storage().unsafeGetStorageImpl() &&
         g.storage_offset() == s.piece_offset && g.dim() == 1 && g.numel() == s.piece_numel && g.is_contiguous();
}

at::Tensor FlatGrad::grad_alias(const ParamSlot& s, const at::Tensor& store) const {
  // set_, not narrow: not an autograd view, so optimizers' zero_grad() may detach_() it.
  return alias(store.storage(), s.piece_offset, {s.piece_numel}, store);
}

bool FlatGrad::ensure_buffer() {
  if (buffer_.defined()) return false;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  written_.assign(slots_.size(), 0);
  kept_.assign(slots_.size(), 0);
  folded_.assign(slots_.size(), 0);
  const int64_t n = layout_.padded_numel;
  if (layout_.separate_shard) {
    // Uninitialized: take() writes every region a gradient reaches, begin_reduction() the rest.
    buffer_ = buffers_->empty(n, layout_.unsharded_options.dtype(layout_.reduce_dtype));
    memory_->add_grad(n * buffer_.element_size());
    return false;
  }
  auto store = store_.lock();
  const bool fresh = !store;
  if (fresh) {
    buffer_ = buffers_->empty(n, layout_.unsharded_options);
    store_ = buffer_.storage().getWeakStorageImpl();
  } else {
    buffer_ = alias(c10::Storage(std::move(store)), 0, {n}, like_);
  }
  // A piece gradient that aliases the store keeps its values (accumulation; after LibTorch 1.13's
  // zero_grad(), which zeroes in place, they are zeros, and adding to them costs what a copy
  // would). One the user replaced by their own tensor is copied in and aliased again.
  for (size_t i = 0; i < slots_.size(); ++i) {
    ParamSlot& s = slots_[i];
    if (!s.piece.defined()) continue;
    at::Tensor& g = s.piece.mutable_grad();
    if (!g.defined()) continue;
    if (!is_grad_alias(s, g, buffer_)) {
      buffer_.narrow(0, s.piece_offset, s.piece_numel).copy_(g);
      g = grad_alias(s, buffer_);
    }
    kept_[i] = 1;
  }
  return fresh;
}

std::vector<at::Tensor> FlatGrad::make_sentinels() const {
  // All strides 0 over one zero element; not views (zero_grad() detach_()es them). On the CPU the
  // element lives outside LibTorch's allocator, so model-state accounting does not see it.
  std::vector<at::Tensor> out;
  if (slots_.empty()) return out;
  const auto options = layout_.unsharded_options.dtype(slots_.front().param.scalar_type());
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

void FlatGrad::take(int slot) {
  ParamSlot& s = slots_[slot];
  at::Tensor& g = s.param.mutable_grad();
  if (!g.defined() || is_sentinel(slot, g)) return;
  FSDP_CHECK(buffer_.defined(), "internal: gradient of '", s.name, "' arrived without a gradient buffer");
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  at::Tensor part = region(buffer_, s.offset, s.shape);
  if (written_[slot] || kept_[slot]) {
    part.add_(g);
  } else if (g.is_sparse()) {  // e.g. Embedding(sparse): copy_ takes no sparse source
    part.zero_();
    part.add_(g);
  } else {
    part.copy_(g);
  }
  written_[slot] = 1;
  g = sentinels_[slot];
}

bool FlatGrad::is_sentinel(int slot, const at::Tensor& g) const {
  // Module::zero_grad() replaces it by a detached copy: the same storage.
  return g.has_storage() && g.storage().unsafeGetStorageImpl() == sentinels_[slot].storage().unsafeGetStorageImpl();
}

void FlatGrad::keep_unreduced() {
  if (!buffer_.defined()) return;
  if (layout_.deterministic) {
    fold();
    return;
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    kept_[i] = kept_[i] || written_[i];
    written_[i] = 0;
  }
}

std::vector<uint8_t> FlatGrad::held_slots() const {
  std::vector<uint8_t> held(slots_.size(), 0);
  const bool kept = buffer_.defined() && !reduce_started_, folded = exact_.defined() && !exact_blank_;
  for (size_t i = 0; i < slots_.size(); ++i)
    held[i] = (kept && i < kept_.size() && kept_[i]) || (folded && i < folded_.size() && folded_[i]) ||
              (partial_.defined() && i < partial_slots_.size() && partial_slots_[i]);
  return held;
}

void FlatGrad::mark_held_pieces() {
  const std::vector<uint8_t> held = held_slots();
  const bool in_store = holds_in_store() && buffer_.defined();
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < slots_.size(); ++i) {
    ParamSlot& s = slots_[i];
    if (held[i] && s.piece.defined() && s.piece.requires_grad() && !s.piece.grad().defined())
      s.piece.mutable_grad() = in_store ? grad_alias(s, buffer_) : at::zeros_like(s.piece);
  }
}

void FlatGrad::resync_store() {
  if (!holds_in_store() || !buffer_.defined() || reduce_started_) return;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < slots_.size(); ++i) {
    ParamSlot& s = slots_[i];
    if (!kept_[i] || !s.piece.defined()) continue;
    at::Tensor& g = s.piece.mutable_grad();
    at::Tensor region = buffer_.narrow(0, s.piece_offset, s.piece_numel);
    if (!g.defined()) {
      region.zero_();
    } else if (!is_grad_alias(s, g, buffer_)) {
      region.copy_(g);
      g = grad_alias(s, buffer_);
    }
  }
}

void FlatGrad::drop_held() {
  if (!holds_in_store()) abandon_unreduced();
}

void FlatGrad::discard_landing() {
  if (landing_.copy) landing_.copy->wait();
  if (landing_.alias_store && landing_.values.defined()) {
    // NO_SHARD reduced in place, in the store the pieces' .grad may still alias: its sums go too.
    InternalOpGuard internal;
    at::NoGradGuard no_grad;
    landing_.values.zero_();
  }
  landing_ = Landing();
  release_device_grad();
}

void FlatGrad::abandon_unreduced() {
  if (reduce_started_) return;
  if (buffer_.defined() && layout_.separate_shard) memory_->add_grad(-buffer_.nbytes());
  buffer_ = at::Tensor();
  std::fill(kept_.begin(), kept_.end(), 0);
  std::fill(written_.begin(), written_.end(), 0);
  std::fill(folded_.begin(), folded_.end(), 0);
  exact_blank_ = exact_.defined();
  if (partial_.defined()) memory_->add_grad(-partial_.nbytes());
  partial_ = at::Tensor();
  partial_slots_.clear();
}

void FlatGrad::begin_reduction() {
  FSDP_CHECK(buffer_.defined() && !reduce_started_, "internal: a reduction without a gradient buffer");
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].param.grad().defined()) take(static_cast<int>(i));  // not through the post-hook (defensive)
  zero_unwritten();                                                   // they enter the reduction as zeros
  reduce_started_ = true;
  across_replicas_ = defer_replicas_ = false;
}

void FlatGrad::zero_unwritten() {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const ParamSlot& s = slots_[i];
    if (!written_[i] && !kept_[i]) region(buffer_, s.offset, {s.numel}).zero_();
  }
  if (layout_.padded_numel > layout_.numel)
    region(buffer_, layout_.numel, {layout_.padded_numel - layout_.numel}).zero_();
}

at::Tensor FlatGrad::new_reduction_output() {
  at::Tensor out = layout_.deterministic
                       ? buffers_->empty(exact::wire_for(layout_.world_size).limbs * layout_.shard_numel + 1,
                                         buffer_.options().dtype(at::kLong))
                       : buffers_->empty(layout_.shard_numel, buffer_.options());
  memory_->add_grad(out.nbytes());
  return out;
}

void FlatGrad::set_reduction(at::Tensor output, WorkPtr work, bool defer_replicas, bool across_replicas) {
  output_ = std::move(output);
  work_ = std::move(work);
  defer_replicas_ = defer_replicas;
  across_replicas_ = across_replicas;
}

WorkPtr FlatGrad::take_reduce_work() {
  WorkPtr work = std::move(work_);
  work_ = nullptr;
  return work;
}

void FlatGrad::add_partial_into(at::Tensor& sums) {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  sums.add_(partial_);
  if (layout_.deterministic) {  // one part again, so the replicas' all-reduce adds one per rank
    const exact::Wire wire = exact::wire_for(layout_.world_size);
    if (wire.limbs != exact::kLimbs) exact::renormalize(sums, layout_.shard_numel, wire);
  }
  memory_->add_grad(-partial_.nbytes());
  partial_ = at::Tensor();
}

bool FlatGrad::complete_reduction(bool defer_landing) {
  if (!reduce_started_) return false;
  FSDP_CHECK(!work_, "internal: a reduction completed before its collective was waited for");
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  reduce_started_ = false;
  if (layout_.deterministic) return complete_exact_reduction(defer_landing);
  if (!layout_.separate_shard) {
    const double scale = 1.0 / layout_.world_size;
    // The sum is in the store: average in place (a kept gradient, the same on every rank, comes
    // back as world * g / world), then give the pieces that got a gradient their alias.
    if (layout_.world_size > 1) buffer_.mul_(scale);
    Landing landing;
    landing.values = std::move(buffer_);  // the pieces' gradients keep the store alive
    landing.alias_store = true;
    landing.slots.assign(slots_.size(), 0);
    for (size_t i = 0; i < slots_.size(); ++i)  // unused: no gradient, as in local training
      landing.slots[i] = slots_[i].got_grad || kept_[i];
    buffer_ = at::Tensor();
    output_ = at::Tensor();
    landing_ = std::move(landing);
    return defer_landing ? false : land();
  }
  const bool reduced_in_place = output_.is_same(buffer_);
  memory_->add_grad(-buffer_.nbytes());
  buffer_ = at::Tensor();
  if (defer_replicas_) {
    // Kept, in the reduce dtype, for the reduction across replicas (its memory stays counted).
    partial_slots_.resize(slots_.size(), 0);
    for (size_t i = 0; i < slots_.size(); ++i) partial_slots_[i] |= slots_[i].got_grad || kept_[i];
    if (partial_.defined()) {
      partial_.add_(output_);
      memory_->add_grad(-output_.nbytes());
    } else {
      partial_ = output_;
    }
    output_ = at::Tensor();
    defer_replicas_ = false;
    return false;
  }
  // Slots that got a gradient; unused ones get none, as in local training.
  std::vector<uint8_t> got(slots_.size(), 0);
  for (size_t i = 0; i < slots_.size(); ++i)
    got[i] = slots_[i].got_grad || kept_[i] || (i < partial_slots_.size() && partial_slots_[i]);
  partial_slots_.clear();
  if (!reduced_in_place) memory_->add_grad(-output_.nbytes());
  at::Tensor values = std::move(output_);
  output_ = at::Tensor();
  return land_reduced(std::move(values), std::move(got), 1.0 / layout_.world_size, defer_landing);
}

bool FlatGrad::land_reduced(at::Tensor values, std::vector<uint8_t> got, double scale, bool defer_landing) {
  if (offload_) {
    // Copied to the host while backward goes on; land() averages it into the pieces.
    land();  // an earlier reduction of this backward (a unit run twice)
    Landing landing;
    landing.values = offload_->host_empty(layout_.shard_numel, values.scalar_type());
    landing.copy = offload_->to_host(landing.values, values);
    landing.slots = std::move(got);
    landing.in_place = true;  // a host copy of its own
    landing.scale = scale;
    device_grad_copy_ = landing.copy;
    landing_ = std::move(landing);
    return false;
  }
  Landing landing;
  landing.values = std::move(values);
  landing.slots = std::move(got);
  landing.scale = scale;
  landing_ = std::move(landing);
  return defer_landing ? false : land();
}

void FlatGrad::add_into_piece_grads(const at::Tensor& reduced, const std::vector<uint8_t>& slots, bool in_place,
                                    double scale) {
  // Averaging is fused into the one pass that moves the sum into the pieces' gradients (cast to
  // the shard's dtype under mixed precision).
  const at::ScalarType dtype = layout_.dtype;
  for (size_t i = 0; i < slots_.size(); ++i) {
    ParamSlot& s = slots_[i];
    if (!s.piece.defined() || !slots[i]) continue;
    at::Tensor part = region(reduced, s.piece_offset, {s.piece_numel});
    at::Tensor& g = s.piece.mutable_grad();
    // Each piece owns its gradient (not a view): optimizers' zero_grad() detaches it in place.
    if (g.defined()) {
      g.add_(part.to(dtype), scale);  // accumulate, as AccumulateGrad does when .grad was not cleared
    } else if (in_place && part.scalar_type() == dtype) {
      if (scale != 1.0) part.mul_(scale);
      g = part;  // an alias of `reduced`, not an autograd view
    } else if (part.scalar_type() == dtype && scale != 1.0) {
      g = part.mul(scale);
    } else {
      g = part.to(dtype, /*non_blocking=*/false, /*copy=*/true).mul_(scale);
    }
  }
}

void FlatGrad::release_device_grad() {
  if (device_grad_copy_) offload_->release_source(device_grad_copy_);
  device_grad_copy_ = nullptr;
}

bool FlatGrad::land() {
  if (!landing_.values.defined()) return false;
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  Landing landing = std::move(landing_);
  landing_ = Landing();
  if (landing.copy) landing.copy->wait();
  mark_used_elsewhere(landing.values, landing.slots);
  if (landing.alias_store) {
    for (size_t i = 0; i < slots_.size(); ++i) {
      ParamSlot& s = slots_[i];
      if (!s.piece.defined() || !landing.slots[i]) continue;
      at::Tensor& g = s.piece.mutable_grad();
      if (!is_grad_alias(s, g, landing.values)) g = grad_alias(s, landing.values);
    }
  } else {
    add_into_piece_grads(landing.values, landing.slots, landing.in_place, landing.scale);
  }
  return true;
}

void FlatGrad::mark_used_elsewhere(const at::Tensor& values, std::vector<uint8_t>& slots) const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    const ParamSlot& s = slots_[i];
    if (slots[i] || !s.piece.defined() || s.piece_numel == 0) continue;
    slots[i] = region(values, s.piece_offset, {s.piece_numel}).ne(0).any().item<bool>() ? 1 : 0;
  }
}

int64_t FlatGrad::sharded_bytes() const {
  if (offload_) return 0;         // host memory, outside the device figures
  if (!layout_.separate_shard) {  // the store, while any piece's gradient (or a backward) holds it
    const auto store = store_.lock();
    return store ? layout_.padded_numel * c10::elementSize(layout_.dtype) : 0;
  }
  int64_t bytes = 0;
  for (const auto& s : slots_)
    if (s.piece.defined() && s.piece.grad().defined()) bytes += s.piece.grad().nbytes();
  return bytes;
}

}  // namespace fsdp
