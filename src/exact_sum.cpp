#include "exact_sum.h"

#include <ATen/Dispatch.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_features.h"

namespace fsdp::exact {

namespace {

constexpr double kLimbBase = 4294967296.0;  // 2^32
constexpr int kRangeExp = 88;               // |value| * 2^scale_exp below 2^kRangeExp: top parts below 2^24

// x * 2^e, exact for any e a double's exponent range allows (ldexp over a tensor).
at::Tensor times_pow2(const at::Tensor& x, int e) {
  at::Tensor y = x;
  while (e != 0) {
    const int step = std::clamp(e, -512, 512);
    y = y * std::ldexp(1.0, step);
    e -= step;
  }
  return y;
}

// Whether deposit() loops over these itself: host tensors, limbs of one layout with unit inner stride.
bool on_cpu(const at::Tensor& values, const at::Tensor limbs[kLimbs]) {
  if (!values.device().is_cpu() || limbs[0].dim() < 1 || limbs[0].dim() > 2 || limbs[0].stride(-1) != 1) return false;
  for (int j = 0; j < kLimbs; ++j)
    if (!limbs[j].device().is_cpu() || limbs[j].sizes() != limbs[0].sizes() || limbs[j].strides() != limbs[0].strides())
      return false;
  return values.numel() == limbs[0].numel();
}

// The parts of trunc(v) for |v| below 2^kRangeExp, as deposit() splits them (each part with v's
// sign): a conversion to int64 truncates, and removing the parts above is exact in double.
struct Parts {
  int64_t lo, mid, top;
};
inline Parts split(double v) {
  const auto top = static_cast<int64_t>(v * (1.0 / (kLimbBase * kLimbBase)));
  const double rest = v - static_cast<double>(top) * (kLimbBase * kLimbBase);
  const auto mid = static_cast<int64_t>(rest * (1.0 / kLimbBase));
  return {static_cast<int64_t>(rest - static_cast<double>(mid) * kLimbBase), mid, top};
}

// The same parts in one pass over one row, added to the limbs or (Overwrite) written over them.
template <bool Overwrite, typename T>
void deposit_row(const T* __restrict in, int64_t n, int64_t* __restrict lo, int64_t* __restrict mid,
                 int64_t* __restrict top, int scale_exp) {
  const double scale = std::ldexp(1.0, scale_exp), range = std::ldexp(1.0, kRangeExp);
  for (int64_t c = 0; c < n; ++c) {
    const double v = static_cast<double>(in[c]) * scale;
    const bool bad = !(std::fabs(v) < range);  // out of range, infinite or NaN
    const Parts p = bad ? Parts{0, 0, kOverflowFlag} : split(v);
    if constexpr (Overwrite) {
      lo[c] = p.lo;
      mid[c] = p.mid;
      top[c] = p.top;
    } else {
      lo[c] += p.lo;
      mid[c] += p.mid;
      top[c] += p.top;
    }
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FSDP_EXACT_AVX2 1
// deposit_row<float>, four values at a time, from the float's bits: |x| * 2^scale_exp is
// m * 2^(e - bias), an integer m of 24 bits shifted, whose bits are the parts; the same parts as
// split() (test Determinism.VectorizedDepositGivesTheScalarParts).
// See Note [Deterministic training] in docs/design.md.
template <bool Overwrite>
__attribute__((target("avx2"))) void deposit_float_avx2(const float* __restrict in, int64_t n, int64_t* __restrict lo,
                                                        int64_t* __restrict mid, int64_t* __restrict top,
                                                        int scale_exp) {
  const int64_t bias = 150 - scale_exp, max_e = bias + kRangeExp - 24;  // a larger e is out of range
  const __m256i ff = _mm256_set1_epi64x(0xff), mantissa = _mm256_set1_epi64x(0x7fffff);
  const __m256i implicit = _mm256_set1_epi64x(0x800000), one = _mm256_set1_epi64x(1), zero = _mm256_setzero_si256();
  const __m256i vbias = _mm256_set1_epi64x(bias), vmax = _mm256_set1_epi64x(max_e), c64 = _mm256_set1_epi64x(64);
  const __m256i low32 = _mm256_set1_epi64x(0xffffffff), flag = _mm256_set1_epi64x(kOverflowFlag);
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) {
    const __m256i bits = _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + c)));
    const __m256i e_raw = _mm256_and_si256(_mm256_srli_epi64(bits, 23), ff);
    const __m256i normal = _mm256_cmpgt_epi64(e_raw, zero);
    const __m256i e = _mm256_blendv_epi8(one, e_raw, normal);  // subnormals: m * 2^(1 - 150)
    const __m256i m = _mm256_or_si256(_mm256_and_si256(bits, mantissa), _mm256_and_si256(implicit, normal));
    const __m256i sign = _mm256_sub_epi64(zero, _mm256_srli_epi64(bits, 31));  // 0 or all ones
    const __m256i bad = _mm256_cmpgt_epi64(e, vmax);                           // out of range, infinite or NaN
    const __m256i sh = _mm256_sub_epi64(e, vbias);
    // Shift counts of 64 or more, negative ones as unsigned too, give 0.
    const __m256i below = _mm256_or_si256(_mm256_sllv_epi64(m, sh), _mm256_srlv_epi64(m, _mm256_sub_epi64(zero, sh)));
    const __m256i above = _mm256_srlv_epi64(m, _mm256_sub_epi64(c64, sh));
    __m256i p0 = _mm256_andnot_si256(bad, _mm256_and_si256(below, low32));
    __m256i p1 = _mm256_andnot_si256(bad, _mm256_srli_epi64(below, 32));
    __m256i p2 = _mm256_andnot_si256(bad, above);
    p0 = _mm256_sub_epi64(_mm256_xor_si256(p0, sign), sign);
    p1 = _mm256_sub_epi64(_mm256_xor_si256(p1, sign), sign);
    p2 = _mm256_add_epi64(_mm256_sub_epi64(_mm256_xor_si256(p2, sign), sign), _mm256_and_si256(bad, flag));
    auto* l = reinterpret_cast<__m256i*>(lo + c);
    auto* md = reinterpret_cast<__m256i*>(mid + c);
    auto* t = reinterpret_cast<__m256i*>(top + c);
    if constexpr (Overwrite) {
      _mm256_storeu_si256(l, p0);
      _mm256_storeu_si256(md, p1);
      _mm256_storeu_si256(t, p2);
    } else {
      _mm256_storeu_si256(l, _mm256_add_epi64(_mm256_loadu_si256(l), p0));
      _mm256_storeu_si256(md, _mm256_add_epi64(_mm256_loadu_si256(md), p1));
      _mm256_storeu_si256(t, _mm256_add_epi64(_mm256_loadu_si256(t), p2));
    }
  }
  deposit_row<Overwrite, float>(in + c, n - c, lo + c, mid + c, top + c, scale_exp);
}

