#include "block_quantization.h"

#include <torch/version.h>

#include <cmath>

#include "fsdp/check.h"

namespace fsdp {
namespace {

// The largest code magnitude: int8 symmetric (-127..127), float8 e4m3fn's largest finite value.
double code_max(QuantizedDtype d) { return d == QuantizedDtype::kInt8 ? 127.0 : 448.0; }

#if TORCH_VERSION_MAJOR >= 2 && TORCH_VERSION_MINOR >= 1 || TORCH_VERSION_MAJOR >= 3
constexpr bool kHasFloat8 = true;
at::ScalarType float8_type() { return at::kFloat8_e4m3fn; }
#else
constexpr bool kHasFloat8 = false;
at::ScalarType float8_type() { FSDP_FAIL("float8 quantization needs LibTorch 2.1 or later"); }
#endif

at::ScalarType code_type(QuantizedDtype d) { return d == QuantizedDtype::kInt8 ? at::kChar : float8_type(); }

}  // namespace

bool has_float8() { return kHasFloat8; }

void quantize_into(const at::Tensor& packed, const at::Tensor& values, const BlockFormat& format) {
  const int64_t n = values.numel(), nb = format.blocks(n), B = format.block;
  FSDP_CHECK(packed.scalar_type() == at::kByte && packed.numel() == format.packed_bytes(n),
             "quantize_into: the packed buffer holds ", packed.numel(), " bytes, not ", format.packed_bytes(n));
  if (n == 0) return;
  at::Tensor x = values.to(at::kFloat).reshape({-1});
  if (nb * B != n) x = at::constant_pad_nd(x, {0, nb * B - n});
  x = x.view({nb, B});
  at::Tensor scales = packed.narrow(0, 0, 4 * nb).view(at::kFloat);
  at::Tensor codes = packed.narrow(0, 4 * nb, nb * B).view(code_type(format.dtype)).view({nb, B});
  at::amax_out(scales, x.abs(), {1});
  scales.div_(code_max(format.dtype));
  // A block of zeros keeps scale 0 and codes 0; dividing by 1 there avoids 0/0.
  const at::Tensor divisor = at::where(scales > 0, scales, at::ones_like(scales)).unsqueeze(1);
  if (format.dtype == QuantizedDtype::kInt8)
    codes.copy_(at::round(x / divisor).clamp_(-127, 127));
  else
    codes.copy_(x / divisor);  // round to nearest in the 8-bit float's own grid
}

void dequantize_into(const at::Tensor& out, const at::Tensor& packed, int64_t count, int64_t numel,
                     const BlockFormat& format) {
  const int64_t nb = format.blocks(numel), B = format.block, per = format.packed_bytes(numel);
  FSDP_CHECK(packed.numel() == count * per && out.numel() == count * numel,
             "dequantize_into: sizes do not match the format");
  if (numel == 0) return;
  at::Tensor all = packed.view({count, per});
  // One copy of the scales (rank r's start at byte r * per, not 4-byte aligned in general).
  at::Tensor scales = all.narrow(1, 0, 4 * nb).clone().reshape({-1}).view(at::kFloat).view({count, nb, 1});
  at::Tensor codes = all.narrow(1, 4 * nb, nb * B).view(code_type(format.dtype)).view({count, nb, B});
  at::Tensor values = (codes.to(at::kFloat) * scales).view({count, nb * B});
  out.view({count, numel}).copy_(values.narrow(1, 0, numel));
}

double error_bound(double block_max, const BlockFormat& format) {
  // int8: half a code step; float8 e4m3 (3 mantissa bits): half an ulp, at most 2^-4 of the
  // value. Plus float32's own rounding of the division and the product.
  const double rounding = block_max * 1e-6;
  if (format.dtype == QuantizedDtype::kInt8) return 0.5 * block_max / code_max(format.dtype) + rounding;
  return block_max * std::ldexp(1.0, -4) + rounding;
}

}  // namespace fsdp
