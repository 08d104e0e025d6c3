#pragma once
// The learning-rate schedule: linear warm-up to --lr, then cosine decay to --min-lr or constant.
#include "train_config.h"

namespace fsdp_gpt {

// The learning rate of optimizer step `step` (1-based).
double learning_rate(int step, const TrainConfig& c);

}  // namespace fsdp_gpt
