#pragma once
// What the GPT's modules compute beyond the planner's rules (fsdp::PlanRequest::module_cost).
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace gpt {

// Attention's two products over the context and its softmax, the MLP's GELU input, and the loss's
// log-softmax over the vocabulary, per token, for modules of model.h; nothing for the others.
fsdp::ModuleCost module_cost(const std::string& name, const torch::nn::Module& module, int64_t seq_len);

}  // namespace gpt
