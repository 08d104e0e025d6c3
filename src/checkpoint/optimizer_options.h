#pragma once
// A parameter group's options as a checkpoint's manifest holds them (JSON), for each optimizer kind
// that checkpoints carry (checkpoint/optimizer_state.h).
#include <torch/torch.h>

#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/optimizer_state.h"

namespace fsdp::checkpoint::detail {

nlohmann::json group_options(OptimizerKind kind, const torch::optim::OptimizerOptions& options);
// Sets the options saved by group_options; throws naming `where` if a field is missing or mistyped.
void restore_group_options(OptimizerKind kind, const nlohmann::json& saved, torch::optim::OptimizerOptions& options,
                           const std::string& where);

}  // namespace fsdp::checkpoint::detail
