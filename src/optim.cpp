#include "fsdp/optim.h"

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <cmath>
#include <map>
#include <tuple>

#include "optimizer_state_key.h"

namespace fsdp {
namespace {

// Elements per task of the CPU kernel's parallel loop: below this a parameter runs on one thread.
constexpr int64_t kCpuGrain = int64_t(1) << 15;

// The step's scalars, in float32 as torch::optim::AdamW applies them to float32 tensors.
struct AdamWScalars {
  float decay;  // 1 - lr * weight_decay; exactly 1 without weight decay (p * 1 == p)
  float b1, one_minus_b1, b2, one_minus_b2, bc2_sqrt, eps, neg_step_size;
};

// Elements [begin, end) of one AdamW update. The four arrays are distinct tensors (restrict) and
// the scalars are locals, so the compiler vectorizes the loop; on x86-64 it is also built for AVX2
// (twice the lanes, no FMA: the same roundings) and picked at load time. Not under ThreadSanitizer:
// the clone's resolver runs during relocation, before TSan's runtime exists, and crashed there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx2", "default")))
#endif
void cpu_adamw_range(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                     int64_t begin, int64_t end, const AdamWScalars c) {
  for (int64_t i = begin; i < end; ++i) {
    const float gi = g[i];
    const float pi = p[i] * c.decay;
    const float mi = m[i] * c.b1 + c.one_minus_b1 * gi;
    const float vi = v[i] * c.b2 + c.one_minus_b2 * gi * gi;
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    p[i] = pi + c.neg_step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

// One AdamW update of n float32 elements in a single pass, split over LibTorch's intra-op threads
// (at::get_num_threads()). Each element follows torch::optim::AdamW::step's operations in its
// order (Note [FusedAdamW]).
void cpu_adamw(float* p, const float* g, float* m, float* v, int64_t n, const torch::optim::AdamWOptions& o,
               int64_t step) {
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  AdamWScalars c;
  c.decay = o.weight_decay() != 0 ? static_cast<float>(1 - o.lr() * o.weight_decay()) : 1.0f;
  c.b1 = static_cast<float>(beta1);
  c.one_minus_b1 = static_cast<float>(1 - beta1);
  c.b2 = static_cast<float>(beta2);
  c.one_minus_b2 = static_cast<float>(1 - beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(beta2, static_cast<double>(step))));
  c.eps = static_cast<float>(o.eps());
  c.neg_step_size = static_cast<float>(-o.lr() / (1 - std::pow(beta1, static_cast<double>(step))));
  at::parallel_for(0, n, kCpuGrain, [&](int64_t begin, int64_t end) { cpu_adamw_range(p, g, m, v, begin, end, c); });
}

// p's AdamW state, created (zero moments, step 0) on its first step.
template <class States>
torch::optim::AdamWParamState& adamw_state(States& states, const at::Tensor& p) {
  const auto key = detail::optimizer_state_key(p);
  auto it = states.find(key);
  if (it == states.end()) {
    auto fresh = std::make_unique<torch::optim::AdamWParamState>();
    fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
    fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
    it = states.emplace(key, std::move(fresh)).first;
  }
  return static_cast<torch::optim::AdamWParamState&>(*it->second);
}

// Runs the closure, if any, with grad mode on (as torch::optim::AdamW::step does).
torch::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

bool cpu_fusable(const at::Tensor& p) {
  const at::Tensor& g = p.grad();
  return p.device().is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous() && g.device().is_cpu() &&
         !g.is_sparse() && g.scalar_type() == at::kFloat && g.is_contiguous();
}

}  // namespace

torch::Tensor FusedAdamW::step(LossClosure closure) {
  bool cpu = true;
  for (const auto& group : param_groups_) {
    if (static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad()) cpu = false;
    for (const auto& p : group.params())
      if (p.grad().defined() && !cpu_fusable(p)) cpu = false;
  }
  if (cpu) {
    last_step_fused_ = true;
    torch::NoGradGuard no_grad;
    torch::Tensor loss = run_closure(closure);
    for (auto& group : param_groups_) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& s = adamw_state(state_, p);
        s.step(s.step() + 1);
        at::Tensor m = s.exp_avg(), v = s.exp_avg_sq();
        if (!m.is_contiguous()) s.exp_avg(m = m.contiguous());  // e.g. loaded from a state dict
        if (!v.is_contiguous()) s.exp_avg_sq(v = v.contiguous());
        cpu_adamw(p.data_ptr<float>(), p.grad().data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), p.numel(),
                  o, s.step());
        torch::autograd::impl::bump_version(p);  // written through its pointer: say so, as an operator would
      }
    }
    return loss;
  }
#if TORCH_VERSION_MAJOR >= 2
  bool fusable = true;
  for (const auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    if (o.amsgrad()) fusable = false;
    for (const auto& p : group.params())
      if (p.grad().defined() && (!p.is_cuda() || p.grad().is_sparse() || !p.grad().is_cuda())) fusable = false;
  }
  last_step_fused_ = fusable;
  if (!fusable) return torch::optim::AdamW::step(std::move(closure));

  torch::NoGradGuard no_grad;
  torch::Tensor loss = run_closure(closure);
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    // The kernel takes lists of one device and dtype.
    struct Lists {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    };
    std::map<std::tuple<int, int>, Lists> buckets;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const void* key = p.unsafeGetTensorImpl();
      auto& s = adamw_state(state_, p);
      DeviceStep& d = device_steps_[key];
      if (!d.count.defined() || d.synced != s.step()) {  // first step, or the state was loaded
        d.count = torch::full({}, static_cast<double>(s.step()), p.options().dtype(at::kFloat));
      }
      s.step(s.step() + 1);
      d.synced = s.step();
      Lists& l = buckets[{static_cast<int>(p.device().index()), static_cast<int>(p.scalar_type())}];
      l.params.push_back(p);
      l.grads.push_back(p.grad());
      l.exp_avgs.push_back(s.exp_avg());
      l.exp_avg_sqs.push_back(s.exp_avg_sq());
      l.steps.push_back(d.count);
    }
    for (auto& [where, l] : buckets) {
      at::_foreach_add_(l.steps, 1);
      at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, /*max_exp_avg_sqs=*/{}, l.steps, o.lr(),
                        std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                        /*amsgrad=*/false, /*maximize=*/false);
    }
  }
  return loss;
#else
  last_step_fused_ = false;
  return torch::optim::AdamW::step(std::move(closure));
#endif
}

}  // namespace fsdp
