#pragma once
// What the checkpoint code needs from the communicators: every rank's string, and agreement on
// failure (a step that fails on one rank fails on all, instead of leaving the others waiting in
// the next collective).
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "fsdp/comm.h"

namespace fsdp::checkpoint::detail {

// Collective over `comm`: every member's `mine`, in rank order.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);
// Collective: runs `local` here; if it threw on any member, throws on every member, naming the
// first failing rank and its message (prefixed by `what`).
void run_agreed(Communicator& comm, const std::string& what, const std::function<void()>& local);
// A random 64-bit value, the same on every member (drawn by rank 0).
uint64_t shared_random(Communicator& comm);

// safetensors dtype names of LibTorch dtypes (F32, BF16, ...); throws for others.
std::string dtype_name(at::ScalarType type);
at::ScalarType scalar_type_of(const std::string& name);

}  // namespace fsdp::checkpoint::detail
