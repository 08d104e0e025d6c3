#pragma once
// LBFGS: L-BFGS over a sharded module's pieces, equal to torch::optim::LBFGS on the whole model
// and the global batch: every inner product and norm is taken over the whole model (one collective
// over the shard group), and the closure's loss is averaged over the ranks, so that every rank
// makes the same decisions. See Note [L-BFGS over shards] in docs/design.md.
#include <torch/torch.h>

#include <deque>
#include <map>
#include <string>
#include <vector>

#include "fsdp/process_group.h"
#include "fsdp/whole_param_optimizer.h"

namespace fsdp {

class LBFGS : public WholeParamOptimizer {
 public:
  // One group of every piece (L-BFGS has no parameter groups); the options are
  // LibTorch's, with the same defaults (max_eval unset: max_iter * 5 / 4).
  explicit LBFGS(FullyShardedModule& module, const torch::optim::LBFGSOptions& options = {});
  // Collective over the world: every rank calls it at the same step with a closure that zeroes the
  // gradients, runs forward and backward on its part of the batch and returns its loss (the mean
  // over its examples). Returns the closure's first loss on this rank.
  torch::Tensor step(LossClosure closure) override;

  // The step's iterations and closure evaluations so far (LBFGSParamState's n_iter, func_evals).
  int64_t iterations() const { return n_iter_; }
  int64_t evaluations() const { return func_evals_; }

  // Checkpoints (fsdp::checkpoint) carry the history: its scalars, the same on every rank, and each
  // piece's part of its vectors, which any sharding can take back.
  struct History {
    int64_t n_iter = 0, func_evals = 0;
    double t = 0, prev_loss = 0, h_diag = 1;
    std::vector<double> ro;                   // 1 / (s_i . y_i), oldest pair first
    std::vector<std::vector<double>> sy, yy;  // sy[i][k] = s_i . y_(i+k); yy[i][j] = y_i . y_j
  };
  History history() const;
  // This piece's part of the direction ("d"), the last gradient ("prev_flat_grad") and of every
  // pair ("s.<i>", "y.<i>"); empty before the first step.
  std::map<std::string, at::Tensor> piece_state(const at::Tensor& piece) const;
  // A load: set_history, set_piece_state for every piece this rank holds, then after_load().
  void set_history(const History& history);
  void set_piece_state(const at::Tensor& piece, std::map<std::string, at::Tensor> state);
  void after_load() override;

 private:
  struct Evaluation {
    double loss = 0;  // the closure's loss, averaged over the ranks
    at::Tensor grad;  // this rank's pieces' gradients, flattened
  };
  // Runs the closure; evaluated(): its loss averaged over the ranks, and the gradient.
  Evaluation evaluate(const LossClosure& closure);
  Evaluation evaluated(const at::Tensor& loss);
  at::Tensor flat_grad() const;
  void add_to_pieces(double step, const at::Tensor& direction);
  void set_pieces(const std::vector<at::Tensor>& values);
  // The direction from the history and the gradient g (the two-loop recursion on inner products).
  at::Tensor direction(const at::Tensor& g, const at::Tensor& y, const at::Tensor& s);
  // f(x + t d) and its gradient, the pieces put back to x afterwards.
  Evaluation probe(const LossClosure& closure, const std::vector<at::Tensor>& x, double t, const at::Tensor& d);
  struct Search {
    double loss = 0, t = 0;
    at::Tensor grad;
    double grad_max = 0;
    int64_t evaluations = 0;
  };
  Search strong_wolfe(const LossClosure& closure, double t, const at::Tensor& d, const Evaluation& at0, double gtd);
  // Inner products and maxima over the whole model, one collective for all of them.
  std::vector<double> dots(const std::vector<std::pair<at::Tensor, at::Tensor>>& pairs,
                           const std::vector<at::Tensor>& abs_max = {});

  const ProcessGroup* pg_;  // the module's: the closure's loss is averaged over it
  // The state LibTorch's LBFGSParamState keeps, its vectors over this rank's pieces; and the
  // history's inner products over the whole model: sy_[i][k] = s_i . y_(i+k) (the recursion reads
  // no s_i . y_j with j < i), yy_[i][j] = y_i . y_j.
  int64_t n_iter_ = 0, func_evals_ = 0;
  double t_ = 0, prev_loss_ = 0, h_diag_ = 1;
  at::Tensor d_, prev_grad_;
  std::deque<at::Tensor> s_, y_;
  std::deque<double> ro_;
  std::deque<std::deque<double>> sy_, yy_;
  // Each piece's part of the vectors, between set_piece_state and after_load.
  std::map<const c10::TensorImpl*, std::map<std::string, at::Tensor>> loaded_;
};

}  // namespace fsdp
