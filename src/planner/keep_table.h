#pragma once
// The planner trace's keep table: per operator autograd records, which of its tensors its backward
// keeps, following the saved variables of its backward node in LibTorch's generated
// autograd/generated/Functions.h (Note [Planner operator trace] in docs/design.md).
#include <cstddef>
#include <string_view>

namespace fsdp::planner {

// Which of an operator's tensor arguments its backward keeps (parameters and buffers aside).
enum class KeepArgs {
  kNone,
  kAll,
  kCrosswise,  // a product's factors `argument` and the next: each where the other requires grad
  kDivisor,    // a quotient's: the divisor, and the dividend too where the divisor requires grad
  kOne,        // argument `argument` only (an index, a mask, a target)
  kAllBut,     // every argument but `argument` (a normalization's bias)
};

// What autograd keeps for an operator it records (composite operators keep nothing of their own:
// their parts do), by rule: arguments, and its results from `results_from` on (-1: none).
struct KeepRule {
  KeepArgs arguments = KeepArgs::kNone;
  size_t argument = 0;
  int results_from = -1;
  size_t min_arguments = 0;  // the overload it applies to: one with at least this many arguments
};

// The rule for operator `op` (by its name without "aten::"), or for the out-of-place form of an
// in-place `op`; null where the table has none.
const KeepRule* keep_rule(std::string_view op);

}  // namespace fsdp::planner