// Whether the grid keeps every float of exponent 1 (zeros, subnormals) in range, so that the
// exponent alone tells what is out of range, as split()'s magnitude test does.
bool avx2_grid(int scale_exp) { return 150 - scale_exp + kRangeExp - 24 >= 1; }

#endif

// deposit_row<Overwrite, T>, vectorized where it can be.
template <bool Overwrite, typename T>
void deposit_row_fastest(const T* in, int64_t n, int64_t* lo, int64_t* mid, int64_t* top, int scale_exp) {
#ifdef FSDP_EXACT_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2() && avx2_grid(scale_exp)) {
      deposit_float_avx2<Overwrite>(in, n, lo, mid, top, scale_exp);
      return;
    }
  }
#endif
  deposit_row<Overwrite, T>(in, n, lo, mid, top, scale_exp);
}

}  // namespace

void deposit(const at::Tensor& values, at::Tensor limbs[kLimbs], int scale_exp, bool overwrite) {
  if (on_cpu(values, limbs)) {
    const at::Tensor x = values.reshape(limbs[0].sizes()).contiguous();
    const int64_t rows = limbs[0].dim() == 2 ? limbs[0].size(0) : 1, cols = limbs[0].size(-1);
    const int64_t stride = limbs[0].dim() == 2 ? limbs[0].stride(0) : 0;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "exact::deposit", [&] {
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* in = x.data_ptr<scalar_t>() + r * cols;
        int64_t* lo = limbs[0].data_ptr<int64_t>() + r * stride;
        int64_t* mid = limbs[1].data_ptr<int64_t>() + r * stride;
        int64_t* top = limbs[2].data_ptr<int64_t>() + r * stride;
        if (overwrite)
          deposit_row_fastest<true>(in, cols, lo, mid, top, scale_exp);
        else
          deposit_row_fastest<false>(in, cols, lo, mid, top, scale_exp);
      }
    });
    return;
  }
  // Doubles hold every float, half and bfloat16 exactly; scaling by a power of two, truncation and
  // removing the high part of an integer-valued double are exact, so the parts are exact too.
  at::Tensor d = values.to(at::kDouble);
  at::Tensor n = times_pow2(d, scale_exp).trunc_();
  const at::Tensor bad = n.abs().ge(std::ldexp(1.0, kRangeExp)).logical_or_(n.isnan());
  n.masked_fill_(bad, 0.0);
  at::Tensor top = (n / (kLimbBase * kLimbBase)).trunc_();
  at::Tensor rest = n - top * (kLimbBase * kLimbBase);
  at::Tensor mid = (rest / kLimbBase).trunc_();
  at::Tensor lo = rest - mid * kLimbBase;
  if (overwrite)
    for (int j = 0; j < kLimbs; ++j) limbs[j].zero_();
  limbs[0].add_(lo.to(at::kLong));
  limbs[1].add_(mid.to(at::kLong));
  limbs[2].add_(top.to(at::kLong).add_(bad.to(at::kLong).mul_(kOverflowFlag)));
}

