#pragma once
// Muon (Keller Jordan's MomentUm Orthogonalized by Newton-Schulz) over a sharded module's pieces,
// equal to Muon on the whole parameters. Each matrix's momentum lives on its pieces; each step,
// every matrix is owned by one rank of the shard group (the rank holding most of it, balanced by
// Newton-Schulz cost), which receives the other ranks' pieces, orthogonalizes the matrix, and sends
// each piece its part of the result: two exchanges per step for all matrices, carrying only the
// pieces that lie outside their owner's shard, and each rank runs about 1/F of the matrix work
// (or, where that sends fewer bytes, one all-gather of the matrices that straddle ranks, each then
// orthogonalized by every rank holding a piece of it).
// Parameters that are not matrices, or in a group with use_muon off (embeddings, the output
// layer), step with AdamW. See Note [Muon's owner ranks] in docs/design.md.
#include <torch/torch.h>

#include <memory>
#include <tuple>
#include <vector>

#include "fsdp/whole_param_optimizer.h"

namespace fsdp {

// The AdamW that steps a Muon optimizer's other parameters.
struct MuonAdamW {
  MuonAdamW(double lr = 3e-4) : lr_(lr) {}  // NOLINT(google-explicit-constructor): as torch::optim's options
  TORCH_ARG(double, lr) = 3e-4;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.95);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
};

struct MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  MuonOptions(double lr = 0.02) : lr_(lr) {}  // NOLINT(google-explicit-constructor): as torch::optim's options
  TORCH_ARG(double, lr) = 0.02;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(int, ns_steps) = 5;  // Newton-Schulz iterations
  // Newton-Schulz in bfloat16, with the reference implementation's roundings (faster, less exact)
  TORCH_ARG(bool, ns_bfloat16) = false;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, use_muon) = true;  // false: every parameter of the group steps with adamw
  TORCH_ARG(MuonAdamW, adamw) = {};

 public:
  // Muon's learning rate (adamw's is its own: set both where a schedule scales them).
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct MuonParamState : public torch::optim::OptimizerCloneableParamState<MuonParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, momentum_buffer);  // Muon: per element of the piece
  TORCH_ARG(at::Tensor, exp_avg);          // AdamW: per element of the piece
  TORCH_ARG(at::Tensor, exp_avg_sq);
};

// How the matrices' pieces travel (Note [Muon's owner ranks]). kAllToAll, kReduceScatterAllGather:
// to each matrix's owner and its result back; kAllGather: every rank gets the pieces of the matrices
// that straddle ranks and orthogonalizes every matrix it holds a piece of, with no way back. kAuto:
// the owners' way the transport has (all-to-all on the CPU transports, else reduce-scatter and
// all-gather), or kAllGather where that sends fewer bytes; kAutoWithoutAllToAll: kAuto's choice on
// a transport without an all-to-all (the CUDA transports' choice, on any transport).
enum class MuonExchange { kAuto, kAllToAll, kReduceScatterAllGather, kAllGather, kAutoWithoutAllToAll };

// What one rank's Muon step moves and computes, for the whole step.
struct MuonStepStats {
  int64_t matrices = 0;        // Muon matrices of the module
  int64_t matrices_numel = 0;  // their elements together (N)
  int64_t owned = 0;           // of which this rank orthogonalizes
  int64_t owned_cost = 0;      // their Newton-Schulz cost, the sum of R * C * min(R, C)
  int64_t total_cost = 0;      // the same over every matrix
  // Elements of pieces that travel, over the shard group: held outside their owner, or (kAllGather)
  // of a matrix that straddles ranks.
  int64_t moved_numel = 0;
  // Elements per destination rank in each of the exchanges (X): two for an owners' way, one for kAllGather.
  int64_t exchange_numel = 0;
  // The exchange it runs: kAllToAll, kReduceScatterAllGather or kAllGather; kAuto where nothing
  // travels because every rank holds whole matrices.
  MuonExchange exchange = MuonExchange::kAuto;
  // By a ring algorithm, in the exchange's dtype (bfloat16 where every matrix runs Newton-Schulz in
  // it, else the pieces'): (F - 1) * X elements in each exchange, and for the naive way, one
  // all-gather of every rank's pieces of every matrix, padded to the largest rank's (M, at least
  // N / F): (F - 1) * M.
  int64_t bytes_sent = 0;
  int64_t naive_bytes_sent = 0;
};

class Muon : public WholeParamOptimizer {
 public:
  // `groups`: see WholeParamOptimizer (empty: every piece with `defaults`). Collective
  // over the module's shard group (the ranks agree which parameters are Muon's matrices).
  Muon(FullyShardedModule& module, std::vector<torch::optim::OptimizerParamGroup> groups,
       const MuonOptions& defaults = {}, MuonExchange exchange = MuonExchange::kAuto);
  Muon(FullyShardedModule& module, const MuonOptions& defaults, MuonExchange exchange = MuonExchange::kAuto)
      : Muon(module, {}, defaults, exchange) {}
  // Collective over the module's shard group: every rank must call it at the same step.
  torch::Tensor step(LossClosure closure = nullptr) override;
  const MuonStepStats& stats() const { return stats_; }
  // Collective over the module's shard group: plans again from the groups' options (checkpoint::load
  // calls it after restoring them).
  void after_load() override;
  // Newton-Schulz orthogonalization of a matrix (Muon's quintic iteration), in its dtype; in
  // bfloat16, operation by operation as the reference implementation rounds.
  static at::Tensor orthogonalize(const at::Tensor& g, int steps);

 private:
  struct Matrix {
    size_t param = 0;  // index in reduction_.params()
    int owner = 0;     // shard-group rank
    int ns_steps = 5;
    bool ns_bfloat16 = false;
    std::vector<int64_t> begin, count;  // per shard-group rank: the elements its piece holds
  };
  // Elements [from, from + numel) of matrix `matrix`, at offset `at` of an exchange buffer.
  struct Slice {
    size_t matrix = 0;
    int64_t from = 0, numel = 0, at = 0;
  };
  MuonExchange requested_;
  std::vector<Matrix> matrices_;
  std::vector<Slice> outgoing_;                 // this rank's pieces of others' matrices, in the spread buffer
  std::vector<Slice> incoming_;                 // others' pieces of this rank's matrices, in the gathered buffer
  at::ScalarType exchange_dtype_ = at::kFloat;  // of the matrices on their way and back
  // Plans again: a parameter unfrozen since is one of Muon's matrices from now on.
  void trainable_changed() override { plan(); }
  // Which parameters are Muon's matrices, their owners and the exchange, from the groups' options.
  void plan();
  // Each matrix's owner, from its Newton-Schulz cost (per matrix) and where its pieces lie.
  void assign_owners(const std::vector<int64_t>& cost, int members, bool all_to_all);
  // The largest rank's elements of the matrices that straddle ranks (kAllGather's X).
  int64_t straddling_numel(int members) const;
  // Whether `rank` orthogonalizes m under the exchange in stats_.
  bool orthogonalizes(const Matrix& m, int rank) const;
  // outgoing_ and incoming_, and the exchange's size in stats_, from the owners.
  void plan_exchanges(int members, int rank);
  std::vector<bool> is_muon_;  // per reduction_.params() entry
  MuonStepStats stats_;
  void step_adamw(const WholeParam& p);
  // p's Muon update direction before orthogonalization (momentum, Nesterov), on its piece.
  at::Tensor momentum_update(const WholeParam& p);
};

}  // namespace fsdp
