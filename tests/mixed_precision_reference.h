#pragma once
// The local reference for mixed precision: plain LibTorch performing the casts FSDP performs, at
// the same points (used by the CPU and the GPU tests).
#include <torch/torch.h>

#include <utility>
#include <vector>

#include "models.h"

namespace fsdp_test {

// Three TinyTransformer(vocab 32, width 16, 2 heads, 3 blocks, context 8) with the same initial
// weights: the reference's masters, the reference's compute copy, and the model to shard.
struct MixedPrecisionTriplet {
  TinyTransformer master{nullptr}, compute{nullptr}, model{nullptr};
  MixedPrecisionTriplet() {
    for (auto* m : {&master, &compute, &model}) {
      torch::manual_seed(3);
      *m = TinyTransformer(32, 16, 2, 3, 8);
    }
  }
};

inline at::Tensor cast_lm_loss(TinyTransformer& m, const at::Tensor& x) {
  return lm_loss(m->forward(x).to(at::kFloat), x.roll(1, 1));
}

// Plain LibTorch with the casts FSDP performs, at the same points: the master parameters cast to
// the compute dtype for forward and backward; each rank's rows back-propagated on their own (as
// each rank does); their gradients cast to the reduce dtype and summed over ranks; the sum cast to
// the master dtype and averaged.
template <class Model>
struct LocalMixedPrecision {
  Model master, compute;
  at::ScalarType reduce_dtype;
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;  // (master, compute), each parameter once

  LocalMixedPrecision(Model m, Model c, at::ScalarType param_dtype, at::ScalarType reduce)
      : master(std::move(m)), compute(std::move(c)), reduce_dtype(reduce) {
    compute->to(param_dtype);
    auto cp = compute->named_parameters();
    for (const auto& kv : master->named_parameters()) {
      bool seen = false;
      for (const auto& pr : pairs) seen = seen || pr.first.is_same(kv.value());
      if (!seen) pairs.emplace_back(kv.value(), cp[kv.key()]);
    }
  }

  // Leaves the averaged gradients in the master parameters; returns each rank's loss.
  template <class LossFn>
  std::vector<double> backward(const at::Tensor& x, int world, int rows, double loss_scale, LossFn loss_fn) {
    {
      at::NoGradGuard no_grad;
      for (auto& [m, c] : pairs) c.copy_(m);
    }
    std::vector<at::Tensor> sums(pairs.size());
    std::vector<double> losses;
    for (int r = 0; r < world; ++r) {
      for (auto& [m, c] : pairs) c.mutable_grad().reset();
      at::Tensor loss = loss_fn(compute, x.narrow(0, int64_t(r) * rows, rows));
      losses.push_back(loss.item<double>());
      (loss * loss_scale).backward();
      for (size_t i = 0; i < pairs.size(); ++i) {
        const at::Tensor& g = pairs[i].second.grad();
        if (!g.defined()) continue;
        if (sums[i].defined())
          sums[i].add_(g.to(reduce_dtype));
        else
          sums[i] = g.to(reduce_dtype, /*non_blocking=*/false, /*copy=*/true);
      }
    }
    for (size_t i = 0; i < pairs.size(); ++i) {
      at::Tensor& g = pairs[i].first.mutable_grad();
      g = sums[i].defined() ? sums[i].to(pairs[i].first.scalar_type(), false, true).mul_(1.0 / world) : at::Tensor();
    }
    return losses;
  }
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> out;
    for (const auto& pr : pairs) out.push_back(pr.first);
    return out;
  }
};

}  // namespace fsdp_test