namespace {

// to_double() on elements [i, end) of host limbs: the same operations on each element, in the
// same order.
void to_double_scalar(const int64_t* lo, const int64_t* mid, const int64_t* top, double* v, int64_t i, int64_t end,
                      const std::vector<double>& factors, double divisor) {
  const int64_t mask = static_cast<int64_t>(kLimbBase) - 1;
  for (; i < end; ++i) {
    const int64_t carry = lo[i] >> 32;  // an arithmetic shift: the floor
    const int64_t m = mid[i] + carry;
    const int64_t t = top[i] + (m >> 32);
    double x = (static_cast<double>(t) * kLimbBase + static_cast<double>(m & mask)) * kLimbBase +
               static_cast<double>(lo[i] & mask);
    for (const double f : factors) x = x * f;
    if (divisor != 1.0) x = x / divisor;
    v[i] = t >= kOverflowFlag / 2 ? std::nan("") : x;
  }
}

#ifdef FSDP_EXACT_AVX2
// x >> 32 of signed 64-bit lanes (AVX2 has no 64-bit arithmetic shift).
__attribute__((target("avx2"))) inline __m256i shift_right_32(__m256i x) {
  return _mm256_blend_epi32(_mm256_srli_epi64(x, 32), _mm256_srai_epi32(x, 31), 0xaa);
}

// to_double_scalar(), four elements at a time: the same double operations (no fused multiply-add),
// on conversions from int64 that are exact where used (a lower limb in [0, 2^32) and |t| below
// 2^51 through the exponent-bias trick; a larger t is flagged); a group with a t below -2^51 takes
// the scalar loop.
__attribute__((target("avx2"))) void to_double_avx2(const int64_t* lo, const int64_t* mid, const int64_t* top,
                                                    double* v, int64_t n, const std::vector<double>& factors,
                                                    double divisor) {
  const __m256i mask = _mm256_set1_epi64x(0xffffffff), bits52 = _mm256_set1_epi64x(0x4330000000000000);
  const __m256i bits52s = _mm256_set1_epi64x(0x4338000000000000), floor_t = _mm256_set1_epi64x(-(int64_t(1) << 51));
  const __m256i flag_below = _mm256_set1_epi64x(kOverflowFlag / 2 - 1);
  const __m256d two52 = _mm256_set1_pd(4503599627370496.0), two52s = _mm256_set1_pd(6755399441055744.0);
  const __m256d base = _mm256_set1_pd(kLimbBase), nan = _mm256_set1_pd(std::nan("")), div = _mm256_set1_pd(divisor);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i));
    const __m256i m =
        _mm256_add_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mid + i)), shift_right_32(l));
    const __m256i t =
        _mm256_add_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(top + i)), shift_right_32(m));
    if (_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(floor_t, t))) != 0) {
      to_double_scalar(lo, mid, top, v, i, i + 4, factors, divisor);
      continue;
    }
    const __m256d td = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_add_epi64(t, bits52s)), two52s);
    const __m256d md = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(_mm256_and_si256(m, mask), bits52)), two52);
    const __m256d ld = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(_mm256_and_si256(l, mask), bits52)), two52);
    __m256d x = _mm256_add_pd(_mm256_mul_pd(_mm256_add_pd(_mm256_mul_pd(td, base), md), base), ld);
    for (const double f : factors) x = _mm256_mul_pd(x, _mm256_set1_pd(f));
    if (divisor != 1.0) x = _mm256_div_pd(x, div);
    x = _mm256_blendv_pd(x, nan, _mm256_castsi256_pd(_mm256_cmpgt_epi64(t, flag_below)));
    _mm256_storeu_pd(v + i, x);
  }
  to_double_scalar(lo, mid, top, v, i, n, factors, divisor);
}
#endif

