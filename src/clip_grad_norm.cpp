#include "clip_grad_norm.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "exact_sum.h"
#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

namespace {

// `local` (one value per rank) gathered over the shard group, where the pieces are disjoint (NO_SHARD
// and HYBRID_SHARD replicas hold the same pieces, so their parts are not combined), on the CPU.
at::Tensor gather_parts(FsdpState& state, const at::Tensor& local, const char* what) {
  at::Tensor parts = local;
  const CommunicatorPtr& shard = state.groups().shard_comm;
  if (!state.groups().keep_unsharded && shard && shard->size() > 1) {
    parts = at::empty({shard->size() * local.numel()}, local.options());
    shard->all_gather_into(parts, local, CollectiveOptions::labeled(what))->wait();
  }
  return parts.cpu();
}

// Deterministic mode: the sum of |g|^p over every gradient element, exact up to a grid that
// depends only on the largest term and the model's size, so it is the same however the elements
// are split between ranks (Note [Deterministic training]).
double exact_power_sum(FsdpState& state, const std::vector<at::Tensor>& grads, double p) {
  const c10::Device device = state.groups().world_comm->device();
  std::vector<at::Tensor> terms;
  double local_max = 0;
  for (const auto& g : grads) {
    at::Tensor gd = g.to(at::kDouble);
    if (gd.is_sparse()) gd = gd.coalesce().values();
    if (gd.numel() == 0) continue;
    terms.push_back(p == 2 ? gd * gd : gd.abs().pow(p));  // a float's square is exact in double
    const double m = terms.back().max().item<double>();
    local_max = std::isnan(m) || std::isnan(local_max) ? std::nan("") : std::max(local_max, m);
  }
  const at::Tensor maxes = gather_parts(state, at::full({1}, local_max, at::dtype(at::kDouble).device(device)),
                                        "clip_grad_norm: largest term all-gather");
  double max_term = 0;
  for (int64_t i = 0; i < maxes.numel(); ++i) {
    const double v = maxes[i].item<double>();
    if (!std::isfinite(v)) return v;
    max_term = std::max(max_term, v);
  }
  int64_t numel = 0;  // the model's elements that take gradients: the same on every layout
  for (const auto& fp : state.flat_params())
    if (fp->requires_grad()) numel += fp->numel();
  int headroom = 0;
  while ((int64_t(1) << headroom) <= numel && headroom < 62) ++headroom;
  const int scale_exp = exact::scale_exp_for(max_term, headroom);
  std::array<int64_t, exact::kLimbs> sums{};
  for (const auto& t : terms) {
    const std::array<int64_t, exact::kLimbs> part_sums = exact::sum(t, scale_exp);
    for (int j = 0; j < exact::kLimbs; ++j) sums[j] += part_sums[j];
    // Carries between the limbs after each tensor, so that no limb's sum overflows.
    for (int j = 0; j + 1 < exact::kLimbs; ++j) {
      const int64_t carry = sums[j] >> 32;  // an arithmetic shift: the floor
      sums[j] -= carry * (int64_t(1) << 32);
      sums[j + 1] += carry;
    }
  }
  const at::Tensor local = at::tensor(std::vector<int64_t>(sums.begin(), sums.end()), at::dtype(at::kLong));
  const at::Tensor all = gather_parts(state, local.to(device), "clip_grad_norm: exact sum all-gather");
  at::Tensor total = all.view({-1, exact::kLimbs}).sum(0);
  at::Tensor parts[exact::kLimbs];
  for (int j = 0; j < exact::kLimbs; ++j) parts[j] = total.narrow(0, j, 1);
  return exact::to_double(parts, scale_exp, 1.0).item<double>();
}

}  // namespace

double clip_grad_norm(FsdpState& state, double max_norm, double norm_type) {
  FSDP_CHECK(norm_type > 0 && !std::isnan(norm_type), "clip_grad_norm_: norm_type must be positive or infinity, got ",
             norm_type);
  FSDP_CHECK(max_norm >= 0 && !std::isnan(max_norm), "clip_grad_norm_: max_norm must be 0 or more, got ", max_norm);
  std::lock_guard<std::recursive_mutex> lock(state.mutex());
  state.rethrow_pending_error();
  state.settle_failed_backward();
  FSDP_CHECK(!state.reducer().holds_unreduced(), GradientReducer::unreduced_error("clip_grad_norm_"));
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

  if (state.groups().deterministic && !inf) {
    const double total = std::pow(exact_power_sum(state, grads, norm_type), 1.0 / norm_type);
    const double coef = std::min(1.0, max_norm / (total + 1e-6));
    for (auto& g : grads) g.mul_(coef);
    return total;
  }
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
