#include "block_quantization.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstring>

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

// One pass over each block for the common case (float32 values, int8 codes, on the CPU); the
// same arithmetic as the tensor operations below, so both give the same bits.
bool quantize_int8_on_cpu(const at::Tensor& packed, const at::Tensor& values, const BlockFormat& format) {
  if (format.dtype != QuantizedDtype::kInt8 || !values.device().is_cpu() || values.scalar_type() != at::kFloat ||
      !values.is_contiguous())
    return false;
  const int64_t n = values.numel(), nb = format.blocks(n), B = format.block;
  const float* x = values.data_ptr<float>();
  uint8_t* base = packed.data_ptr<uint8_t>();
  auto* codes = reinterpret_cast<int8_t*>(base + 4 * nb);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t start = b * B, end = std::min(n, start + B);
    float amax = 0;
    for (int64_t i = start; i < end; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / 127.0f;
    std::memcpy(base + 4 * b, &scale, sizeof(float));
    const float divisor = scale > 0 ? scale : 1.0f;
    // Clamped first (the same codes as rounding first), then rounded to nearest, ties to even,
    // by adding and subtracting 1.5 x 2^23: vectorizable, unlike a call to nearbyint.
    constexpr float kRound = 12582912.0f;
    for (int64_t i = start; i < end; ++i)
      codes[i] = static_cast<int8_t>((std::min(127.0f, std::max(-127.0f, x[i] / divisor)) + kRound) - kRound);
    for (int64_t i = end; i < start + B; ++i) codes[i] = 0;
  }
  return true;
}

template <typename Out>
void dequantize_int8(Out* out, const uint8_t* base, int64_t count, int64_t numel, const BlockFormat& format) {
  const int64_t nb = format.blocks(numel), B = format.block, per = format.packed_bytes(numel);
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* part = base + r * per;
    const auto* codes = reinterpret_cast<const int8_t*>(part + 4 * nb);
    Out* dst = out + r * numel;
    for (int64_t b = 0; b < nb; ++b) {
      float scale;
      std::memcpy(&scale, part + 4 * b, sizeof(float));
      const int64_t end = std::min(numel, (b + 1) * B);
      for (int64_t i = b * B; i < end; ++i) dst[i] = static_cast<Out>(static_cast<float>(codes[i]) * scale);
    }
  }
}

bool dequantize_int8_on_cpu(const at::Tensor& out, const at::Tensor& packed, int64_t count, int64_t numel,
                            const BlockFormat& format) {
  if (format.dtype != QuantizedDtype::kInt8 || !out.device().is_cpu() || !out.is_contiguous() ||
      !packed.is_contiguous())
    return false;
  const uint8_t* base = packed.data_ptr<uint8_t>();
  switch (out.scalar_type()) {
    case at::kFloat: dequantize_int8(out.data_ptr<float>(), base, count, numel, format); return true;
    case at::kBFloat16: dequantize_int8(out.data_ptr<at::BFloat16>(), base, count, numel, format); return true;
    default: return false;
  }
}

}  // namespace

bool has_float8() { return kHasFloat8; }

void quantize_into(const at::Tensor& packed, const at::Tensor& values, const BlockFormat& format) {
  const int64_t n = values.numel(), nb = format.blocks(n), B = format.block;
  FSDP_CHECK(packed.scalar_type() == at::kByte && packed.numel() == format.packed_bytes(n),
             "quantize_into: the packed buffer holds ", packed.numel(), " bytes, not ", format.packed_bytes(n));
  if (n == 0 || quantize_int8_on_cpu(packed, values, format)) return;
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
  if (numel == 0 || dequantize_int8_on_cpu(out, packed, count, numel, format)) return;
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
