#pragma once
// Single-process LAMB, Adafactor and Muon on whole tensors, written from the papers' and the
// reference implementations' formulas (not from libfsdp's code): what the sharded optimizers
// (fsdp::Lamb, fsdp::Adafactor, fsdp::Muon) must equal.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace fsdp_test {

// Steps each parameter that has a gradient; `state` grows with the parameters.
struct ReferenceLamb {
  double lr, beta1, beta2, eps, weight_decay;
  struct State {
    int64_t t = 0;
    at::Tensor m, v;
  };
  std::vector<State> state;

  void step(const std::vector<at::Tensor>& params) {
    at::NoGradGuard no_grad;
    state.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (!p.grad().defined()) continue;
      State& s = state[i];
      if (!s.m.defined()) s.m = at::zeros_like(p), s.v = at::zeros_like(p);
      const at::Tensor g = p.grad();
      s.t += 1;
      s.m = beta1 * s.m + (1 - beta1) * g;
      s.v = beta2 * s.v + (1 - beta2) * g * g;
      const at::Tensor m_hat = s.m / (1 - std::pow(beta1, double(s.t)));
      const at::Tensor v_hat = s.v / (1 - std::pow(beta2, double(s.t)));
      const at::Tensor u = m_hat / (v_hat.sqrt() + eps) + weight_decay * p;
      const double wn = p.norm().item<double>(), un = u.norm().item<double>();
      const double trust = (wn > 0 && un > 0) ? wn / un : 1.0;
      p.sub_(lr * trust * u);
    }
  }
};

// Hugging Face's Adafactor with relative steps and parameter scaling; 2-D parameters factored.
struct ReferenceAdafactor {
  double beta1 = 0, weight_decay = 0;
  double eps1 = 1e-30, eps2 = 1e-3, clip = 1.0, decay = -0.8;
  struct State {
    int64_t t = 0;
    at::Tensor row, col, v, m;
  };
  std::vector<State> state;

  void step(const std::vector<at::Tensor>& params) {
    at::NoGradGuard no_grad;
    state.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (!p.grad().defined()) continue;
      State& s = state[i];
      const at::Tensor g = p.grad();
      const bool matrix = p.dim() == 2;
      if (s.t == 0) {
        if (matrix)
          s.row = at::zeros({p.size(0)}, p.options()), s.col = at::zeros({p.size(1)}, p.options());
        else
          s.v = at::zeros_like(p);
        if (beta1 > 0) s.m = at::zeros_like(p);
      }
      s.t += 1;
      const double rms = p.pow(2).mean().sqrt().item<double>();
      const double lr = std::max(eps2, rms) * std::min(1e-2, 1.0 / std::sqrt(double(s.t)));
      const double b2 = 1.0 - std::pow(double(s.t), decay);
      const at::Tensor sq = g * g + eps1;
      at::Tensor u;
      if (matrix) {
        s.row = b2 * s.row + (1 - b2) * sq.mean(1);
        s.col = b2 * s.col + (1 - b2) * sq.mean(0);
        u = g * (s.row / s.row.mean()).rsqrt().unsqueeze(1) * s.col.rsqrt().unsqueeze(0);
      } else {
        s.v = b2 * s.v + (1 - b2) * sq;
        u = g / s.v.sqrt();
      }
      u = u / std::max(1.0, u.pow(2).mean().sqrt().item<double>() / clip) * lr;
      if (beta1 > 0) u = s.m = beta1 * s.m + (1 - beta1) * u;
      if (weight_decay != 0) p.sub_(weight_decay * lr * p);
      p.sub_(u);
    }
  }
};

// Keller Jordan's Muon (Nesterov momentum, five quintic Newton-Schulz iterations, the update scaled
// by sqrt(max(1, rows / cols))) for the parameters `muon` marks; AdamW for the others. `bfloat16`:
// Newton-Schulz in bfloat16, as the reference implementation runs it.
struct ReferenceMuon {
  double lr, momentum, weight_decay;
  double adam_lr, beta1, beta2, eps, adam_weight_decay;
  std::vector<bool> muon;
  struct State {
    int64_t t = 0;
    at::Tensor buf, m, v;
  };
  std::vector<State> state;
  bool bfloat16 = false;

  static at::Tensor orthogonalize(const at::Tensor& g) {
    const double a = 3.4445, b = -4.7750, c = 2.0315;
    const bool tall = g.size(0) > g.size(1);
    at::Tensor x = tall ? g.t() : g;
    x = x / (x.norm() + 1e-7);
    for (int k = 0; k < 5; ++k) {
      const at::Tensor A = at::matmul(x, x.t());
      const at::Tensor B = b * A + c * at::matmul(A, A);
      x = a * x + at::matmul(B, x);
    }
    return tall ? x.t() : x;
  }

  void step(const std::vector<at::Tensor>& params) {
    at::NoGradGuard no_grad;
    state.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (!p.grad().defined()) continue;
      State& s = state[i];
      const at::Tensor g = p.grad();
      if (muon[i]) {
        if (!s.buf.defined()) s.buf = at::zeros_like(p);
        s.buf = momentum * s.buf + (1 - momentum) * g;
        const at::Tensor nesterov = (1 - momentum) * g + momentum * s.buf;
        const at::Tensor x =
            bfloat16 ? orthogonalize(nesterov.to(at::kBFloat16)).to(p.scalar_type()) : orthogonalize(nesterov);
        const at::Tensor o = x * std::sqrt(std::max(1.0, double(p.size(0)) / double(p.size(1))));
        p.mul_(1 - lr * weight_decay);
        p.sub_(lr * o);
      } else {
        if (!s.m.defined()) s.m = at::zeros_like(p), s.v = at::zeros_like(p);
        s.t += 1;
        p.mul_(1 - adam_lr * adam_weight_decay);
        s.m = beta1 * s.m + (1 - beta1) * g;
        s.v = beta2 * s.v + (1 - beta2) * g * g;
        const double bc1 = 1 - std::pow(beta1, double(s.t)), bc2 = 1 - std::pow(beta2, double(s.t));
        p.sub_(adam_lr / bc1 * s.m / (s.v.sqrt() / std::sqrt(bc2) + eps));
      }
    }
  }
};

}  // namespace fsdp_test
