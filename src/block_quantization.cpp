#include "block_quantization.h"

#include <torch/version.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

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

// float8 e4m3fn's code of `f`, as LibTorch's conversion gives it: rounded to nearest, ties to even,
// onto 3 bits below the leading one (exponents from -6, subnormals on a grid of 2^-9); from 480 up,
// infinities and NaNs: the NaN code. Bit operations only, so any LibTorch can run it.
uint8_t e4m3_code(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  bits &= 0x7fffffff;
  if (bits >= 0x43f00000) return sign | 0x7f;  // 480 and beyond
  if (bits < 0x3c800000) {                     // below 2^-6: multiples of 2^-9
    float magnitude;
    std::memcpy(&magnitude, &bits, sizeof magnitude);
    return sign | static_cast<uint8_t>(std::nearbyint(magnitude * 512.0f));
  }
  bits += 0x7ffff + ((bits >> 20) & 1);                             // round the 23-bit mantissa to 3 bits, ties to even
  return sign | static_cast<uint8_t>((bits - (120u << 23)) >> 20);  // exponent bias 127 to 7
}

#if FSDP_QUANT_AVX2
// block_amax, 16 values at a time.
__attribute__((target("avx2"))) float block_amax_avx2(const float* x, int64_t len) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(_mm256_and_ps(a, abs_mask), m0);
    m1 = _mm256_max_ps(_mm256_and_ps(b, abs_mask), m1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  float amax = _mm256_movemask_ps(nan) != 0 ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  for (const float v : lanes) amax = std::max(amax, v);
  for (; i < len; ++i) amax = std::isnan(x[i]) ? x[i] : std::max(amax, std::fabs(x[i]));
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

// e4m3_code of eight values: the same integer operations on each lane (the subnormal case rounds
// by the conversion's mode, as nearbyint does).
__attribute__((target("avx2"))) __m256i e4m3_codes8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(mag, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff), odd));
  const __m256i normal = _mm256_srli_epi32(_mm256_sub_epi32(rounded, _mm256_set1_epi32(120 << 23)), 20);
  const __m256i small = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(512.0f)));
  __m256i code = _mm256_blendv_epi8(normal, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), mag));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x43efffff)));
  return _mm256_or_si256(code, sign);
}

// e4m3 codes of x[i] / divisor, 32 values at a time, equal to e4m3_code's.
__attribute__((target("avx2"))) void block_e4m3_codes_avx2(uint8_t* codes, const float* x, int64_t len, float divisor) {
  const __m256 d = _mm256_set1_ps(divisor);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t i = 0;
  for (; i + 32 <= len; i += 32) {
    __m256i q[4];
    for (int k = 0; k < 4; ++k) q[k] = e4m3_codes8(_mm256_div_ps(_mm256_loadu_ps(x + i + 8 * k), d));
    const __m256i packed = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm256_permutevar8x32_epi32(packed, order));
  }
  for (; i < len; ++i) codes[i] = e4m3_code(x[i] / divisor);
}

// The values of eight e4m3 codes, equal to e4m3_values()' (a NaN code: a quiet NaN).
__attribute__((target("avx2"))) __m256 e4m3_values8(const uint8_t* codes) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
  const __m256 small = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512));
  __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), small,
                              _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                       _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f))));
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

// out[i] = e4m3 value(codes[i]) * scale, or out[i] += it: the scalar loops' product and sum, 8 at a
// time. Returns how many it did (a multiple of 8); the caller does the rest.
__attribute__((target("avx2"))) int64_t e4m3_decode_avx2(float* out, const uint8_t* codes, int64_t len, float scale,
                                                         bool add) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 v = _mm256_mul_ps(e4m3_values8(codes + i), s);
    if (add) v = _mm256_add_ps(_mm256_loadu_ps(out + i), v);
    _mm256_storeu_ps(out + i, v);
  }
  return i;
}

#endif

