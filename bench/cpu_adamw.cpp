// CPU AdamW step time: fsdp::FusedAdamW (one pass per parameter, libfsdp's kernel) against
// torch::optim::AdamW on the same float32 parameters and gradients, interleaved; medians. The
// memory roofline beside them: a pass with the same traffic (read p, g, m, v; write p, m, v) and
// only additions, split over the same threads.
//
//   build/bench/fsdp_bench_cpu_adamw [--elements N] [--tensors T] [--threads K] [--reps R]
#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "fsdp/optim.h"

namespace {

std::vector<at::Tensor> params(int64_t elements, int tensors) {
  std::vector<at::Tensor> out;
  for (int i = 0; i < tensors; ++i) {
    auto p = torch::randn({elements / tensors}).requires_grad_();
    p.mutable_grad() = torch::randn_like(p);
    out.push_back(p);
  }
  return out;
}

template <class Opt>
double step_ms(Opt& opt) {
  const auto start = std::chrono::steady_clock::now();
  opt.step();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// The roofline pass over one tensor's state: as many bytes read and written as an AdamW step.
void same_traffic(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t n) {
  at::parallel_for(0, n, int64_t(1) << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      p[i] += g[i];
      m[i] += g[i];
      v[i] += g[i];
    }
  });
}

double roofline_ms(std::vector<at::Tensor>& p, std::vector<at::Tensor>& g, std::vector<at::Tensor>& m,
                   std::vector<at::Tensor>& v) {
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < p.size(); ++i)
    same_traffic(p[i].data_ptr<float>(), g[i].data_ptr<float>(), m[i].data_ptr<float>(), v[i].data_ptr<float>(),
                 p[i].numel());
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CPU AdamW step: fsdp::FusedAdamW against torch::optim::AdamW"};
  int64_t elements = 1 << 24;
  int tensors = 16, threads = 0, reps = 11;
  app.add_option("--elements", elements, "float32 parameters in all");
  app.add_option("--tensors", tensors, "how many tensors they are split into");
  app.add_option("--threads", threads, "intra-op threads (0: LibTorch's default)");
  app.add_option("--reps", reps, "timed steps of each, interleaved, after one untimed step");
  CLI11_PARSE(app, argc, argv);
  if (threads > 0) torch::set_num_threads(threads);
  torch::manual_seed(0);
  auto a = params(elements, tensors), b = params(elements, tensors);
  const auto o = torch::optim::AdamWOptions(1e-3).weight_decay(0.1);
  torch::optim::AdamW reference(a, o);
  fsdp::FusedAdamW fused(b, o);
  reference.step();
  fused.step();
  std::vector<at::Tensor> rp, rg, rm, rv;
  for (int i = 0; i < tensors; ++i) {
    for (auto* list : {&rp, &rg, &rm, &rv}) list->push_back(torch::rand({elements / tensors}));
  }
  roofline_ms(rp, rg, rm, rv);
  std::vector<double> ref_ms, fused_ms, roof_ms;
  for (int r = 0; r < reps; ++r) {
    ref_ms.push_back(step_ms(reference));
    fused_ms.push_back(step_ms(fused));
    roof_ms.push_back(roofline_ms(rp, rg, rm, rv));
  }
  const double bytes = 7.0 * 4 * static_cast<double>(elements);  // read p, g, m, v; write p, m, v
  const double r = median(ref_ms), f = median(fused_ms), roof = median(roof_ms);
  std::printf("# %lld float32 parameters in %d tensors, %d threads, %d interleaved steps each (medians)\n",
              static_cast<long long>(elements), tensors, torch::get_num_threads(), reps);
#if !defined(_OPENMP)
  std::printf("# this benchmark was built without OpenMP: its roofline pass runs on one thread\n");
#endif
  std::printf("%-28s %10s %12s\n", "optimizer", "step ms", "GB/s (7x4B)");
  std::printf("%-28s %10.2f %12.2f\n", "torch::optim::AdamW", r, bytes / r / 1e6);
  std::printf("%-28s %10.2f %12.2f\n", "fsdp::FusedAdamW", f, bytes / f / 1e6);
  std::printf("%-28s %10.2f %12.2f\n", "roofline (same traffic)", roof, bytes / roof / 1e6);
  std::printf("speedup %.2fx (fused path: %s); fused at %.2f of the roofline\n", r / f,
              fused.last_step_fused() ? "yes" : "no", roof / f);
  return 0;
}
