#include "block_quantization.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FSDP_QUANT_AVX2 1
#include <immintrin.h>
#endif

#include "cpu_features.h"
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

#if FSDP_QUANT_AVX2
// block_amax, 16 values at a time (the same operand order, so NaNs are passed over alike).
__attribute__((target("avx2"))) float block_amax_avx2(const float* x, int64_t len) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    m0 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), m0);
    m1 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i + 8), abs_mask), m1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  float amax = 0;
  for (const float v : lanes) amax = std::max(amax, v);
  for (; i < len; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// block_codes, 32 values at a time: the same operations in the same order on each value.
__attribute__((target("avx2"))) void block_codes_avx2(int8_t* codes, const float* x, int64_t len, float divisor) {
  constexpr float kRound = 12582912.0f;
  const __m256 d = _mm256_set1_ps(divisor), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f),
               round = _mm256_set1_ps(kRound);
  // packs works within 128-bit lanes: this puts the eight 4-code groups back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t i = 0;
  for (; i + 32 <= len; i += 32) {
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8 * k), d), lo), hi);
      q[k] = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(v, round), round));
    }
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm256_permutevar8x32_epi32(packed, order));
  }
  for (; i < len; ++i)
    codes[i] = static_cast<int8_t>((std::min(127.0f, std::max(-127.0f, x[i] / divisor)) + kRound) - kRound);
}

#endif

// The largest |x[i]| of one block; NaNs are passed over. AVX2 or SSE2 where the machine has it
// (the same result: max is exact and the vector max passes NaNs over as std::max does here).
float block_amax(const float* x, int64_t len) {
#if FSDP_QUANT_AVX2
  if (cpu_has_avx2()) return block_amax_avx2(x, len);
#endif
  float amax = 0;
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  __m128 m0 = _mm_setzero_ps(), m1 = _mm_setzero_ps();
  for (; i + 8 <= len; i += 8) {
    m0 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(x + i), abs_mask), m0);
    m1 = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(x + i + 4), abs_mask), m1);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(m0, m1));
  for (const float v : lanes) amax = std::max(amax, v);
#endif
  for (; i < len; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// codes[i] = x[i] / divisor clamped to [-127, 127] (a NaN to -127), then rounded to nearest, ties
// to even, by adding and subtracting 1.5 x 2^23. The SSE2 loop does the same operations in the
// same order on four values at once (AVX2: eight), so all give the same codes.
void block_codes(int8_t* codes, const float* x, int64_t len, float divisor) {
#if FSDP_QUANT_AVX2
  if (cpu_has_avx2()) return block_codes_avx2(codes, x, len, divisor);
#endif
  constexpr float kRound = 12582912.0f;
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 d = _mm_set1_ps(divisor), lo = _mm_set1_ps(-127.0f), hi = _mm_set1_ps(127.0f),
               round = _mm_set1_ps(kRound);
  for (; i + 16 <= len; i += 16) {
    __m128i q[4];
    for (int k = 0; k < 4; ++k) {
      const __m128 v = _mm_min_ps(_mm_max_ps(_mm_div_ps(_mm_loadu_ps(x + i + 4 * k), d), lo), hi);
      q[k] = _mm_cvttps_epi32(_mm_sub_ps(_mm_add_ps(v, round), round));
    }
    const __m128i packed = _mm_packs_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), packed);
  }
#endif
  for (; i < len; ++i)
    codes[i] = static_cast<int8_t>((std::min(127.0f, std::max(-127.0f, x[i] / divisor)) + kRound) - kRound);
}

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
    const int64_t start = b * B, len = std::min(n, start + B) - start;
    const float scale = block_amax(x + start, len) / 127.0f;
    std::memcpy(base + 4 * b, &scale, sizeof(float));
    block_codes(codes + start, x + start, len, scale > 0 ? scale : 1.0f);
    std::memset(codes + start + len, 0, B - len);
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

// out = the sum of `count` int8 packed buffers `stride` bytes apart, in order, in float32.
void sum_int8(float* out, const uint8_t* base, int64_t count, int64_t numel, int64_t stride,
              const BlockFormat& format) {
  const int64_t nb = format.blocks(numel), B = format.block;
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* part = base + r * stride;
    const auto* codes = reinterpret_cast<const int8_t*>(part + 4 * nb);
    for (int64_t b = 0; b < nb; ++b) {
      float scale;
      std::memcpy(&scale, part + 4 * b, sizeof(float));
      const int64_t end = std::min(numel, (b + 1) * B);
      if (r == 0)
        for (int64_t i = b * B; i < end; ++i) out[i] = static_cast<float>(codes[i]) * scale;
      else
        for (int64_t i = b * B; i < end; ++i) out[i] += static_cast<float>(codes[i]) * scale;
    }
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
  // The scales are computed apart and copied in as bytes: `packed` need not start 4-byte aligned.
  const at::Tensor scales = at::amax(x.abs(), {1}).div_(code_max(format.dtype));
  packed.narrow(0, 0, 4 * nb).copy_(scales.view(at::kByte));
  at::Tensor codes = packed.narrow(0, 4 * nb, nb * B).view(code_type(format.dtype)).view({nb, B});
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

void sum_dequantized_into(const at::Tensor& out, const at::Tensor& packed, int64_t count, int64_t numel, int64_t stride,
                          const BlockFormat& format) {
  const int64_t per = format.packed_bytes(numel);
  FSDP_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == numel && count >= 1 &&
                 stride >= per && packed.numel() >= (count - 1) * stride + per,
             "sum_dequantized_into: sizes do not match the format");
  if (numel == 0) return;
  if (format.dtype == QuantizedDtype::kInt8 && out.device().is_cpu() && packed.is_contiguous()) {
    sum_int8(out.data_ptr<float>(), packed.data_ptr<uint8_t>(), count, numel, stride, format);
    return;
  }
  dequantize_into(out, packed.narrow(0, 0, per), 1, numel, format);
  at::Tensor part = at::empty_like(out);
  for (int64_t r = 1; r < count; ++r) {
    dequantize_into(part, packed.narrow(0, r * stride, per), 1, numel, format);
    out.add_(part);
  }
}

void quantize_with_feedback(const at::Tensor& packed, const at::Tensor& values, const at::Tensor& residual,
                            const BlockFormat& format) {
  if (!residual.defined()) return quantize_into(packed, values, format);
  FSDP_CHECK(residual.scalar_type() == at::kFloat && residual.numel() == values.numel(),
             "quantize_with_feedback: the residual does not match the values");
  const at::Tensor sent = values.to(at::kFloat).reshape({-1}).add(residual);
  quantize_into(packed, sent, format);
  dequantize_into(residual, packed, 1, sent.numel(), format);
  at::Tensor(residual).neg_().add_(sent);  // sent - decoded, exactly
}

double error_bound(double block_max, const BlockFormat& format) {
  // int8: half a code step; float8 e4m3 (3 mantissa bits): half an ulp, at most 2^-4 of the
  // value. Plus float32's own rounding of the division and the product.
  const double rounding = block_max * 1e-6;
  if (format.dtype == QuantizedDtype::kInt8) return 0.5 * block_max / code_max(format.dtype) + rounding;
  return block_max * std::ldexp(1.0, -4) + rounding;
}

}  // namespace fsdp
