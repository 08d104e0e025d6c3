#pragma once
// A norm of a shard piece's gradient is the norm of this rank's part of the parameter only: LibTorch's
// clip_grad_norm_ over FullyShardedModule::parameters() clips each rank by its own part. The note
// names the operator, the parameter and FSDP's clip_grad_norm_. See Note [Norms of shard pieces].
#include <ATen/record_function.h>

#include <string>

#include "runtime/fsdp_state.h"

namespace fsdp {

// Whether operator `op` takes a norm (norm, linalg_vector_norm, linalg_norm, frobenius_norm, _foreach_norm).
bool is_norm_op(const char* op);

// The note for norm operator `fn` reading tensor `t`, or "" when `t` is no sharded piece's gradient.
std::string shard_norm_note(FsdpState& state, const at::RecordFunction& fn, const at::Tensor& t);

}  // namespace fsdp
