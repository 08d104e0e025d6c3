#pragma once
// The errors for uses of a sharded module's parameters that sharding cannot honour, each naming the
// fix.
#include <string>

namespace fsdp {

// An in-place write by operator `op` to `what` (a parameter of a sharded module, or a tensor over
// its storage): the write is lost at the next reshard.
std::string in_place_write_error(const char* op, const std::string& what);

// A managed parameter whose data no longer lives in FSDP's storage (without the "libfsdp: " prefix).
std::string replaced_parameter_error(const std::string& name);

// Operator `op` read a tensor over parameter `name`'s storage from before fully_shard().
std::string retired_storage_error(const char* op, const std::string& name);

// Operator `op` read the gradient placeholder of parameter `name` (Note [Gradient sentinel]).
std::string placeholder_read_error(const char* op, const std::string& name);

}  // namespace fsdp
