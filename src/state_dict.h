#pragma once
// State dicts: full (unsharded) parameters and buffers by name, gathered unit by unit.
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/fsdp_state.h"

namespace fsdp {

// Collective: every rank gets every parameter (cloned, under each of its names) and buffer.
std::unordered_map<std::string, at::Tensor> full_state_dict(FsdpState& state);
// FullyShardedModule::full_state_names and visit_full_state.
std::vector<std::string> full_state_names(const FsdpState& state);
void visit_full_state(FsdpState& state, const std::vector<std::string>& names,
                      const std::function<void(const std::string&, const at::Tensor&)>& visit);
// Collective: each rank copies its part of the named full tensors into its shards, and the buffers.
void load_full_state_dict(FsdpState& state, const std::unordered_map<std::string, at::Tensor>& values);

}  // namespace fsdp
