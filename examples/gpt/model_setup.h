#pragma once
// The model and its optimizer as the flags ask: built (eagerly or deferred), sharded with
// fully_shard, and AdamW over the shards.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "model.h"
#include "train_config.h"

namespace fsdp_gpt {

// Falls back to --init eager, saying so on rank 0, where this LibTorch cannot defer initialization.
void resolve_init(TrainConfig& config, int rank);

// The model before sharding, with what the optimizer and the report need to know of it.
struct BuiltModel {
  gpt::GPTConfig config;
  gpt::GPT model{nullptr};
  int64_t parameter_count = 0;
};

// The model as it would be built without FSDP, seeded with --seed (deferred: no parameter memory).
BuiltModel build_model(const TrainConfig& config);

// --quantize-block's quantization in `dtype` ("none": off), without error feedback.
fsdp::Quantization quantization_flags(const TrainConfig& config, const std::string& dtype);
// --quantize-reduce's, with --quantize-error-feedback.
fsdp::Quantization reduce_quantization_flags(const TrainConfig& config);

// --reshard-after-forward's per-block choice; null for "strategy" (each strategy's own).
fsdp::ReshardPolicy reshard_policy(const TrainConfig& config);

// fully_shard with the flags' strategy, prefetching and wrapping; initializes deferred units.
std::shared_ptr<fsdp::FullyShardedModule> shard_model(BuiltModel& built, const TrainConfig& config,
                                                      fsdp::ProcessGroupPtr pg);

// AdamW over the shard pieces, weight decay on the pieces of matrices only; checked by FSDP.
std::unique_ptr<torch::optim::Optimizer> build_optimizer(fsdp::FullyShardedModule& sharded, const TrainConfig& config);

}  // namespace fsdp_gpt
