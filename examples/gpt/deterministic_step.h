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

// One optimizer step at `lr`; returns the mean loss over every micro-batch of the global batch,
// the same bits on every rank and at every world size.
double deterministic_train_step(const TrainingLoop& loop, int step, double lr);

}  // namespace fsdp_gpt
