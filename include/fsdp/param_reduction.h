#pragma once
// ParamReduction: reductions over whole original parameters (a sum of squares, a maximum, a
// matrix's row and column sums) computed from the shard pieces, for optimizers whose step needs
// them (LAMB's norms, Adafactor's factored second moment). Every rank queues its part of each
// reduction in the same order; one collective over the handle's shard group combines them all.
// See Note [Whole-parameter reductions] in docs/design.md.
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/comm.h"
#include "fsdp/fully_shard.h"

namespace fsdp {

// One original parameter as an optimizer of whole parameters sees it.
struct WholeParam {
  std::string name;            // the original parameter's qualified name
  std::vector<int64_t> shape;  // the original parameter's shape
  int64_t numel = 0;
  at::Tensor piece;        // this rank's piece (1-D leaf the optimizer steps); undefined if it holds none
  int64_t begin = 0;       // `piece` holds elements [begin, begin + piece.numel()) of the flattened parameter
  bool trainable = false;  // its FlatParameter requires gradients
  at::ScalarType dtype = at::kFloat;  // the pieces' (what the optimizer steps)
  // Whether this rank holds a piece with a gradient.
  bool has_grad() const { return piece.defined() && piece.grad().defined(); }
};

// How the parts of one reduction combine over the ranks.
enum class Combine { kSum, kMax };

class ParamReduction {
 public:
  // Every original parameter of `module`, in the same order on every rank.
  explicit ParamReduction(FullyShardedModule& module);

  const std::vector<WholeParam>& params() const { return params_; }
  // Takes each parameter's `trainable` from its FlatParameter again (unfrozen since); whether any changed.
  bool update_trainable();
  // Queues this rank's part of one reduction (any floating dtype and device; the same length on
  // every rank of the shard group, zeros where the rank holds nothing); returns its id for result().
  int add(const at::Tensor& part, Combine how);
  // Collective over the handle's shard group (local where every rank holds whole parameters):
  // combines every queued part in rank order, so each rank gets the same values; clears the queue.
  void run();
  // The combined values of reduction `id` of the last run(): float64, on the CPU.
  const at::Tensor& result(int id) const;
  // The shard group it reduces over; null where every rank holds whole parameters.
  const CommunicatorPtr& communicator() const { return comm_; }
  // Collectives run so far, and the bytes this rank contributed to them.
  int64_t collectives() const { return collectives_; }
  int64_t bytes_sent() const { return bytes_sent_; }

 private:
  FsdpState* state_;
  std::vector<WholeParam> params_;
  std::vector<size_t> flat_of_;  // per parameter: its FlatParameter
  CommunicatorPtr comm_;         // null: parameters are whole on every rank
  std::vector<at::Tensor> parts_;
  std::vector<Combine> how_;
  std::vector<at::Tensor> results_;
  int64_t collectives_ = 0, bytes_sent_ = 0;
};

// The rows of a 2-D (R, C) parameter that `values` (a tensor over a piece's elements) touches, as
// a (rows, C) matrix holding `values` at their places and zeros around them.
struct PieceRows {
  at::Tensor matrix;
  int64_t first_row = 0;
};
PieceRows piece_rows(const WholeParam& p, const at::Tensor& values);
// The inverse: the piece's elements of a (rows, C) matrix laid out as piece_rows() gives it.
at::Tensor piece_of_rows(const WholeParam& p, const at::Tensor& matrix);

}  // namespace fsdp
