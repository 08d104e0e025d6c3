// FlatGrad's deterministic mode: each backward's buffer folded into exact sums, and their
// reduction turned into the pieces' mean gradients. See Note [Deterministic training] in
// docs/design.md.
#include "exact_wire.h"
#include "flat_grad.h"
#include "fsdp/check.h"
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
  const exact::Wire wire = exact::wire_for(layout_.world_size);
  // Two limbs per element on the wire where the world allows it, packed over the sums' storage.
  return wire.limbs == exact::kLimbs ? exact_sent_ : exact::to_wire(exact_sent_, wire);
}

bool FlatGrad::complete_exact_reduction(bool defer_landing) {
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  memory_->add_grad(-buffer_.nbytes());
  buffer_ = at::Tensor();
  // The reduction's input; its storage takes the sums' limbs for the conversion below.
  const at::Tensor sent = std::move(exact_sent_);
  exact_sent_ = at::Tensor();
  const bool in_place = output_.data_ptr() == sent.data_ptr();  // F == 1: reduced where it was sent
  at::Tensor sums = output_.view({-1});
  output_ = at::Tensor();
  const exact::Wire wire = exact::wire_for(layout_.world_size);
  const int64_t S = layout_.shard_numel, X = wire.limbs * S;
  std::vector<uint8_t> got(slots_.size(), 0);
  for (size_t i = 0; i < slots_.size(); ++i) got[i] = slots_[i].got_grad || folded_[i];
  folded_.assign(slots_.size(), 0);
  if (defer_replicas_) {
    FSDP_CHECK(!in_place, "internal: a hybrid reduction's sums are in its input");
    memory_->add_grad(-sent.nbytes());
    // Kept for the reduction across replicas (its memory stays counted); integer sums add exactly.
    partial_slots_.resize(slots_.size(), 0);
    for (size_t i = 0; i < slots_.size(); ++i) partial_slots_[i] |= got[i];
    if (partial_.defined()) {
      partial_.add_(sums);
      if (wire.limbs != exact::kLimbs) exact::renormalize(partial_, S, wire);  // one part again
      memory_->add_grad(-sums.nbytes());
    } else {
      partial_ = sums;
    }
    defer_replicas_ = false;
    return false;
  }
  for (size_t i = 0; i < partial_slots_.size(); ++i) got[i] = got[i] || partial_slots_[i];
  partial_slots_.clear();
  const double count = static_cast<double>(sums[X].item<int64_t>());
  FSDP_CHECK(count > 0, "deterministic training: every backward since the last reduction was left out "
                        "(set_backward_counted(false) on every rank), so there is no gradient to average; count "
                        "at least one backward of the step (a padding pass alone is not a step)");
  at::Tensor limbs = sums.narrow(0, 0, X);
  if (wire.limbs != exact::kLimbs) {
    limbs = sent.view({-1}).narrow(0, 0, exact::kLimbs * S);
    exact::from_wire(sums, S, limbs, wire);
  }
  limbs = limbs.view({exact::kLimbs, S});
  at::Tensor parts[exact::kLimbs];
  for (int j = 0; j < exact::kLimbs; ++j) parts[j] = limbs.select(0, j);
  at::Tensor values = exact::to_double(parts, exact::kGradScaleExp, count).to(layout_.dtype);
  memory_->add_grad(-(in_place ? sent.nbytes() : sent.nbytes() + sums.nbytes()));
  return land_reduced(std::move(values), std::move(got), 1.0, defer_landing);
}

}  // namespace fsdp
