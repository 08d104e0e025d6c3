#pragma once
// --deterministic's optimizer step: the global batch as a fixed list of micro-batches, each rank
// running a contiguous range of them. See Note [Deterministic training] in docs/design.md.
#include "training.h"

namespace fsdp_gpt {

// Micro-batches [first, end) of `count` for `rank` of `world`: contiguous, sizes differing by at
// most one.
struct MicroBatchRange {
  int first = 0, end = 0;
};
MicroBatchRange micro_batch_range(int count, int rank, int world);
// Forward and backward passes every rank runs per step: the largest range's size. A rank with a
// smaller range runs uncounted padding passes (FullyShardedModule::set_backward_counted).
int micro_batches_per_rank(int count, int world);

// One optimizer step at `lr`; returns this rank's micro-batch losses: one value per micro-batch of
// the global batch, zero outside this rank's range.
std::vector<double> deterministic_train_step(const TrainingLoop& loop, int step, double lr);
// Collective: each step's mean loss over every micro-batch of its global batch, from every rank's
// deterministic_train_step() results of those steps, in one all-reduce; the same bits on every rank
// and at every world size.
std::vector<double> global_step_losses(fsdp::ProcessGroup& pg, const std::vector<std::vector<double>>& per_step);

}  // namespace fsdp_gpt
