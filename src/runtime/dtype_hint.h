#pragma once
// Under mixed precision, an operator that reads a unit's parameters in param_dtype together with a
// wider floating-point input (the model's own float32 input, or a float32 buffer that promoted a
// cast input back) fails in kernels that need one dtype; the hint names the operator, the
// parameter, its unit and the fix. See Note [Mixed precision] in docs/design.md.
#include <ATen/record_function.h>

#include <string>

#include "runtime/fsdp_state.h"

namespace fsdp {

// The hint for operator `fn` of `state`'s model, or "" when its inputs do not mix that way.
std::string mixed_precision_mismatch(const FsdpState& state, const at::RecordFunction& fn);

}  // namespace fsdp
