// The optimizers' state per original parameter, for PlanRequest::optimizer_state
// (include/fsdp/plan_request.h).
#include "fsdp/plan_request.h"

#include <utility>

#include "fsdp/check.h"

namespace fsdp {

OptimizerStateFn per_element_state(const int states) {
  FSDP_CHECK(states >= 0, "per_element_state needs states >= 0 per element, got ", states);
  return [states](const std::string&, at::IntArrayRef, const int64_t piece_numel) {
    return states * piece_numel;
  };
}

OptimizerStateFn adafactor_state(const bool first_moment) {
  return [first_moment](const std::string&, const at::IntArrayRef shape, const int64_t piece_numel) {
    const int64_t second = shape.size() == 2 ? shape[0] + shape[1] : piece_numel;
    return second + (first_moment ? piece_numel : 0);
  };
}

OptimizerStateFn muon_state(std::function<bool(const std::string& name)> muon) {
  FSDP_CHECK(muon != nullptr, "muon_state needs a predicate naming Muon's parameters");
  return [muon = std::move(muon)](const std::string& name, const at::IntArrayRef shape, const int64_t piece_numel) {
    return (shape.size() == 2 && muon(name) ? 1 : 2) * piece_numel;
  };
}

}  // namespace fsdp