// The largest |x[i]| of one block, NaN where the block holds one (as at::amax gives), so that the
// block decodes to NaNs (Note [Quantized communication], non-finite values). AVX2 or SSE2 where the
// machine has it (the same result: max is exact, and a NaN is found apart from it).
float block_amax(const float* x, int64_t len) {
#if FSDP_QUANT_AVX2
  if (cpu_has_avx2()) return block_amax_avx2(x, len);
#endif
  float amax = 0;
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  __m128 m0 = _mm_setzero_ps(), m1 = _mm_setzero_ps(), nan = _mm_setzero_ps();
  for (; i + 8 <= len; i += 8) {
    const __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
    nan = _mm_or_ps(nan, _mm_cmpunord_ps(a, b));
    m0 = _mm_max_ps(_mm_and_ps(a, abs_mask), m0);
    m1 = _mm_max_ps(_mm_and_ps(b, abs_mask), m1);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(m0, m1));
  if (_mm_movemask_ps(nan) != 0) amax = std::numeric_limits<float>::quiet_NaN();
  for (const float v : lanes) amax = std::max(amax, v);
#endif
  for (; i < len; ++i) amax = std::isnan(x[i]) ? x[i] : std::max(amax, std::fabs(x[i]));
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

// The value of every e4m3fn code.
const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) {
      const int exponent = (c >> 3) & 0xf, mantissa = c & 7;
      const float magnitude = (c & 0x7f) == 0x7f ? std::numeric_limits<float>::quiet_NaN()
                              : exponent == 0    ? std::ldexp(static_cast<float>(mantissa), -9)
                                                 : std::ldexp(1.0f + static_cast<float>(mantissa) / 8, exponent - 7);
      t[c] = (c & 0x80) != 0 ? -magnitude : magnitude;
    }
    return t;
  }();
  return table;
}

// codes[i] = e4m3_code(x[i] / divisor); AVX2 where the machine has it (the same codes).
void block_e4m3_codes(uint8_t* codes, const float* x, int64_t len, float divisor) {
#if FSDP_QUANT_AVX2
  if (cpu_has_avx2()) return block_e4m3_codes_avx2(codes, x, len, divisor);
#endif
  for (int64_t i = 0; i < len; ++i) codes[i] = e4m3_code(x[i] / divisor);
}

// One pass over each block for the common case (float32 values on the CPU); the same arithmetic
// as the tensor operations below, so both give the same bits.
bool quantize_on_cpu(const at::Tensor& packed, const at::Tensor& values, const BlockFormat& format, int64_t origin) {
  if (!values.device().is_cpu() || values.scalar_type() != at::kFloat || !values.is_contiguous() ||
      !packed.is_contiguous())
    return false;
  const bool int8 = format.dtype == QuantizedDtype::kInt8;
  const int64_t n = values.numel();
  const float* x = values.data_ptr<float>();
  uint8_t* base = packed.data_ptr<uint8_t>();
  uint8_t* codes = base + 4 * format.blocks(n, origin);
  const auto code_max_f = static_cast<float>(code_max(format.dtype));
  int64_t b = 0;
  format.for_each_block(origin, n, [&](int64_t start, int64_t len) {
    const float scale = block_amax(x + start, len) / code_max_f, divisor = scale > 0 ? scale : 1.0f;
    std::memcpy(base + 4 * b++, &scale, sizeof(float));
    if (int8) {
      block_codes(reinterpret_cast<int8_t*>(codes + start), x + start, len, divisor);
      return;
    }
    block_e4m3_codes(codes + start, x + start, len, divisor);
  });
  return true;
}

// A code's value: int8's integer, or e4m3fn's from the table.
struct Int8Codes {
  float operator()(uint8_t c) const { return static_cast<float>(static_cast<int8_t>(c)); }
};
struct E4m3Codes {
  const std::array<float, 256>& values = e4m3_values();
  float operator()(uint8_t c) const { return values[c]; }
};

// f(decode) with the format's decoder.
template <typename F>
void with_codes(QuantizedDtype dtype, F f) {
  if (dtype == QuantizedDtype::kInt8) return f(Int8Codes{});
  f(E4m3Codes{});
}

// out[i] = decode(codes[i]) * scale, or out[i] += it. int8's loop is the compiler's to vectorize;
// e4m3's table lookups are not, so it takes AVX2 where the machine has it (the same bits).
template <typename Decode>
void decode_block(float* out, const uint8_t* codes, int64_t len, float scale, Decode decode, bool add) {
  int64_t i = 0;
#if FSDP_QUANT_AVX2
  if (std::is_same_v<Decode, E4m3Codes> && cpu_has_avx2()) i = e4m3_decode_avx2(out, codes, len, scale, add);
#endif
  if (add)
    for (; i < len; ++i) out[i] += decode(codes[i]) * scale;
  else
    for (; i < len; ++i) out[i] = decode(codes[i]) * scale;
}

