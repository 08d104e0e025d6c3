#pragma once
// StateAccess: libfsdp's own code (state dicts, checkpoints) reaches the FsdpState behind a
// FullyShardedModule; users never see it.
#include "fsdp/fully_shard.h"
#include "runtime/fsdp_state.h"

namespace fsdp::detail {

struct StateAccess {
  static FsdpState& of(FullyShardedModule& module) { return *module.state_; }
  static const FsdpState& of(const FullyShardedModule& module) { return *module.state_; }
};

}  // namespace fsdp::detail
