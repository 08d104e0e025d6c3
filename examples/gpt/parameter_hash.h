#pragma once
// The final parameter hash: one 64-bit FNV-1a hash of every parameter's name, dtype, shape and
// bytes, in name order, so that runs can be compared bit for bit at any world size.
#include <fsdp/fsdp.h>

#include <cstdint>
#include <string>

namespace fsdp_gpt {

// Collective (gathers each unit's full parameters in turn); the same on every rank.
uint64_t parameter_hash(fsdp::FullyShardedModule& sharded);

// The hash as 16 lowercase hex digits.
std::string hex16(uint64_t value);

}  // namespace fsdp_gpt
