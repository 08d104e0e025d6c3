#pragma once
// The casts of mixed precision around a unit's forward (MixedPrecision in fsdp/options.h): inputs
// to the compute dtype, outputs to output_dtype. See Note [Mixed precision] in docs/design.md.
#include <torch/torch.h>

#include "fsdp/options.h"

namespace fsdp {

// `t` cast to `dtype` if both are floating point and they differ (differentiable).
at::Tensor cast_floating(at::Tensor t, const c10::optional<at::ScalarType>& dtype);
// A forward input: to param_dtype when MixedPrecision::cast_forward_inputs is on.
at::Tensor cast_forward_input(const MixedPrecision& mp, at::Tensor input);
// A forward output: to MixedPrecision::output_dtype when set.
at::Tensor cast_forward_output(const MixedPrecision& mp, at::Tensor output);

}  // namespace fsdp