// to_double() in one pass over host limbs: the same operations on each element, in the same order.
at::Tensor to_double_on_cpu(at::Tensor limbs[kLimbs], int scale_exp, double divisor) {
  std::vector<double> factors;  // times_pow2()'s steps
  for (int e = -scale_exp; e != 0;) {
    const int step = std::clamp(e, -512, 512);
    factors.push_back(std::ldexp(1.0, step));
    e -= step;
  }
  at::Tensor out = at::empty(limbs[0].sizes(), limbs[0].options().dtype(at::kDouble));
  const int64_t* lo = limbs[0].data_ptr<int64_t>();
  const int64_t* mid = limbs[1].data_ptr<int64_t>();
  const int64_t* top = limbs[2].data_ptr<int64_t>();
#ifdef FSDP_EXACT_AVX2
  if (cpu_has_avx2()) {
    to_double_avx2(lo, mid, top, out.data_ptr<double>(), out.numel(), factors, divisor);
    return out;
  }
#endif
  to_double_scalar(lo, mid, top, out.data_ptr<double>(), 0, out.numel(), factors, divisor);
  return out;
}

// sum() over host doubles from element i on.
void sum_scalar(const double* in, int64_t i, int64_t n, double scale, std::array<int64_t, kLimbs>& out) {
  for (; i < n; ++i) {
    const Parts p = split(in[i] * scale);
    out[0] += p.lo;
    out[1] += p.mid;
    out[2] += p.top;
  }
}

#ifdef FSDP_EXACT_AVX2
// sum_scalar() from i = 0, four values at a time, from the double's bits as deposit_float_avx2()
// from the float's (a 53-bit integer shifted); a group holding a value whose exponent puts it
// beyond the range takes the scalar loop.
__attribute__((target("avx2"))) void sum_double_avx2(const double* in, int64_t n, int scale_exp,
                                                     std::array<int64_t, kLimbs>& out) {
  // Exponents above max_e: out of range, infinite or NaN.
  const int64_t bias = 1075 - scale_exp, max_e = std::min<int64_t>(bias + kRangeExp - 53, 2046);
  const __m256i e_mask = _mm256_set1_epi64x(0x7ff), mantissa = _mm256_set1_epi64x((int64_t(1) << 52) - 1);
  const __m256i implicit = _mm256_set1_epi64x(int64_t(1) << 52), one = _mm256_set1_epi64x(1);
  const __m256i zero = _mm256_setzero_si256(), vbias = _mm256_set1_epi64x(bias), vmax = _mm256_set1_epi64x(max_e);
  const __m256i c64 = _mm256_set1_epi64x(64), low32 = _mm256_set1_epi64x(0xffffffff);
  __m256i a0 = zero, a1 = zero, a2 = zero;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m256i e_raw = _mm256_and_si256(_mm256_srli_epi64(bits, 52), e_mask);
    const __m256i normal = _mm256_cmpgt_epi64(e_raw, zero);
    const __m256i e = _mm256_blendv_epi8(one, e_raw, normal);  // subnormals: m * 2^(1 - 1075)
    if (_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(e, vmax))) != 0) {
      std::array<int64_t, kLimbs> part{};
      sum_scalar(in, i, i + 4, std::ldexp(1.0, scale_exp), part);
      a0 = _mm256_add_epi64(a0, _mm256_set_epi64x(0, 0, 0, part[0]));
      a1 = _mm256_add_epi64(a1, _mm256_set_epi64x(0, 0, 0, part[1]));
      a2 = _mm256_add_epi64(a2, _mm256_set_epi64x(0, 0, 0, part[2]));
      continue;
    }
    const __m256i m = _mm256_or_si256(_mm256_and_si256(bits, mantissa), _mm256_and_si256(implicit, normal));
    const __m256i sign = _mm256_sub_epi64(zero, _mm256_srli_epi64(bits, 63));  // 0 or all ones
    const __m256i sh = _mm256_sub_epi64(e, vbias);
    // Shift counts of 64 or more, negative ones as unsigned too, give 0.
    const __m256i below = _mm256_or_si256(_mm256_sllv_epi64(m, sh), _mm256_srlv_epi64(m, _mm256_sub_epi64(zero, sh)));
    const __m256i above = _mm256_srlv_epi64(m, _mm256_sub_epi64(c64, sh));
    const __m256i p0 = _mm256_and_si256(below, low32), p1 = _mm256_srli_epi64(below, 32);
    a0 = _mm256_add_epi64(a0, _mm256_sub_epi64(_mm256_xor_si256(p0, sign), sign));
    a1 = _mm256_add_epi64(a1, _mm256_sub_epi64(_mm256_xor_si256(p1, sign), sign));
    a2 = _mm256_add_epi64(a2, _mm256_sub_epi64(_mm256_xor_si256(above, sign), sign));
  }
  alignas(32) int64_t lanes[kLimbs][4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), a0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[1]), a1);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[2]), a2);
  for (int j = 0; j < kLimbs; ++j) out[j] += lanes[j][0] + lanes[j][1] + lanes[j][2] + lanes[j][3];
  sum_scalar(in, i, n, std::ldexp(1.0, scale_exp), out);
}
#endif

}  // namespace

