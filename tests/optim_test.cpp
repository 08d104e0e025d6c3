// fsdp::FusedAdamW on the CPU: one pass per parameter with libfsdp's own kernel, equal to
// torch::optim::AdamW's step (1e-6 relative), its state interchangeable with AdamW's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/optim.h"
#include "optimizer_state_key.h"

namespace fsdp_test {
namespace {

// Largest |a - b| over the largest |b|, over every pair of tensors.
double relative_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, (a[i] - b[i]).abs().max().item<double>());
    scale = std::max(scale, b[i].abs().max().item<double>());
  }
  return diff / scale;
}

std::vector<at::Tensor> make_params(int64_t seed) {
  torch::manual_seed(seed);
  // Sizes below, at and above one parallel chunk, and an odd one.
  std::vector<at::Tensor> out;
  for (int64_t n : {7, 1000, 1 << 15, (1 << 17) + 3}) out.push_back(torch::randn({n}).requires_grad_());
  return out;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone().requires_grad_());
  return out;
}

// Trains both optimizers on the same gradients for `steps` steps, two parameter groups (one
// without weight decay); returns the largest relative difference of parameters and moments.
double compare(int steps, double weight_decay) {
  auto ref = make_params(3), ours = clones(ref);
  auto groups = [&](std::vector<at::Tensor>& ps) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<at::Tensor>{ps[0], ps[2]},
                   std::make_unique<torch::optim::AdamWOptions>(
                       torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).weight_decay(weight_decay)));
    g.emplace_back(std::vector<at::Tensor>{ps[1], ps[3]},
                   std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-2).weight_decay(0)));
    return g;
  };
  torch::optim::AdamW reference(groups(ref));
  fsdp::FusedAdamW fused(groups(ours));
  for (int s = 0; s < steps; ++s) {
    for (size_t i = 0; i < ref.size(); ++i) {
      auto g = torch::randn_like(ref[i]) * (s + 1);
      ref[i].mutable_grad() = g.clone();
      ours[i].mutable_grad() = g.clone();
    }
    reference.step();
    fused.step();
    EXPECT_TRUE(fused.last_step_fused()) << "float32 CPU parameters take the fused path";
  }
  std::vector<at::Tensor> a = ours, b = ref;
  for (size_t i = 0; i < ref.size(); ++i) {
    auto& sa =
        static_cast<torch::optim::AdamWParamState&>(*fused.state().at(fsdp::detail::optimizer_state_key(ours[i])));
    auto& sb =
        static_cast<torch::optim::AdamWParamState&>(*reference.state().at(fsdp::detail::optimizer_state_key(ref[i])));
    EXPECT_EQ(sa.step(), sb.step());
    a.push_back(sa.exp_avg());
    b.push_back(sb.exp_avg());
    a.push_back(sa.exp_avg_sq());
    b.push_back(sb.exp_avg_sq());
  }
  return relative_difference(a, b);
}

// Runs body with LibTorch's intra-op threads set to `threads`, then restores them.
template <class F>
void with_threads(int threads, F body) {
  const int before = at::get_num_threads();
  at::set_num_threads(threads);
  body();
  at::set_num_threads(before);
}

TEST(FusedAdamW, CpuStepEqualsAdamW) {
  for (int threads : {1, 2}) {
    with_threads(threads, [] {
      EXPECT_LE(compare(/*steps=*/10, /*weight_decay=*/0.1), 1e-6) << at::get_num_threads() << " threads";
      EXPECT_LE(compare(/*steps=*/3, /*weight_decay=*/0), 1e-6) << at::get_num_threads() << " threads";
    });
  }
}

TEST(FusedAdamW, CpuStepIsBitwiseTheSameOnAnyNumberOfThreads) {
  // Each element's operations do not depend on how the loop is split over threads.
  std::vector<std::vector<at::Tensor>> results;
  for (int threads : {1, 2, 3}) {
    with_threads(threads, [&] {
      auto ps = make_params(11);
      fsdp::FusedAdamW opt(ps, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      torch::manual_seed(12);
      for (int s = 0; s < 3; ++s) {
        for (auto& p : ps) p.mutable_grad() = torch::randn_like(p);
        opt.step();
      }
      results.push_back(ps);
    });
  }
  for (size_t r = 1; r < results.size(); ++r)
    for (size_t i = 0; i < results[0].size(); ++i)
      EXPECT_TRUE(torch::equal(results[r][i], results[0][i])) << "tensor " << i << ", run " << r;
}

TEST(FusedAdamW, CpuStepContinuesFromAdamWState) {
  // AdamW's state (as a checkpoint would restore it) carries over: two reference steps, then one
  // fused step from the same state equals a third reference step.
  auto ref = make_params(5), ours = clones(ref);
  torch::optim::AdamW reference(ref, torch::optim::AdamWOptions(1e-3).weight_decay(0.05));
  for (int s = 0; s < 2; ++s) {
    for (auto& p : ref) p.mutable_grad() = torch::randn_like(p);
    reference.step();
  }
  fsdp::FusedAdamW fused(ours, torch::optim::AdamWOptions(1e-3).weight_decay(0.05));
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < ref.size(); ++i) ours[i].copy_(ref[i]);
  }
  std::stringstream saved;
  torch::serialize::OutputArchive out;
  reference.save(out);
  out.save_to(saved);
  torch::serialize::InputArchive in;
  in.load_from(saved);
  fused.load(in);
  for (size_t i = 0; i < ref.size(); ++i) {
    auto g = torch::randn_like(ref[i]);
    ref[i].mutable_grad() = g.clone();
    ours[i].mutable_grad() = g.clone();
  }
  reference.step();
  fused.step();
  EXPECT_TRUE(fused.last_step_fused());
  EXPECT_LE(relative_difference(ours, ref), 1e-6);
}

TEST(FusedAdamW, OtherDtypesAndAmsgradTakeAdamWsOwnStep) {
  auto p = torch::randn({100}, torch::kFloat64).requires_grad_();
  fsdp::FusedAdamW fused(std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(1e-3));
  p.mutable_grad() = torch::randn_like(p);
  fused.step();
  EXPECT_FALSE(fused.last_step_fused());
  auto q = torch::randn({100}).requires_grad_();
  fsdp::FusedAdamW ams(std::vector<at::Tensor>{q}, torch::optim::AdamWOptions(1e-3).amsgrad(true));
  q.mutable_grad() = torch::randn_like(q);
  ams.step();
  EXPECT_FALSE(ams.last_step_fused());
}

}  // namespace
}  // namespace fsdp_test