template <typename Out, typename Decode>
void dequantize_blocks(Out* out, const uint8_t* part, int64_t numel, const BlockFormat& format, int64_t origin,
                       Decode decode) {
  const uint8_t* codes = part + 4 * format.blocks(numel, origin);
  int64_t b = 0;
  format.for_each_block(origin, numel, [&](int64_t start, int64_t len) {
    float scale;
    std::memcpy(&scale, part + 4 * b++, sizeof(float));
    if constexpr (std::is_same_v<Out, float>)
      decode_block(out + start, codes + start, len, scale, decode, false);
    else
      for (int64_t i = start; i < start + len; ++i) out[i] = static_cast<Out>(decode(codes[i]) * scale);
  });
}

template <typename Out>
void dequantize_part(Out* out, const uint8_t* part, int64_t numel, const BlockFormat& format, int64_t origin) {
  with_codes(format.dtype, [&](auto decode) { dequantize_blocks(out, part, numel, format, origin, decode); });
}

bool dequantize_on_cpu(const at::Tensor& out, const at::Tensor& packed, const BlockFormat& format, int64_t origin) {
  if (!out.device().is_cpu() || !out.is_contiguous() || !packed.is_contiguous()) return false;
  const uint8_t* part = packed.data_ptr<uint8_t>();
  switch (out.scalar_type()) {
    case at::kFloat: dequantize_part(out.data_ptr<float>(), part, out.numel(), format, origin); return true;
    case at::kBFloat16: dequantize_part(out.data_ptr<at::BFloat16>(), part, out.numel(), format, origin); return true;
    default: return false;
  }
}

// out = the sum of `count` packed forms `stride` bytes apart, in order, in float32.
template <typename Decode>
void sum_parts(float* out, const uint8_t* base, int64_t count, int64_t numel, int64_t stride, const BlockFormat& format,
               int64_t origin, Decode decode) {
  const int64_t nb = format.blocks(numel, origin);
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* part = base + r * stride;
    const uint8_t* codes = part + 4 * nb;
    int64_t b = 0;
    format.for_each_block(origin, numel, [&](int64_t start, int64_t len) {
      float scale;
      std::memcpy(&scale, part + 4 * b++, sizeof(float));
      decode_block(out + start, codes + start, len, scale, decode, r > 0);
    });
  }
}

}  // namespace

bool has_float8() { return kHasFloat8; }

std::shared_ptr<const std::vector<int64_t>> parameter_cuts(std::vector<int64_t> starts, int64_t numel) {
  std::sort(starts.begin(), starts.end());
  auto cuts = std::make_shared<std::vector<int64_t>>();
  for (const int64_t s : starts)
    if (s > 0 && s < numel && (cuts->empty() || cuts->back() != s)) cuts->push_back(s);
  return cuts;
}

void quantize_into(const at::Tensor& packed, const at::Tensor& values, const BlockFormat& format, int64_t origin) {
  const int64_t n = values.numel(), nb = format.blocks(n, origin), B = format.block;
  FSDP_CHECK(packed.scalar_type() == at::kByte && packed.numel() == 4 * nb + n,
             "quantize_into: the packed buffer holds ", packed.numel(), " bytes, not ", 4 * nb + n);
  if (n == 0 || quantize_on_cpu(packed, values, format, origin)) return;
  const at::Tensor all = values.to(at::kFloat).reshape({-1});
  int64_t b0 = 0;
  format.for_each_segment(origin, n, [&](int64_t start, int64_t len) {
    const int64_t Bs = std::min(B, len), nb_s = 1 + (len - 1) / Bs;  // the same blocks, padded to len at most
    at::Tensor x = all.narrow(0, start, len);
    if (nb_s * Bs != len) x = at::constant_pad_nd(x, {0, nb_s * Bs - len});
    x = x.view({nb_s, Bs});
    // The scales are computed apart and copied in as bytes: they need not start 4-byte aligned.
    const at::Tensor scales = at::amax(x.abs(), {1}).div_(code_max(format.dtype));
    packed.narrow(0, 4 * b0, 4 * nb_s).copy_(scales.view(at::kByte));
    // A block of zeros keeps scale 0 and codes 0; dividing by 1 there avoids 0/0.
    const at::Tensor divisor = at::where(scales > 0, scales, at::ones_like(scales)).unsqueeze(1);
    const at::Tensor codes = format.dtype == QuantizedDtype::kInt8
                                 ? at::round(x / divisor).clamp_(-127, 127).to(at::kChar)
                                 : (x / divisor).to(code_type(format.dtype));  // rounded in the 8-bit float's grid
    packed.narrow(0, 4 * nb + start, len).copy_(codes.reshape({-1}).narrow(0, 0, len).view(at::kByte));
    b0 += nb_s;
  });
}

