#include "mixed_precision.h"

namespace fsdp {

at::Tensor cast_floating(at::Tensor t, const c10::optional<at::ScalarType>& dtype) {
  if (!dtype || !t.defined() || !t.is_floating_point() || t.scalar_type() == *dtype) return t;
  return t.to(*dtype);
}

at::Tensor cast_forward_input(const MixedPrecision& mp, at::Tensor input) {
  return mp.cast_forward_inputs() ? cast_floating(std::move(input), mp.param_dtype()) : input;
}

at::Tensor cast_forward_output(const MixedPrecision& mp, at::Tensor output) {
  return cast_floating(std::move(output), mp.output_dtype());
}

}  // namespace fsdp
