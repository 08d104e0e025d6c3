#include "exact_sum.h"

#include <algorithm>
#include <cmath>

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

}  // namespace

void deposit(const at::Tensor& values, at::Tensor limbs[kLimbs], int scale_exp) {
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
  limbs[0].add_(lo.to(at::kLong));
  limbs[1].add_(mid.to(at::kLong));
  limbs[2].add_(top.to(at::kLong).add_(bad.to(at::kLong).mul_(kOverflowFlag)));
}

at::Tensor to_double(at::Tensor limbs[kLimbs], int scale_exp, double divisor) {
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

int scale_exp_for(double max_abs, int headroom_bits) {
  int e = 0;
  std::frexp(max_abs, &e);  // max_abs < 2^e
  if (max_abs == 0) e = 0;
  return std::clamp(kRangeExp - e - std::max(0, headroom_bits - 26), -900, 900);
}

}  // namespace fsdp::exact
