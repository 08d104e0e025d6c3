#include "exact_wire.h"

namespace fsdp::exact {

Wire wire_for(int64_t terms) {
  Wire w;
  if (terms > kMaxWireTerms) return w;
  int h = 0;  // bits for the parts' carries: terms <= 2^h
  while ((int64_t(1) << h) < terms) ++h;
  w.limbs = 2;
  w.low_bits = 62 - h;                        // terms low limbs below 2^62
  w.high_bound = int64_t(1) << (60 - 2 * h);  // terms high limbs below flag / 2 in magnitude
  w.flag = int64_t(1) << (61 - h);            // terms flags below 2^62
  return w;
}

namespace {

constexpr int64_t kLow32 = 0xffffffff;

// x / 2^k rounded down, and x modulo 2^k (in [0, 2^k)), over int64 tensors.
at::Tensor floor_shift(const at::Tensor& x, int k) { return at::div(x, int64_t(1) << k, "floor"); }
at::Tensor low_bits(const at::Tensor& x, int k) { return x - floor_shift(x, k) * (int64_t(1) << k); }

// One element's part from its limbs as deposit() leaves them: the canonical sum split at low_bits.
inline void part_of(int64_t lo, int64_t mid, int64_t top, const Wire& w, int64_t& low, int64_t& high) {
  const int64_t m = mid + (lo >> 32);  // arithmetic shifts: floors
  const int64_t t = top + (m >> 32);
  const int64_t m0 = m & kLow32;
  const int up = w.low_bits - 32;
  low = 0;
  high = w.flag;
  if (t >= kOverflowFlag / 2 || t <= -kOverflowFlag / 2) return;  // flagged, or beyond any wire's range
  const int64_t h = t * (int64_t(1) << (64 - w.low_bits)) + (m0 >> up);
  if (h >= w.high_bound || h <= -w.high_bound) return;
  low = (lo & kLow32) | ((m0 & ((int64_t(1) << up) - 1)) << 32);
  high = h;
}

void check_wire(const at::Tensor& t, const Wire& w, const char* what) {
  TORCH_CHECK(w.limbs == 2, "exact::", what, ": not a two-limb wire form");
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "exact::", what, ": needs contiguous int64");
}

}  // namespace

namespace tensor_ops {

at::Tensor to_wire(const at::Tensor& rows, const Wire& w) {
  check_wire(rows, w, "to_wire");
  const int64_t F = rows.size(0), S = (rows.size(1) - 1) / kLimbs;
  at::Tensor out = rows.view({-1}).narrow(0, 0, F * (2 * S + 1)).view({F, 2 * S + 1});
  const at::Tensor lo = rows.narrow(1, 0, S), mid = rows.narrow(1, S, S), top = rows.narrow(1, 2 * S, S);
  const int up = w.low_bits - 32;
  const at::Tensor m = mid + floor_shift(lo, 32);
  const at::Tensor t = top + floor_shift(m, 32);
  const at::Tensor m0 = low_bits(m, 32);
  at::Tensor low = low_bits(lo, 32) + low_bits(m0, up) * (int64_t(1) << 32);
  at::Tensor high = t * (int64_t(1) << (64 - w.low_bits)) + floor_shift(m0, up);
  const at::Tensor flagged = t.abs().ge(kOverflowFlag / 2).logical_or_(high.abs().ge(w.high_bound));
  low.masked_fill_(flagged, 0);
  high.masked_fill_(flagged, w.flag);
  out.copy_(at::cat({low, high, rows.narrow(1, kLimbs * S, 1)}, 1));
  return out;
}

void renormalize(const at::Tensor& sum, int64_t S, const Wire& w) {
  check_wire(sum, w, "renormalize");
  const at::Tensor flat = sum.view({-1});
  at::Tensor low = flat.narrow(0, 0, S), high = flat.narrow(0, S, S);
  const at::Tensor was_flagged = high.ge(w.flag / 2);
  const at::Tensor h = high + floor_shift(low, w.low_bits);
  const at::Tensor flagged = was_flagged.logical_or_(h.abs().ge(w.high_bound));
  low.copy_(low_bits(low, w.low_bits).masked_fill_(flagged, 0));
  high.copy_(h.masked_fill(flagged, w.flag));
}

void from_wire(const at::Tensor& sum, int64_t S, const at::Tensor& limbs, const Wire& w) {
  check_wire(sum, w, "from_wire");
  const int down = 64 - w.low_bits, up = w.low_bits - 32;
  const at::Tensor flat = sum.view({-1});
  const at::Tensor low = flat.narrow(0, 0, S), high = flat.narrow(0, S, S);
  const at::Tensor flagged = high.ge(w.flag / 2);
  const at::Tensor l0 = low_bits(low, 32).masked_fill_(flagged, 0);
  const at::Tensor l1 = (floor_shift(low, 32) + low_bits(high, down) * (int64_t(1) << up)).masked_fill_(flagged, 0);
  const at::Tensor l2 = floor_shift(high, down).masked_fill_(flagged, kOverflowFlag);
  limbs.view({-1}).narrow(0, 0, kLimbs * S).copy_(at::cat({l0, l1, l2}));
}

}  // namespace tensor_ops

