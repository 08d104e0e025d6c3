#pragma once
// Gradient clipping across shards: the total norm over every rank's pieces, each element counted
// once (Note [Clipping across shards] in docs/design.md).
#include "runtime/fsdp_state.h"

namespace fsdp {

// Collective over the shard group; returns the total norm before clipping, equal on every rank.
double clip_grad_norm(FsdpState& state, double max_norm, double norm_type);

}  // namespace fsdp
