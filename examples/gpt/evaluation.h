#pragma once
// The loss, the validation loss, and sampling text from the model.
#include <torch/torch.h>

#include <string>

#include "data.h"
#include "model.h"
#include "train_config.h"

namespace fsdp_gpt {

// Mean cross-entropy of the next byte over `batch` (in float32 under mixed precision).
torch::Tensor next_token_loss(gpt::GPT& model, const gpt::Batch& batch);

// Mean loss over a fixed set of held-out batches. Every rank evaluates the same batches (the
// forwards are collective), so every rank gets the same number without a reduction.
double validation_loss(gpt::GPT& model, const torch::Tensor& tokens, const TrainConfig& c);

// Samples `bytes` tokens after `prompt`, feeding back at most `context` tokens each time. Every
// rank runs it with the same generator seed, so all ranks agree on every token.
std::string generate(gpt::GPT& model, const std::string& prompt, const TrainConfig& c);

}  // namespace fsdp_gpt
