#pragma once
// --deterministic's optimizer step: the global batch as a fixed list of micro-batches, each rank
// running a contiguous range of them. See Note [Deterministic training] in docs/design.md.
#include "training.h"

namespace fsdp_gpt {

// Micro-batches [first, end) of `count` for `rank` of `world` (which divides it): contiguous, equal.
struct MicroBatchRange {
  int first = 0, end = 0;
};
MicroBatchRange micro_batch_range(int count, int rank, int world);

// One optimizer step at `lr`; returns the mean loss over every micro-batch of the global batch,
// the same bits on every rank and at every world size.
double deterministic_train_step(const TrainingLoop& loop, int step, double lr);

}  // namespace fsdp_gpt
