// FlatGrad's deterministic mode: each backward's buffer folded into exact sums, and their
// reduction turned into the pieces' mean gradients. See Note [Deterministic training] in
// docs/design.md.
#include "exact_sum.h"
#include "flat_grad.h"
#include "internal_op_guard.h"
#include "tensor_alias.h"

namespace fsdp {

void FlatGrad::fold() {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  const int64_t S = layout_.shard_numel, F = layout_.padded_numel / S, X = exact::kLimbs * S;
  if (!exact_.defined()) {  // uninitialized: the first counted deposit writes every limb
    exact_ = buffers_->empty(F * (X + 1), buffer_.options().dtype(at::kLong)).view({F, X + 1});
    exact_blank_ = true;
    memory_->add_grad(exact_.nbytes());
  }
  // Limb j of shard r's elements at [r, j * S, (j + 1) * S): each shard's part is contiguous.
  const at::Tensor limbs = exact_.narrow(1, 0, X).view({F, exact::kLimbs, S});
  at::Tensor parts[exact::kLimbs];
  for (int j = 0; j < exact::kLimbs; ++j) parts[j] = limbs.select(1, j);
  if (counted_) {  // an uncounted backward's gradients are dropped: the sums stay exact without them
    zero_unwritten();
    exact::deposit(buffer_.view({F, S}), parts, exact::kGradScaleExp, exact_blank_);
    exact_blank_ = false;
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    folded_[i] = folded_[i] || (counted_ && (written_[i] || kept_[i]));
    written_[i] = kept_[i] = 0;
  }
}

at::Tensor FlatGrad::take_exact() {
  fold();
  if (exact_blank_) exact_.zero_();  // no counted backward since the last reduction
  exact_blank_ = false;
  // Every shard's part carries this rank's count, so each reduced part holds the total.
  exact_.select(1, exact_.size(1) - 1).fill_(backward_count_);
  exact_sent_ = std::move(exact_);
  exact_ = at::Tensor();
  return exact_sent_;
}

bool FlatGrad::complete_exact_reduction(bool defer_landing) {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  memory_->add_grad(-buffer_.nbytes());
  buffer_ = at::Tensor();
  if (!output_.is_same(exact_sent_)) memory_->add_grad(-exact_sent_.nbytes());
  exact_sent_ = at::Tensor();
  at::Tensor sums = output_.view({-1});
  output_ = at::Tensor();
  std::vector<uint8_t> got(slots_.size(), 0);
  for (size_t i = 0; i < slots_.size(); ++i) got[i] = slots_[i].got_grad || folded_[i];
  folded_.assign(slots_.size(), 0);
  if (defer_replicas_) {
    // Kept for the reduction across replicas (its memory stays counted); integer sums add exactly.
    partial_slots_.resize(slots_.size(), 0);
    for (size_t i = 0; i < slots_.size(); ++i) partial_slots_[i] |= got[i];
    if (partial_.defined()) {
      partial_.add_(sums);
      memory_->add_grad(-sums.nbytes());
    } else {
      partial_ = sums;
    }
    defer_replicas_ = false;
    return false;
  }
  for (size_t i = 0; i < partial_slots_.size(); ++i) got[i] = got[i] || partial_slots_[i];
  partial_slots_.clear();
  memory_->add_grad(-sums.nbytes());
  const int64_t S = layout_.shard_numel;
  const double count = static_cast<double>(sums[exact::kLimbs * S].item<int64_t>());
  const at::Tensor limbs = sums.narrow(0, 0, exact::kLimbs * S).view({exact::kLimbs, S});
  at::Tensor parts[exact::kLimbs];
  for (int j = 0; j < exact::kLimbs; ++j) parts[j] = limbs.select(0, j);
  at::Tensor values = exact::to_double(parts, exact::kGradScaleExp, count).to(layout_.dtype);
  return land_reduced(std::move(values), std::move(got), 1.0, defer_landing);
}

}  // namespace fsdp
