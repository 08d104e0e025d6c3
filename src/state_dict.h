#pragma once
// State dicts: full (unsharded) parameters and buffers by name, gathered unit by unit.
#include <string>
#include <unordered_map>

#include "runtime/fsdp_state.h"

namespace fsdp {

// Collective: every rank gets every parameter (cloned, under each of its names) and buffer.
std::unordered_map<std::string, at::Tensor> full_state_dict(FsdpState& state);
// Collective: each rank copies its part of the named full tensors into its shards, and the buffers.
void load_full_state_dict(FsdpState& state, const std::unordered_map<std::string, at::Tensor>& values);

}  // namespace fsdp
