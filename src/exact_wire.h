#pragma once
// The wire form of exact sums (deterministic mode): the limbs of exact_sum.h carried into two
// limbs per element for a reduction, and back. See Note [Deterministic training] in docs/design.md.
#include <torch/torch.h>

#include <cstdint>

#include "exact_sum.h"

namespace fsdp::exact {

// The form exact sums travel in (Note [Deterministic training]): while a sum meets at most
// kMaxWireTerms parts (a part per rank), two limbs per element, a low one holding the sum modulo
// 2^low_bits and a high one the rest, with room for the parts' carries; beyond that, the kLimbs.
constexpr int64_t kMaxWireTerms = 256;
struct Wire {
  int limbs = kLimbs;      // 2, or kLimbs (the limbs as deposit() leaves them)
  int low_bits = 0;        // a part's low limb is in [0, 2^low_bits)
  int64_t high_bound = 0;  // a part's high limb is below it in magnitude, or the part is flagged
  int64_t flag = 0;        // a flagged part's high limb (its element becomes NaN)
};
// The wire form for sums of up to `terms` parts.
Wire wire_for(int64_t terms);
// In place, for a two-limb `wire`: each row [limb 0, limb 1, limb 2, tail] (S, S, S and 1 elements)
// of `rows` (int64 [F, 3 S + 1], contiguous) becomes the part [low, high, tail] (S, S, 1), the rows
// packed from the storage's start; returns that [F, 2 S + 1] view. A sum out of the wire's range
// becomes a flagged part.
at::Tensor to_wire(const at::Tensor& rows, const Wire& wire);
// In place: a sum of parts (int64, [low, high] of S elements each, then anything) becomes one part
// again, flagged where it is out of range.
void renormalize(const at::Tensor& sum, int64_t S, const Wire& wire);
// A sum of parts (int64, [low, high] of S elements each) as kLimbs limbs, written over the first
// kLimbs * S elements of `limbs` (int64, contiguous; it may be the sum's own storage from the same
// start); to_double() of them gives the bits it gives for the same sum deposited as limbs.
void from_wire(const at::Tensor& sum, int64_t S, const at::Tensor& limbs, const Wire& wire);
// The same three as tensor operations (what other devices run; the functions above loop on the CPU).
namespace tensor_ops {
at::Tensor to_wire(const at::Tensor& rows, const Wire& wire);
void renormalize(const at::Tensor& sum, int64_t S, const Wire& wire);
void from_wire(const at::Tensor& sum, int64_t S, const at::Tensor& limbs, const Wire& wire);
}  // namespace tensor_ops

}  // namespace fsdp::exact
