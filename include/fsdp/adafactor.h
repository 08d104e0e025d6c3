#pragma once
// Adafactor (Shazeer and Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost")
// over a sharded module's pieces, equal to Adafactor on the whole parameters, with the defaults and
// order of operations of Hugging Face's Adafactor: a matrix's second moment kept as its row and
// column means (each from the whole matrix), the update clipped by its RMS over the whole
// parameter, the step relative to the parameter's RMS. Two collectives per step carry every
// parameter's reductions (three at the first step after a checkpoint was loaded). Matrices (2-D)
// are factored; other shapes keep a second moment per element.
// See Note [Whole-parameter reductions] in docs/design.md.
#include <torch/torch.h>

#include <memory>
#include <vector>

#include "fsdp/whole_param_optimizer.h"

namespace fsdp {

struct AdafactorOptions : public torch::optim::OptimizerCloneableOptions<AdafactorOptions> {
  AdafactorOptions(double lr = 0) : lr_(lr) {}  // NOLINT(google-explicit-constructor): as torch::optim's options
  TORCH_ARG(double, lr) = 0;                    // used where relative_step is off
  TORCH_ARG(double, eps1) = 1e-30;              // added to the squared gradient
  TORCH_ARG(double, eps2) = 1e-3;               // the least parameter RMS a relative step scales by
  TORCH_ARG(double, clip_threshold) = 1.0;      // the update's RMS is clipped to it
  TORCH_ARG(double, decay_rate) = -0.8;         // beta2 at step t: 1 - t^decay_rate
  TORCH_ARG(double, beta1) = 0;                 // > 0: a first moment of the update
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, scale_parameter) = true;  // the step scales with the parameter's RMS
  TORCH_ARG(bool, relative_step) = true;    // the step is min(1e-2, 1/sqrt(t)) instead of lr
  TORCH_ARG(bool, warmup_init) = false;     // relative steps of 1e-6 * t at first

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct AdafactorParamState : public torch::optim::OptimizerCloneableParamState<AdafactorParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg_sq_row);  // matrices: the whole parameter's row means (R)
  TORCH_ARG(at::Tensor, exp_avg_sq_col);  // matrices: the whole parameter's column means (C)
  TORCH_ARG(at::Tensor, exp_avg_sq);      // other shapes: per element of the piece
  TORCH_ARG(at::Tensor, exp_avg);         // beta1 > 0: per element of the piece
  // Loaded from a checkpoint: exp_avg_sq_row / _col hold, per element of the piece, its row's and
  // its column's value; the next step completes the whole vectors from every rank's pieces.
  TORCH_ARG(bool, spread) = false;
};

class Adafactor : public WholeParamOptimizer {
 public:
  // `groups`: see WholeParamOptimizer (empty: every piece with `defaults`).
  Adafactor(FullyShardedModule& module, std::vector<torch::optim::OptimizerParamGroup> groups,
            const AdafactorOptions& defaults = {});
  Adafactor(FullyShardedModule& module, const AdafactorOptions& defaults) : Adafactor(module, {}, defaults) {}
  // Collective over the module's shard group: every rank must call it at the same step.
  torch::Tensor step(LossClosure closure = nullptr) override;

  // For checkpoints, which hold state per element of a piece: `piece`'s state with a matrix's row
  // and column means spread over the piece's elements (AdafactorParamState::spread); null before
  // its first step. set_spread_state takes such a state, from a piece of any sharding.
  std::unique_ptr<AdafactorParamState> spread_state(const at::Tensor& piece) const;
  void set_spread_state(const at::Tensor& piece, std::unique_ptr<AdafactorParamState> state);

 private:
  // Whole row and column vectors for the matrices whose state is spread on some rank (a
  // collective whenever `any` is true, which every rank agrees on).
  void gather_spread_moments();
  const WholeParam* param_of(const at::Tensor& piece) const;
};

}  // namespace fsdp