at::Tensor to_double(at::Tensor limbs[kLimbs], int scale_exp, double divisor) {
  bool cpu = true;
  for (int j = 0; j < kLimbs; ++j)
    cpu = cpu && limbs[j].device().is_cpu() && limbs[j].scalar_type() == at::kLong && limbs[j].is_contiguous() &&
          limbs[j].sizes() == limbs[0].sizes();
  if (cpu) return to_double_on_cpu(limbs, scale_exp, divisor);
  // Carries first, so that the limbs are the one canonical form of the exact sum (the lower two in
  // [0, 2^32)) whatever parts made it up; the conversion then depends on the sum alone.
  const auto base = static_cast<int64_t>(kLimbBase);
  at::Tensor lo = limbs[0];
  at::Tensor carry = at::div(lo, base, "floor");
  lo = lo - carry * base;
  at::Tensor mid = limbs[1] + carry;
  carry = at::div(mid, base, "floor");
  mid = mid - carry * base;
  at::Tensor top = limbs[2] + carry;
  const at::Tensor flagged = top.ge(kOverflowFlag / 2);
  at::Tensor v = (top.to(at::kDouble) * kLimbBase + mid.to(at::kDouble)) * kLimbBase + lo.to(at::kDouble);
  v = times_pow2(v, -scale_exp);
  if (divisor != 1.0) v = v / divisor;
  return v.masked_fill_(flagged, std::nan(""));
}

std::array<int64_t, kLimbs> sum(const at::Tensor& values, int scale_exp) {
  std::array<int64_t, kLimbs> out{};
  if (values.numel() == 0) return out;
  if (values.device().is_cpu() && values.scalar_type() == at::kDouble) {
    const at::Tensor x = values.contiguous();
    const double* in = x.data_ptr<double>();
#ifdef FSDP_EXACT_AVX2
    if (cpu_has_avx2()) {
      sum_double_avx2(in, x.numel(), scale_exp, out);
      return out;
    }
#endif
    sum_scalar(in, 0, x.numel(), std::ldexp(1.0, scale_exp), out);
    return out;
  }
  at::Tensor limbs = at::zeros({kLimbs, values.numel()}, values.options().dtype(at::kLong));
  at::Tensor parts[kLimbs];
  for (int j = 0; j < kLimbs; ++j) parts[j] = limbs.select(0, j);
  deposit(values.reshape({-1}), parts, scale_exp);
  const at::Tensor sums = limbs.sum(1).cpu();
  for (int j = 0; j < kLimbs; ++j) out[j] = sums[j].item<int64_t>();
  return out;
}

int scale_exp_for(double max_abs, int headroom_bits) {
  int e = 0;
  std::frexp(max_abs, &e);  // max_abs < 2^e
  if (max_abs == 0) e = 0;
  return std::clamp(kRangeExp - e - std::max(0, headroom_bits - 26), -900, 900);
}

}  // namespace fsdp::exact
