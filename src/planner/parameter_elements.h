#pragma once
// The planner's count of a model's parameter elements (fsdp::calibrate records it, fsdp::plan
// compares it).
#include <torch/torch.h>

#include <cstdint>
#include <set>

namespace fsdp::planner {

// The elements of `root`'s parameters, a tied parameter once.
inline int64_t parameter_elements(const torch::nn::Module& root) {
  int64_t n = 0;
  std::set<const void*> seen;
  for (const auto& p : root.parameters(/*recurse=*/true))
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  return n;
}

}  // namespace fsdp::planner
