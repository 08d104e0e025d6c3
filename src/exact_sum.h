#pragma once
// Exact, order-independent sums of floating-point values (deterministic mode): each value is
// truncated to a multiple of 2^-scale_exp and split into kLimbs signed 64-bit limbs of 32 bits
// each, so that sums of limbs are integer sums, the same in any order, on any number of ranks and
// through any collective that adds int64. See Note [Deterministic training] in docs/design.md.
#include <torch/torch.h>

#include <array>
#include <cstdint>

namespace fsdp::exact {

constexpr int kLimbs = 3;
// The gradients' fixed grid: a quantum of 2^-64, magnitudes below 2^24.
constexpr int kGradScaleExp = 64;
// A value outside the grid or not finite adds this to its top limb (a flag that survives the sum).
constexpr int64_t kOverflowFlag = int64_t(1) << 52;

// Adds the limbs of `values` (floating, any shape, numel n) into `limbs` (int64, kLimbs views of
// numel n each, e.g. acc.select(dim, j)): limbs[j] += part j of trunc(values * 2^scale_exp), or
// with `overwrite`, limbs[j] = that part (their old contents unread).
void deposit(const at::Tensor& values, at::Tensor limbs[kLimbs], int scale_exp, bool overwrite = false);
// The sum of `values` (finite, in range: |values| * 2^scale_exp below 2^88), one part per limb; the
// parts of one tensor of fewer than 2^31 elements never overflow.
std::array<int64_t, kLimbs> sum(const at::Tensor& values, int scale_exp);
// The sums in `limbs` (int64, kLimbs tensors of one shape) as doubles: the exact sum rounded once
// per limb, then times 2^-scale_exp / divisor; NaN where an overflow flag arrived.
at::Tensor to_double(at::Tensor limbs[kLimbs], int scale_exp, double divisor);

// The largest scale_exp whose grid holds values of magnitude up to `max_abs` (finite, >= 0) with
// room for 2^headroom_bits of them in one sum.
int scale_exp_for(double max_abs, int headroom_bits);

}  // namespace fsdp::exact
