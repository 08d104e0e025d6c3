// The optimizer state's bytes per FlatParameter (optimizer_state.h).
#include "planner/optimizer_state.h"

#include <algorithm>
#include <utility>

#include "fsdp/check.h"
#include "fsdp/plan_request.h"

namespace fsdp::planner {

int64_t optimizer_state_bytes(const PlanRequest& request, const UnitPlan& plan, const UnitPlan::FlatParam& fp,
                              const int64_t limit) {
  int64_t states = 0;
  int64_t offset = 0;
  for (const int p : fp.params) {
    const UnitPlan::Param& param = plan.params[p];
    const int64_t numel = param.param.numel();
    const int64_t piece = std::max<int64_t>(0, std::min(offset + numel, limit) - offset);
    offset += numel;
    if (piece == 0) continue;
    states += request.optimizer_state() ? request.optimizer_state()(param.name, param.param.sizes(), piece)
                                        : request.optimizer_states() * piece;
  }
  return states * static_cast<int64_t>(c10::elementSize(plan.params[fp.params.front()].param.scalar_type()));
}

int64_t ignored_state_bytes(const PlanRequest& request, const UnitPlan::Param& param) {
  const int64_t numel = param.param.numel();
  const int64_t states = request.optimizer_state() ? request.optimizer_state()(param.name, param.param.sizes(), numel)
                                                   : request.optimizer_states() * numel;
  return states * static_cast<int64_t>(c10::elementSize(param.param.scalar_type()));
}

}  // namespace fsdp::planner
