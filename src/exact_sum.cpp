#include "exact_sum.h"

#include <ATen/Dispatch.h>

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

// Whether deposit_on_cpu() takes these: host tensors, limbs of one layout with unit inner stride.
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

// The same parts in one pass.
template <typename T>
void deposit_on_cpu(const at::Tensor& values, at::Tensor limbs[kLimbs], int scale_exp) {
  const at::Tensor x = values.reshape(limbs[0].sizes()).contiguous();
  const int64_t rows = limbs[0].dim() == 2 ? limbs[0].size(0) : 1, cols = limbs[0].size(-1);
  const int64_t stride = limbs[0].dim() == 2 ? limbs[0].stride(0) : 0;
  const double scale = std::ldexp(1.0, scale_exp), range = std::ldexp(1.0, kRangeExp);
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict in = x.data_ptr<T>() + r * cols;
    int64_t* __restrict lo = limbs[0].data_ptr<int64_t>() + r * stride;
    int64_t* __restrict mid = limbs[1].data_ptr<int64_t>() + r * stride;
    int64_t* __restrict top = limbs[2].data_ptr<int64_t>() + r * stride;
    for (int64_t c = 0; c < cols; ++c) {
      const double n = static_cast<double>(in[c]) * scale;
      if (!(std::fabs(n) < range)) {  // out of range, infinite or NaN
        top[c] += kOverflowFlag;
        continue;
      }
      const Parts p = split(n);
      lo[c] += p.lo;
      mid[c] += p.mid;
      top[c] += p.top;
    }
  }
}

}  // namespace

void deposit(const at::Tensor& values, at::Tensor limbs[kLimbs], int scale_exp) {
  if (on_cpu(values, limbs)) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "exact::deposit",
                                    [&] { deposit_on_cpu<scalar_t>(values, limbs, scale_exp); });
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

std::array<int64_t, kLimbs> sum(const at::Tensor& values, int scale_exp) {
  std::array<int64_t, kLimbs> out{};
  if (values.numel() == 0) return out;
  if (values.device().is_cpu() && values.scalar_type() == at::kDouble) {
    const at::Tensor x = values.contiguous();
    const double* in = x.data_ptr<double>();
    const double scale = std::ldexp(1.0, scale_exp);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const Parts p = split(in[i] * scale);
      out[0] += p.lo;
      out[1] += p.mid;
      out[2] += p.top;
    }
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