at::Tensor to_wire(const at::Tensor& rows, const Wire& w) {
  check_wire(rows, w, "to_wire");
  TORCH_CHECK(rows.dim() == 2 && (rows.size(1) - 1) % kLimbs == 0, "exact::to_wire: rows must be [F, 3 S + 1]");
  const int64_t F = rows.size(0), S = (rows.size(1) - 1) / kLimbs, in_row = kLimbs * S + 1, out_row = 2 * S + 1;
  const at::Tensor flat = rows.view({-1});
  at::Tensor out = flat.narrow(0, 0, F * out_row).view({F, out_row});
  if (rows.device().is_cpu()) {
    // Element by element, in order: each write lands on limbs already read (so no restrict).
    int64_t* p = flat.data_ptr<int64_t>();
    for (int64_t r = 0; r < F; ++r) {
      const int64_t* in = p + r * in_row;
      int64_t* o = p + r * out_row;
      for (int64_t c = 0; c < S; ++c) {
        int64_t low = 0, high = 0;
        part_of(in[c], in[S + c], in[2 * S + c], w, low, high);
        o[c] = low;
        o[S + c] = high;
      }
      o[2 * S] = in[kLimbs * S];
    }
    return out;
  }
  return tensor_ops::to_wire(rows, w);
}

void renormalize(const at::Tensor& sum, int64_t S, const Wire& w) {
  check_wire(sum, w, "renormalize");
  const at::Tensor flat = sum.view({-1});
  TORCH_CHECK(flat.numel() >= 2 * S, "exact::renormalize: fewer than 2 S elements");
  if (sum.device().is_cpu()) {
    int64_t* low = flat.data_ptr<int64_t>();
    int64_t* high = low + S;
    const int64_t mask = (int64_t(1) << w.low_bits) - 1;
    for (int64_t c = 0; c < S; ++c) {
      const int64_t h = high[c] + (low[c] >> w.low_bits);
      const bool flagged = high[c] >= w.flag / 2 || h >= w.high_bound || h <= -w.high_bound;
      low[c] = flagged ? 0 : low[c] & mask;
      high[c] = flagged ? w.flag : h;
    }
    return;
  }
  tensor_ops::renormalize(sum, S, w);
}

void from_wire(const at::Tensor& sum, int64_t S, const at::Tensor& limbs, const Wire& w) {
  check_wire(sum, w, "from_wire");
  check_wire(limbs, w, "from_wire");
  TORCH_CHECK(sum.numel() >= 2 * S && limbs.numel() >= kLimbs * S && sum.device() == limbs.device(),
              "exact::from_wire: needs 2 S sums and room for 3 S limbs on one device");
  const int down = 64 - w.low_bits, up = w.low_bits - 32;
  if (sum.device().is_cpu()) {
    // Element by element, in order: element c writes where it read, or beyond the sums.
    const int64_t* in = sum.data_ptr<int64_t>();
    int64_t* out = limbs.data_ptr<int64_t>();
    for (int64_t c = 0; c < S; ++c) {
      const int64_t low = in[c], high = in[S + c];
      const bool flagged = high >= w.flag / 2;
      out[c] = flagged ? 0 : low & kLow32;
      out[S + c] = flagged ? 0 : (low >> 32) + ((high & ((int64_t(1) << down) - 1)) << up);
      out[2 * S + c] = flagged ? kOverflowFlag : high >> down;
    }
    return;
  }
  tensor_ops::from_wire(sum, S, limbs, w);
}

}  // namespace fsdp::exact