void dequantize_into(const at::Tensor& out, const at::Tensor& packed, const BlockFormat& format, int64_t origin) {
  const int64_t n = out.numel(), nb = format.blocks(n, origin), B = format.block;
  FSDP_CHECK(packed.numel() == 4 * nb + n, "dequantize_into: sizes do not match the format");
  if (n == 0 || dequantize_on_cpu(out, packed, format, origin)) return;
  const at::Tensor flat = out.view({-1});
  int64_t b0 = 0;
  format.for_each_segment(origin, n, [&](int64_t start, int64_t len) {
    const int64_t Bs = std::min(B, len), nb_s = 1 + (len - 1) / Bs;
    // A copy of the scales (a part need not start 4-byte aligned).
    const at::Tensor scales = packed.narrow(0, 4 * b0, 4 * nb_s).clone().view(at::kFloat).unsqueeze(1);
    at::Tensor codes = packed.narrow(0, 4 * nb + start, len).view(code_type(format.dtype)).to(at::kFloat);
    if (nb_s * Bs != len) codes = at::constant_pad_nd(codes, {0, nb_s * Bs - len});
    flat.narrow(0, start, len).copy_((codes.view({nb_s, Bs}) * scales).view({-1}).narrow(0, 0, len));
    b0 += nb_s;
  });
}

void sum_dequantized_into(const at::Tensor& out, const at::Tensor& packed, int64_t count, int64_t stride,
                          const BlockFormat& format, int64_t origin) {
  const int64_t numel = out.numel(), per = format.packed_bytes(numel, origin);
  FSDP_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && count >= 1 && stride >= per &&
                 packed.numel() >= (count - 1) * stride + per,
             "sum_dequantized_into: sizes do not match the format");
  if (numel == 0) return;
  if (out.device().is_cpu() && packed.is_contiguous()) {
    float* o = out.data_ptr<float>();
    const uint8_t* base = packed.data_ptr<uint8_t>();
    with_codes(format.dtype, [&](auto decode) { sum_parts(o, base, count, numel, stride, format, origin, decode); });
    return;
  }
  dequantize_into(out, packed.narrow(0, 0, per), format, origin);
  at::Tensor part = at::empty_like(out);
  for (int64_t r = 1; r < count; ++r) {
    dequantize_into(part, packed.narrow(0, r * stride, per), format, origin);
    out.add_(part);
  }
}

void quantize_with_feedback(const at::Tensor& packed, const at::Tensor& values, const at::Tensor& residual,
                            const BlockFormat& format, int64_t origin) {
  if (!residual.defined()) return quantize_into(packed, values, format, origin);
  FSDP_CHECK(residual.scalar_type() == at::kFloat && residual.numel() == values.numel(),
             "quantize_with_feedback: the residual does not match the values");
  const at::Tensor sent = values.to(at::kFloat).reshape({-1}).add(residual);
  quantize_into(packed, sent, format, origin);
  dequantize_into(residual, packed, format, origin);
  at::Tensor(residual).neg_().add_(sent);  // sent - decoded, exactly
  // A non-finite value is not fed back: it would reach every later step's sums.
  at::Tensor(residual).nan_to_num_(0.0, 0.0, 0.0);
}

void quantize_into_slot(const at::Tensor& slot, const at::Tensor& values, const at::Tensor& residual,
                        const BlockFormat& format, int64_t origin) {
  const int64_t used = format.packed_bytes(values.numel(), origin);
  FSDP_CHECK(slot.numel() >= used, "quantize_into_slot: the slot holds ", slot.numel(), " bytes, not ", used);
  quantize_with_feedback(slot.narrow(0, 0, used), values, residual, format, origin);
  if (used < slot.numel()) slot.narrow(0, used, slot.numel() - used).zero_();
}

double error_bound(double block_max, const BlockFormat& format) {
  // int8: half a code step; float8 e4m3 (3 mantissa bits): half an ulp, at most 2^-4 of the
  // value. Plus float32's own rounding of the division and the product.
  const double rounding = block_max * 1e-6;
  if (format.dtype == QuantizedDtype::kInt8) return 0.5 * block_max / code_max(format.dtype) + rounding;
  return block_max * std::ldexp(1.0, -4) + rounding;
}

}  // namespace fsdp
