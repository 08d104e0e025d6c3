#pragma once
// The trainer's data: the corpus split into training and validation tokens, and the seeds of its
// batch streams.
#include <cstdint>
#include <optional>

#include "data.h"
#include "train_config.h"

namespace fsdp_gpt {

// Batch streams: independent random sequences for training and validation windows.
constexpr uint64_t kTrainStream = 1, kValidationStream = 2, kSampleStream = 3;

// The corpus and its tokens, split into training and validation.
struct TrainingData {
  gpt::Corpus corpus;
  gpt::TokenSplits splits;
};

// The corpus, split the same way on every rank; nullopt (rank 0 says why) if too short for --context.
std::optional<TrainingData> load_data(const TrainConfig& config, bool is_main);

}  // namespace fsdp_gpt
