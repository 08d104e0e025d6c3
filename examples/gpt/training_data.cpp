#include "training_data.h"

#include <algorithm>
#include <iostream>
#include <optional>

namespace fsdp_gpt {

std::optional<TrainingData> load_data(const TrainConfig& config, bool is_main) {
  TrainingData data{config.data.empty() ? gpt::load_fortunes() : gpt::load_text_file(config.data), {}};
  data.splits = gpt::split_train_validation(gpt::encode(data.corpus.text));
  const auto& splits = data.splits;
  if (std::min(splits.train.numel(), splits.validation.numel()) <= config.context + 1) {
    if (is_main)
      std::cerr << "error: the text has " << data.corpus.text.size() << " bytes, split into " << splits.train.numel()
                << " for training and " << splits.validation.numel() << " for validation; each must be longer "
                << "than --context " << config.context << " + 1. Use a longer text or a shorter context.\n";
    return std::nullopt;
  }
  return data;
}

}  // namespace fsdp_gpt
