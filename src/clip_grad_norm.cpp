#include "clip_grad_norm.h"

#include <cmath>
#include <limits>

#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

double clip_grad_norm(FsdpState& state, double max_norm, double norm_type) {
  FSDP_CHECK(norm_type > 0 && !std::isnan(norm_type), "clip_grad_norm_: norm_type must be positive or infinity, got ",
             norm_type);
  FSDP_CHECK(max_norm >= 0 && !std::isnan(max_norm), "clip_grad_norm_: max_norm must be 0 or more, got ", max_norm);
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  state.rethrow_pending_error();
  FSDP_CHECK(!state.reducer().stepper().on(),
             "clip_grad_norm_: the module steps its optimizer in backward (set_step_in_backward), so each unit was "
             "stepped before the total norm existed. Clipping needs every gradient first: turn the step in backward "
             "off (set_step_in_backward(nullptr)) and call the optimizer's step() after clipping");
  InternalOpGuard internal;
  at::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);
  std::vector<at::Tensor> grads;
  for (const auto& fp : state.flat_params())
    for (const auto& s : fp->slots())
      if (s.piece.defined() && s.piece.grad().defined()) grads.push_back(s.piece.grad());

  // This rank's part: max |g|, or sum |g|^p, over its pieces, in double.
  const c10::Device device = state.groups().world_comm->device();
  at::Tensor local = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (const auto& g : grads) {
    at::Tensor gd = g.to(at::kDouble);
    if (gd.is_sparse()) gd = gd.coalesce().values();
    if (gd.numel() == 0) continue;
    // Computed where the gradient is (host memory under CPU offload), combined on the device.
    if (inf)
      local = at::maximum(local, gd.abs().max().reshape({1}).to(device));
    else
      local += gd.norm(norm_type).pow(norm_type).reshape({1}).to(device);
  }
  // Pieces are disjoint within a shard group and identical across replicas (NO_SHARD's whole
  // model, HYBRID_SHARD's replica groups), so the parts are combined over the shard group only.
  // Gathering every part and combining them in rank order gives every rank the same total.
  at::Tensor parts = local;
  const CommunicatorPtr& shard = state.groups().shard_comm;
  if (!state.groups().keep_unsharded && shard && shard->size() > 1) {
    parts = at::empty({shard->size()}, local.options());
    shard->all_gather_into(parts, local, CollectiveOptions::labeled("clip_grad_norm: norm all-gather"))->wait();
  }
  parts = parts.cpu();
  double total = 0;
  for (int64_t i = 0; i < parts.numel(); ++i) {
    const double v = parts[i].item<double>();
    total = inf ? std::max(total, v) : total + v;
  }
  if (!inf) total = std::pow(total, 1.0 / norm_type);
  const double coef = std::min(1.0, max_norm / (total + 1e-6));
  for (auto& g : grads) g.mul_(coef);
  return total;
}

}  // namespace fsdp
