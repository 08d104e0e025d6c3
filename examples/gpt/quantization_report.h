#pragma once
// --quantization-report: how far quantized communication moves each parameter and gradient from
// what the unquantized collectives deliver, at the trained weights, for int8 (and fp8 where
// LibTorch has it) at each block size asked for.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include "model_setup.h"
#include "train_config.h"

namespace fsdp_gpt {

// Collective. Builds copies of the model with the trained weights: per format, one whose gathers
// are quantized and one whose reductions are, against one with neither; compares the gathered
// parameters and one batch's gradients tensor by tensor. Rank 0 prints the tables.
void report_quantization_error(const TrainConfig& config, fsdp::FullyShardedModule& trained,
                               const fsdp::ProcessGroupPtr& pg, const torch::Tensor& train_tokens, bool is_main);

}  // namespace fsdp_gpt
