#pragma once
// fsdp::LBFGS stepped beside torch::optim::LBFGS on the unsharded model, with the settings the tests
// share (tests/lbfgs_test.cpp, tests/gpu/gpu_whole_param_test.cpp).
#include <torch/torch.h>

#include <functional>
#include <string>

#include "fsdp/lbfgs.h"
#include "harness.h"

namespace fsdp_test {

// A history of 3 pairs (so pairs are dropped) and up to 6 iterations per step; with the strong
// Wolfe search at rate 1, else fixed steps of 0.5.
inline torch::optim::LBFGSOptions lbfgs_options(bool line_search) {
  torch::optim::LBFGSOptions o(line_search ? 1.0 : 0.5);
  o.max_iter(6).history_size(3);
  if (line_search) o.line_search_fn("strong_wolfe");
  return o;
}

// One step of each optimizer, each closure zeroing its gradients and backpropagating its loss.
inline void lbfgs_step_side_by_side(torch::optim::LBFGS& ref_opt, const std::function<at::Tensor()>& ref_loss,
                                    fsdp::LBFGS& opt, const std::function<at::Tensor()>& loss) {
  auto closure = [](torch::optim::Optimizer& o, const std::function<at::Tensor()>& f) {
    return [&o, &f] {
      o.zero_grad();
      at::Tensor l = f();
      l.backward();
      return l;
    };
  };
  ref_opt.step(closure(ref_opt, ref_loss));
  opt.step(closure(opt, loss));
}

// Inside a worker: both ran the same iterations and closure evaluations.
inline void expect_same_lbfgs_counts(const fsdp::LBFGS& opt, torch::optim::LBFGS& ref_opt, const std::string& what) {
  const auto& state = static_cast<const torch::optim::LBFGSParamState&>(*ref_opt.state().begin()->second);
  WORKER_CHECK(opt.iterations() == state.n_iter() && opt.evaluations() == state.func_evals(), what, ": ",
               opt.iterations(), " iterations and ", opt.evaluations(), " evaluations against LibTorch's ",
               state.n_iter(), " and ", state.func_evals());
}

}  // namespace fsdp_test
