#pragma once
// The local reference for mixed precision: plain LibTorch performing the casts FSDP performs, at
// the same points (used by the CPU and the GPU tests).
#include <torch/torch.h>

#include <functional>
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
// the compute dtype for forward and backward, but for the modules `keep` selects, whose parameters
// and buffers stay in the master dtype; each rank's rows back-propagated on their own (as each rank
// does), every rank starting from the same buffers, and rank 0's buffers kept (FSDP broadcasts
// them); their gradients cast to the reduce dtype (kept parameters: their own) and summed over
// ranks; the sum cast to the master dtype and averaged.
template <class Model>
struct LocalMixedPrecision {
  Model master, compute;
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;  // (master, compute), each parameter once
  std::vector<at::ScalarType> reduce_dtypes;             // per pair
  bool keep_low_precision_grads = false;                 // the averaged gradients stay in the reduce dtype

  LocalMixedPrecision(Model m, Model c, at::ScalarType param_dtype, at::ScalarType reduce,
                      const std::function<bool(const torch::nn::Module&)>& keep = nullptr)
      : master(std::move(m)), compute(std::move(c)) {
    // Floating-point tensors only: LibTorch's Module::to(dtype) would cast integer buffers too.
    auto cast = [](torch::nn::Module& m, at::ScalarType dtype, bool recurse) {
      at::NoGradGuard no_grad;
      for (auto& t : m.parameters(recurse))
        if (t.is_floating_point()) t.set_data(t.to(dtype));
      for (auto& t : m.buffers(recurse))
        if (t.is_floating_point()) t.set_data(t.to(dtype));
    };
    cast(*compute, param_dtype, /*recurse=*/true);
    if (keep)
      for (const auto& module : compute->modules())
        if (keep(*module)) cast(*module, master->parameters().front().scalar_type(), /*recurse=*/false);
    auto cp = compute->named_parameters();
    for (const auto& kv : master->named_parameters()) {
      bool seen = false;
      for (const auto& pr : pairs) seen = seen || pr.first.is_same(kv.value());
      if (seen) continue;
      pairs.emplace_back(kv.value(), cp[kv.key()]);
      reduce_dtypes.push_back(cp[kv.key()].scalar_type() == param_dtype ? reduce : kv.value().scalar_type());
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
    const std::vector<at::Tensor> buffers = compute->buffers();
    std::vector<at::Tensor> before, rank0;
    for (const auto& b : buffers) before.push_back(b.clone());
    for (int r = 0; r < world; ++r) {
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(before[i]);
      }
      for (auto& [m, c] : pairs) c.mutable_grad().reset();
      at::Tensor loss = loss_fn(compute, x.narrow(0, int64_t(r) * rows, rows));
      losses.push_back(loss.item<double>());
      (loss * loss_scale).backward();
      if (r == 0)
        for (const auto& b : buffers) rank0.push_back(b.clone());
      for (size_t i = 0; i < pairs.size(); ++i) {
        const at::Tensor& g = pairs[i].second.grad();
        if (!g.defined()) continue;
        if (sums[i].defined())
          sums[i].add_(g.to(reduce_dtypes[i]));
        else
          sums[i] = g.to(reduce_dtypes[i], /*non_blocking=*/false, /*copy=*/true);
      }
    }
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(rank0[i]);
    }
    for (size_t i = 0; i < pairs.size(); ++i) {
      at::Tensor& g = pairs[i].first.mutable_grad();
      if (!sums[i].defined())
        g = at::Tensor();
      else if (keep_low_precision_grads)
        g = world > 1 ? sums[i].mul(1.0 / world) : sums[i];
      else
        g = sums[i].to(pairs[i].first.scalar_type(), false, true).mul_(1.0 / world);
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
